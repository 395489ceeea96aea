"""The plan: which chips run which layers, with what parallelism.

This module holds only the data. `h2ir/plans/dsl.py` prints and parses the `.h2plan` text form,
`h2ir/planner/validate.py` checks a plan against a model and a cluster, `h2ir/planner/search/` (HeteroAuto)
produces plans.

Conventions
- Layer names are the h2ir layer names: 'embed', 'block.<i>', 'head'. In the DSL a bare integer
  range `0..17` means blocks 0 to 17 inclusive.
- `dp` is one global data-parallel degree: the whole pipeline is replicated `dp` times.
- A stage's `chips` counts every chip the stage occupies across all replicas, so
  chips == dp * tp (the validator checks it); each replica of a stage uses `tp` chips.
- Micro-batches per step per replica: m = global_batch / (dp * micro_batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from h2ir.recompute import MODES as RECOMPUTE_MODES

# zb1: ZB-H1 (Qi et al. 2024), backward split in B and W. Virtual-stage schedules (a worker
# holds `virtual` layer chunks; h2ir/schedule/streams.py): interleaved (interleaved 1F1B,
# Narayanan et al. SC'21), izb (interleaved zero bubble), zbv (V-shape zero bubble, 2 chunks)
SCHEDULES = ("1f1b", "gpipe", "zb1", "interleaved", "izb", "zbv")
VIRTUAL_SCHEDULES = ("interleaved", "izb", "zbv")
RECOMPUTE = RECOMPUTE_MODES             # h2ir/recompute.py says what each does
A2A_ALGOS = ("flat", "halo")
PLACEMENTS = ("contiguous", "round_robin", "balanced")
MIGRATION = ("none", "periodic")
ZERO_STAGES = (0, 1)
# which library carries a group that shares a software stack: DiComm, the stack's own
# collective library, or the cheaper of the two per group (h2ir/planner/collectives.py)
COMM_SETTINGS = ("auto", "dicomm", "ccl")


@dataclass
class StagePlan:
    chip: str
    chips: int
    layers: list[str]
    tp: int = 1
    recompute: str = "none"
    ep: int | None = None            # expert-parallel degree of this stage (None: the moe section's)
    # ZeRO stage (Rajbhandari et al. SC'20): 0 replicates AdamW state on every data-parallel
    # replica; 1 shards it over the stage's dp group (gradients reduce-scattered, each replica
    # updates its shard, parameters all-gathered: executor/zero.py)
    zero: int = 0
    # source line in the .h2plan file (0: not from a file); not part of the plan's meaning
    line: int = field(default=0, compare=False)


@dataclass
class MoEPlan:
    ep: int = 1
    placement: str = "contiguous"
    a2a: str = "flat"
    migration: str = "none"
    migration_every: int = 0         # steps between migrations when migration == 'periodic'
    # tokens an expert takes per micro-batch: ceil(capacity * tokens * top_k / experts); None:
    # every token (no token is ever dropped; buffers hold tokens x top_k rows per expert)
    capacity: float | None = None
    threshold: float = 1.3           # migrate when max/mean expert load across EP ranks exceeds it
    line: int = field(default=0, compare=False)


@dataclass
class Plan:
    model: str
    cluster: str
    global_batch: int
    micro_batch: int
    seq_len: int
    stages: list[StagePlan]
    dp: int = 1
    schedule: str = "1f1b"
    moe: MoEPlan | None = None
    # chunks per worker of a virtual-stage schedule: `stages` are then the virtual stages in
    # model order, and a worker runs `virtual` of them (`chunk_stages`)
    virtual: int = 1
    comm: str = "auto"               # COMM_SETTINGS
    source: str | None = field(default=None, compare=False)   # file the plan came from
    # where each statement/option was written: 'batch', 'dp', 'stage.2', 'stage.2.tp', 'moe.ep', ...
    # -> (line, column); filled by h2ir/plans/dsl.py so validation errors can point at the text
    locations: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def num_physical(self) -> int:
        """Pipeline stages that are workers: the stages, or with virtual stages their number
        over the chunks per worker."""
        return len(self.stages) // self.virtual if self.is_virtual else len(self.stages)

    @property
    def is_virtual(self) -> bool:
        return self.schedule in VIRTUAL_SCHEDULES

    @property
    def num_workers(self) -> int:
        """Executor workers: one per (replica, stage) (TP groups count as one worker)."""
        return self.dp * self.num_physical

    def worker(self, replica: int, stage: int) -> int:
        return replica * self.num_physical + stage

    def stage_ep(self, stage: int) -> int:
        """Expert-parallel degree of stage `stage`: its own `ep=`, else the moe section's, else 1.
        An EP group is made of `ep` data-parallel replicas of the stage (expert-data
        parallelism: each replica routes its own tokens), so ep divides dp."""
        own = self.stages[stage].ep
        if own is not None:
            return own
        return self.moe.ep if self.moe is not None else 1

    def stage_of_layer(self, layer: str) -> int:
        for i, s in enumerate(self.stages):
            if layer in s.layers:
                return i
        raise KeyError(layer)
