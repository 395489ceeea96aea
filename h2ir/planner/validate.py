"""Semantic checks of a Plan against a model's costs and a cluster.

`validate_plan` raises H2Error at the first mistake, pointing at the .h2plan line (and column,
when the plan came from text: Plan.locations) of the statement or option at fault, and returns
a list of warnings for things that are legal but probably not what the user wants.

Checks, in order: known words and positive numbers (for plans not built by the parser), each
stage's chip type, chips == dp * tp, TP divides the attention heads, chips per type against the
cluster (at most what it has: chips may stay idle, and a type's stages may have different tp
and sit anywhere in the order, e.g. A-B-A), batch divisibility, layer assignment (unknown /
twice / not contiguous / out of model order / missing), the MoE section, ZeRO (zero=1 not on an
EP stage), and finally memory
per device through `h2ir.planner.resource.stage_memory` (the same model the planner and simulator use).
"""
from __future__ import annotations

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_MICROBATCHES, MAX_SEQ_LEN, H2Error
from h2ir.planner.resource import ep_groups, stage_memory
from h2ir.planner.divisors import divisors
from h2ir.plans.plan import (A2A_ALGOS, MIGRATION, PLACEMENTS, RECOMPUTE, SCHEDULES, ZERO_STAGES,
                             Plan)
from h2ir.planner.simulate import plan_chunks
from h2ir.schedule.streams import WorkerLayout, worker_hosts

# how many of a stage's biggest memory consumers an out-of-memory error lists
_TOP_CONSUMERS = 4


def validate_plan(plan: Plan, costs: ModelCosts, cluster: Cluster) -> list[str]:
    """Raise H2Error if `plan` cannot run `costs`' model on `cluster`; return warnings."""
    v = _Validator(plan, costs, cluster)
    v.plan_values()
    v.stages()
    v.virtual()
    v.chip_totals()
    v.batch()
    v.layers()
    v.moe()
    v.zero()
    v.memory()
    return v.warnings()


class _Validator:
    def __init__(self, plan: Plan, costs: ModelCosts, cluster: Cluster):
        self.plan = plan
        self.costs = costs
        self.cluster = cluster
        self.names = costs.layer_names()
        self.index = {n: i for i, n in enumerate(self.names)}

    # -- where errors point

    def fail(self, message: str, key: str | None = None, line: int | None = None,
             hint: str | None = None):
        loc = self.plan.locations.get(key) if key else None
        col = None
        if loc:
            line, col = loc
        elif key and key.startswith("stage.") and line is None:
            line = self._stage_line(int(key.split(".")[1]))
        elif key and key.startswith("moe") and self.plan.moe is not None and line is None:
            line = self.plan.moe.line or None
        raise H2Error(message, file=self.plan.source, line=line or None, col=col, hint=hint)

    def _stage_line(self, i: int) -> int | None:
        return self.plan.stages[i].line or None

    def _stage_key(self, i: int, option: str) -> str:
        """The option's own location if the text had it, else the stage statement's."""
        key = f"stage.{i}.{option}"
        return key if key in self.plan.locations else f"stage.{i}"

    # -- checks

    def plan_values(self):
        p = self.plan
        if p.schedule not in SCHEDULES:
            self.fail(f"unknown schedule '{p.schedule}'; expected one of: {', '.join(SCHEDULES)}",
                      "schedule")
        for value, what, key in ((p.global_batch, "global batch", "batch.global"),
                                 (p.micro_batch, "micro-batch", "batch.micro"),
                                 (p.seq_len, "sequence length", "batch.seq"),
                                 (p.dp, "dp", "dp")):
            if not _is_positive_int(value):
                self.fail(f"{what} must be a positive integer, got {value!r}", key)
        for value, hi, key in ((p.global_batch, MAX_GLOBAL_BATCH, "batch.global"),
                               (p.micro_batch, MAX_MICRO_BATCH, "batch.micro"),
                               (p.seq_len, MAX_SEQ_LEN, "batch.seq")):
            if value > hi:                # a typo, not a batch: h2ir/errors.py has the bounds
                self.fail(f"{key.replace('.', ' ', 1)}={value} is "
                          f"larger than h2 plans for (at most {hi:,})", key)
        m = p.global_batch // (p.dp * p.micro_batch)
        if m > MAX_MICROBATCHES:
            self.fail(f"global={p.global_batch} over dp {p.dp} x micro={p.micro_batch} is "
                      f"{m:,} micro-batches per step; at most {MAX_MICROBATCHES:,}", "batch",
                      hint="raise micro= or dp, or lower global=")
        if not p.stages:
            self.fail("the plan has no stages")

    def stages(self):
        p = self.plan
        for i, s in enumerate(p.stages):
            for value, what in ((s.chips, "chips"), (s.tp, "tp")):
                if not _is_positive_int(value):
                    self.fail(f"stage {i}: {what} must be a positive integer, got {value!r}",
                              self._stage_key(i, what))
            if s.recompute not in RECOMPUTE:
                self.fail(f"stage {i}: unknown recompute '{s.recompute}'; expected one of: "
                          f"{', '.join(RECOMPUTE)}", self._stage_key(i, "recompute"))
            if not s.layers:
                self.fail(f"stage {i} has no layers", self._stage_key(i, "layers"))
            if s.chip not in self.cluster.chip_types or self.cluster.count(s.chip) == 0:
                have = ", ".join(f"{c} ({self.cluster.count(c)})" for c in self.cluster.chip_types
                                 if self.cluster.count(c)) or "none"
                self.fail(f"stage {i}: chip type '{s.chip}' is not in cluster "
                          f"'{self.cluster.name}' (it has: {have})", self._stage_key(i, "chip"))
            if s.chips != p.dp * s.tp:
                self.fail(f"stage {i}: chips={s.chips} but dp x tp = {p.dp} x {s.tp} = "
                          f"{p.dp * s.tp}; a stage's chips count every replica", 
                          self._stage_key(i, "chips"),
                          hint=f"use chips={p.dp * s.tp}, or change tp or dp")
            heads = self.costs.n_heads
            if heads and heads % s.tp:
                self.fail(f"stage {i}: tp={s.tp} does not divide the model's {heads} attention "
                          f"heads", self._stage_key(i, "tp"),
                          hint="tp must divide the head count: "
                          + ", ".join(str(d) for d in divisors(heads)))

    def virtual(self):
        """A virtual-stage schedule: the stages are chunks, `virtual` per worker; the chunks of
        one worker share its chip type (and chips), and run without tp or ep."""
        p = self.plan
        if not p.is_virtual:
            return
        n = len(p.stages)
        if p.virtual < 2 or n % p.virtual:
            self.fail(f"schedule {p.schedule} virtual={p.virtual}: the plan's {n} stages are "
                      f"its chunks and must be a multiple of {p.virtual}", "schedule",
                      hint=f"write {p.virtual} stages per worker, in model order")
        for i, s in enumerate(p.stages):
            if s.tp != 1 or p.stage_ep(i) != 1:
                self.fail(f"stage {i}: schedule {p.schedule} runs chunks with tp=1 and no "
                          "expert parallelism", self._stage_key(i, "tp"))
        for w, chunks in enumerate(plan_chunks(p)):
            first = p.stages[chunks[0]]
            for j in chunks[1:]:
                if (p.stages[j].chip, p.stages[j].chips) != (first.chip, first.chips):
                    self.fail(f"stage {j} runs on the worker of stage {chunks[0]} (schedule "
                              f"{p.schedule}: worker {w} holds stages "
                              f"{', '.join(map(str, chunks))}) but asks for chip={p.stages[j].chip} "
                              f"chips={p.stages[j].chips}, not chip={first.chip} "
                              f"chips={first.chips}", self._stage_key(j, "chip"))
        if p.schedule in ("interleaved", "izb") and p.num_microbatches % p.num_physical:
            self.fail(f"schedule {p.schedule} needs the micro-batches per step "
                      f"({p.num_microbatches}) to be a multiple of the {p.num_physical} workers "
                      "of a pipeline", "batch",
                      hint="change global=, micro= or dp, or use zbv")

    def chip_totals(self):
        used: dict[str, int] = {}
        leaders = {cs[0] for cs in plan_chunks(self.plan)}
        for i, s in enumerate(self.plan.stages):
            if i not in leaders:         # a later chunk of a worker counted with its first
                continue
            used[s.chip] = used.get(s.chip, 0) + s.chips
            have = self.cluster.count(s.chip)
            if used[s.chip] > have:
                users = [j for j, t in enumerate(self.plan.stages[:i + 1]) if t.chip == s.chip]
                self.fail(f"stages {_listing(users)} request {used[s.chip]} {s.chip} chips but "
                          f"cluster '{self.cluster.name}' has {have}",
                          self._stage_key(i, "chips"))

    def batch(self):
        p = self.plan
        per_step = p.micro_batch * p.dp
        if p.global_batch % per_step:
            self.fail(f"global batch {p.global_batch} is not divisible by micro-batch x dp = "
                      f"{p.micro_batch} x {p.dp} = {per_step}", "batch.global",
                      hint="each replica runs global / (micro x dp) whole micro-batches per step")

    def layers(self):
        owner: dict[str, int] = {}
        spans: list[tuple[int, int]] = []
        for i, s in enumerate(self.plan.stages):
            key = self._stage_key(i, "layers")
            seen_here: set[str] = set()
            for name in s.layers:
                if name not in self.index:
                    self.fail(f"stage {i}: unknown layer '{name}'; model '{self.costs.model}' has "
                              f"{_describe_layers(self.names)}", key)
                if name in seen_here:
                    self.fail(f"stage {i}: layer '{name}' is listed twice", key)
                if name in owner:
                    j = owner[name]
                    self.fail(f"layer '{name}' is assigned twice: to stage {j} (line "
                              f"{self._stage_line(j) or '?'}) and to stage {i}", key)
                seen_here.add(name)
                owner[name] = i
            idx = [self.index[n] for n in s.layers]
            for a, b in zip(idx, idx[1:]):
                if b < a:
                    self.fail(f"stage {i} lists '{self.names[b]}' after '{self.names[a]}'; "
                              f"layers must be in model order", key)
            for a, b in zip(idx, idx[1:]):
                if b != a + 1:
                    self.fail(f"stage {i}'s layers are not contiguous: '{self.names[a]}' is "
                              f"followed by '{self.names[b]}' (a stage runs one unbroken range "
                              f"of layers)", key)
            spans.append((idx[0], idx[-1]))
        missing = [n for n in self.names if n not in owner]
        if missing:
            first = self.index[missing[0]]
            # point at the stage that follows the gap (or the last stage)
            after = next((i for i, (a, _) in enumerate(spans) if a > first), len(spans) - 1)
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            self.fail(f"layer '{missing[0]}'{more} is not assigned to any stage",
                      self._stage_key(after, "layers"),
                      hint="every layer of the model must belong to exactly one stage")
        for i in range(1, len(spans)):
            if spans[i][0] != spans[i - 1][1] + 1:
                self.fail(f"stages out of model order: stage {i} starts at "
                          f"'{self.names[spans[i][0]]}' but stage {i - 1} ends at "
                          f"'{self.names[spans[i - 1][1]]}'", self._stage_key(i, "layers"),
                          hint="stages are listed first to last in model order")

    def moe(self):
        m = self.plan.moe
        if m is None:
            for i, s in enumerate(self.plan.stages):
                if s.ep is not None and s.ep != 1:
                    self.fail(f"stage {i}: ep={s.ep} but the plan has no 'moe' section",
                              self._stage_key(i, "ep"), hint="add e.g. `moe ep=1 a2a=flat`")
            return
        moe_layers = [l for l in self.costs.layers if l.moe is not None]
        if not moe_layers:
            self.fail(f"a 'moe' section, but model '{self.costs.model}' has no MoE layers", "moe")
        self._moe_values(m)
        # An expert group is `ep` data-parallel replicas of one stage (Plan.stage_ep; the
        # compiler's `fwd ep[..]` groups): ep divides dp and the experts of every MoE layer the
        # stage holds. The moe section's ep is checked against every MoE layer when no stage
        # overrides it.
        experts = sorted({l.moe.num_experts for l in moe_layers})
        for i in range(len(self.plan.stages)):
            self._stage_ep(i, experts)

    def _moe_values(self, m):
        """The moe section's own values: ep, placement, all-to-all, migration, capacity."""
        if not _is_positive_int(m.ep):
            self.fail(f"moe: ep must be a positive integer, got {m.ep!r}", "moe.ep")
        for value, allowed, what, key in ((m.placement, PLACEMENTS, "expert placement", "placement"),
                                          (m.a2a, A2A_ALGOS, "all-to-all algorithm", "a2a"),
                                          (m.migration, MIGRATION, "migration policy", "migration")):
            if value not in allowed:
                self.fail(f"moe: unknown {what} '{value}'; expected one of: {', '.join(allowed)}",
                          f"moe.{key}")
        if m.migration == "periodic" and not _is_positive_int(m.migration_every):
            self.fail(f"moe: migration=periodic needs a positive interval, got "
                      f"{m.migration_every!r}", "moe.migration")
        cap = getattr(m, "capacity", None)
        if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool)
                                    and cap > 0):
            self.fail(f"moe: capacity must be a positive factor or none, got {cap!r}",
                      "moe.capacity")

    def _stage_ep(self, i: int, experts: list[int]):
        """Stage i's EP degree (its own, else the moe section's) divides dp and the experts of
        the MoE layers it holds (every MoE layer's, for the section's)."""
        s = self.plan.stages[i]
        own = s.ep is not None
        ep = self.plan.stage_ep(i)
        key = self._stage_key(i, "ep") if own else "moe.ep"
        who = f"stage {i}: ep={ep}" if own else f"moe: ep={ep}"
        if own and not _is_positive_int(s.ep):
            self.fail(f"stage {i}: ep must be a positive integer, got {s.ep!r}", key)
        if self.plan.dp % ep:
            self.fail(f"{who} does not divide dp={self.plan.dp}; expert-parallel groups "
                      f"are formed from the data-parallel replicas of a stage", key,
                      hint="ep must divide dp: " + ", ".join(str(d) for d in divisors(self.plan.dp)))
        by_name = {l.name: l for l in self.costs.layers}
        here = sorted({by_name[n].moe.num_experts for n in s.layers
                       if n in by_name and by_name[n].moe is not None})
        for e in (here if own else experts):
            if e % ep:
                self.fail(f"{who} does not divide the {e} experts of the MoE layers", key)

    def zero(self):
        """ZeRO-1 shards AdamW state over a stage's dp group (executor/zero.py); an EP stage's
        experts are averaged over another group (the replicas holding them) and migrate with
        their AdamW state, so zero=1 is refused there."""
        for i, s in enumerate(self.plan.stages):
            if s.zero not in ZERO_STAGES:
                self.fail(f"stage {i}: zero={s.zero!r}; expected 0 or 1", self._stage_key(i, "zero"))
            if s.zero and self.plan.stage_ep(i) > 1:
                self.fail(f"stage {i}: zero=1 with expert parallelism (ep={self.plan.stage_ep(i)}) "
                          "is not supported: expert gradients and AdamW state follow the EP "
                          "groups, not the dp group ZeRO-1 shards over",
                          self._stage_key(i, "zero"), hint="use zero=0 on this stage, or ep=1")

    def memory(self):
        p = self.plan
        if p.is_virtual:        # a worker's chunks share its device
            for w, chunks in enumerate(plan_chunks(p)):
                mems = [stage_memory(self.costs, p, self.cluster, j) for j in chunks]
                total, cap = sum(m.total for m in mems), mems[0].capacity
                if total > cap:
                    self.fail(f"stages {', '.join(map(str, chunks))} (the chunks of worker "
                              f"{w}) do not fit in memory: they need {_bytes(total)} "
                              f"({total:,} B) per device, {p.stages[chunks[0]].chip} has "
                              f"{_bytes(cap)} ({cap:,} B)", f"stage.{chunks[0]}",
                              hint="try recompute=selective or full, zero=1, or fewer layers "
                                   "on these stages")
            return
        for i, s in enumerate(self.plan.stages):
            mem = stage_memory(self.costs, self.plan, self.cluster, i)
            if mem.total > mem.capacity:
                top = sorted(mem.items.items(), key=lambda kv: -kv[1])[:_TOP_CONSUMERS]
                consumers = ", ".join(f"{k} {_bytes(v)}" for k, v in top if v)
                self.fail(f"stage {i} does not fit in memory: needs {_bytes(mem.total)} "
                          f"({mem.total:,} B) per device, {s.chip} has {_bytes(mem.capacity)} "
                          f"({mem.capacity:,} B); biggest: {consumers}", f"stage.{i}",
                          hint="try recompute=selective or full, zero=1 (dp > 1), a larger "
                               "tp, or fewer layers on this stage")

    def warnings(self) -> list[str]:
        out = []
        for i, s in enumerate(self.plan.stages):
            try:
                g = self.cluster.group(s.chip)
            except KeyError:
                continue
            where = f"line {s.line}: " if s.line else ""
            if s.tp > g.chips_per_node:
                out.append(f"{where}stage {i}: tp={s.tp} spans {-(-s.tp // g.chips_per_node)} "
                           f"nodes of {s.chip} ({g.chips_per_node} per node); tensor-parallel "
                           f"traffic will cross the NICs")
            elif g.chips_per_node % s.tp:
                out.append(f"{where}stage {i}: tp={s.tp} does not divide {s.chip}'s "
                           f"{g.chips_per_node} chips per node; some TP groups straddle two nodes")
        out += self._ep_warnings()
        if self.costs.seq_len and self.plan.seq_len != self.costs.seq_len:
            out.append(f"the plan's seq={self.plan.seq_len} differs from the {self.costs.seq_len} "
                       f"the model's costs were traced at; costs are rescaled linearly in tokens")
        return out


    def _ep_warnings(self) -> list[str]:
        """Expert-parallel groups that cross hosts (legal: the all-to-all is costed over the
        NICs it crosses, but it is what HeteroAuto avoids), and ep= on a stage without MoE layers.
        A warning, not an error: hand-written plans may trade the all-to-all for memory."""
        p = self.plan
        if p.moe is None:
            return []
        out = []
        moe_names = {l.name for l in self.costs.layers if l.moe is not None}
        lay = WorkerLayout(p.dp, tuple(s.tp for s in p.stages))
        hosts = worker_hosts(lay, [s.chip for s in p.stages], self.cluster)
        for i, s in enumerate(p.stages):
            ep = p.stage_ep(i)
            where = f"line {s.line}: " if s.line else ""
            if ep <= 1:
                continue
            if not moe_names.intersection(s.layers):
                if s.ep is not None:
                    out.append(f"{where}stage {i}: ep={ep} but the stage holds no MoE layer")
                continue
            spans = max(len({hosts[w] for w in grp})
                        for k in range(s.tp) for grp in ep_groups(lay, i, ep, k))
            if spans > 1:
                out.append(f"{where}stage {i}: its expert-parallel groups of {ep} replicas span "
                           f"{spans} hosts of {s.chip}; the dispatch/combine all-to-alls cross "
                           f"the NICs (a smaller ep, or fewer {s.chip} chips per replica, keeps "
                           f"them inside a node)")
        return out


def _is_positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _listing(items: list[int]) -> str:
    return ", ".join(str(i) for i in items)


def _describe_layers(names: list[str]) -> str:
    blocks = [n for n in names if n.startswith("block.")]
    others = [n for n in names if not n.startswith("block.")]
    if len(blocks) == len(names) - len(others) and blocks:
        head = [n for n in others if names.index(n) < names.index(blocks[0])]
        tail = [n for n in others if names.index(n) > names.index(blocks[-1])]
        return ", ".join(head + [f"{blocks[0]}..{blocks[-1]}"] + tail)
    return ", ".join(names)


def _bytes(n: float) -> str:
    if n >= 2 ** 30:
        return f"{n / 2 ** 30:.2f} GiB"
    if n >= 2 ** 20:
        return f"{n / 2 ** 20:.1f} MiB"
    return f"{int(n):,} B"
