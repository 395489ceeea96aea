"""One h2x worker: loads its stage for its backend and interprets its instruction stream.

`Worker` subclasses `h2ir.schedule.interpret.StreamInterpreter` (one method per instruction kind,
as torch.fx.Interpreter has one per opcode) and is the real executor; the simulator's
`SimulatedWorker` (h2ir/planner/simulate.py) is the other subclass and times the same stream files
with the cost model.

A worker talks to the launcher through JSON lines on stdout (events) and a status slot in a
shared memory-mapped file (heartbeat, step, instruction index), which is how h2x names the last
instruction of a worker that died or hung.
"""
from __future__ import annotations

import os

from backends.allocator import keep_freed_memory
from backends.threads import limit_torch_threads, pin_to_core, single_thread_env

single_thread_env()     # one compute thread per worker: before numpy/torch load their pools

import argparse
import gc
import json
import math
import sys
import threading
import time
from collections.abc import MutableMapping
from pathlib import Path

import numpy as np

from backends.base import comm_ops, run_program
from backends.memory import LiveTensorMeter

from backends.registry import get_backend
from executor.build import BuildDir
from executor.checkpoint import NonFinite, load_worker_checkpoint, snapshot, write_snapshot
from executor.experts import MoEState, StageComm, migrate_experts, update_loads
from executor.oserrors import local_os_error, os_error_cause, os_error_hint
from executor.zero import zero_shard
from executor.redistribute import recv_shares, send_shares
from executor.data import DataMix, TokenBatches, open_batches
from h2ir.config import decays, learning_rate
from h2ir.errors import H2Error
from h2ir.opset import DROPOUT_SEED_INPUT, dropout_seed
from h2ir.schedule.interpret import StreamInterpreter
from h2ir.schedule.streams import OPS
from h2ir.types import FLOAT_DTYPES, TensorType, dtype_of_host, host_dtype

STATUS_FIELDS = 4          # heartbeat time, step, pc, state (0 running, 1 done, 2 failed)


class Worker(StreamInterpreter):
    def __init__(self, build: BuildDir, wid: int, comm, data: TokenBatches | None, opt: dict,
                 emit, status, device: str = "cpu", stage: int | None = None):
        super().__init__(wid, build.stream(wid) if stage is None else [])
        self.build, self.comm, self.data, self.emit, self.status = build, comm, data, emit, status
        w = build.workers[wid]
        # `stage`: one chunk of a virtual-stage worker (`ChunkedWorker` interprets the stream)
        self.replica, self.stage_idx = w["replica"], w["stage"] if stage is None else stage
        # a virtual-stage build tags boundary transfers with the sending stage: one pair of
        # workers carries several chunks' tensors of one micro-batch
        self.virtual = int(build.manifest.get("virtual", 1)) > 1
        self.S = build.num_stages
        self.m = build.manifest["num_microbatches"]
        st = build.stage(self.stage_idx)
        self.st = st
        # --device overrides the compiled device (e.g. run a cpu build's torch stages on cuda)
        dev = device or st.device or "cpu"
        # the worker's own backend (h2c writes its stage's): replicas of one stage on different
        # backends reduce together through DiComm's host arrays
        backend = w.get("backend") or st.backend
        opts = {"device": dev, "dtype_policy": st.dtype_policy} if backend == "torch" else {}
        self.be = get_backend(backend, **opts)
        self.sig = st.sig
        self.first, self.last = self.stage_idx == 0, self.stage_idx == self.S - 1
        self.opt = opt                  # the recipe: optimizer, lr_schedule, training (h2ir/config)
        self.skipped_in_row = 0
        # tensor parallelism: this worker is rank tp_rank of its stage's TP group and holds that
        # rank's shards (h2ir.schedule.streams.WorkerLayout; executor/redistribute.py)
        self.tp_group = list(w.get("tp_group") or [wid])
        self.tp_rank = int(w.get("tp_rank", 0))
        # expert parallelism: this worker is rank ep_rank of its stage's EP group (replicas
        # sharing out the stage's experts; frontend/moe.py, executor/experts.py)
        self.ep_group = list(w.get("ep_group") or [wid])
        self.ep_rank = int(w.get("ep_rank", 0))
        stage_moe = build.manifest["stages"][self.stage_idx].get("moe")
        self.moe = MoEState(stage_moe, len(self.ep_group), self.ep_rank)
        moe_cfg = build.manifest.get("moe") or {}
        # the comm hook of the stage programs: TP collectives, EP all-to-alls, MoE loads
        self.prog_comm = StageComm(lambda: self.comm, self.be, tp_group=self.tp_group,
                                   tp_rank=self.tp_rank, ep_group=self.ep_group,
                                   a2a=moe_cfg.get("a2a", "flat"),
                                   hosts=[build.workers[g].get("host", 0) for g in self.ep_group],
                                   moe=self.moe, loss_scale=1.0 / self.m) \
            if len(self.tp_group) > 1 or stage_moe or comm_ops(st.fwd) | comm_ops(st.bwd) else None
        self.sent_bytes = {"act": 0, "grad": 0}    # boundary bytes this worker sent (per step)
        weights = build.path / w["weights"] if w.get("weights") else st.weights
        # checked against the build's digests and the types the stage's programs take
        types = {v.name: v.type for g in (st.fwd, st.bwd) for v in g.all_params()}
        self.params = {k: self.be.from_numpy(v, dtype_of_host(v.dtype)) for k, v in
                       build.load_tensors(weights, "weights file", {
                           k: types.get(k) for k in self.sig["params"]}, exact=True).items()}
        self.consts = {k: self.be.from_numpy(v, dtype_of_host(v.dtype)) for k, v in
                       build.load_tensors(st.consts, "constants file", {
                           v.name: v.type for v in st.fwd.consts}, exact=False).items()}
        missing = [k for k in self.sig.get("fixed_inputs", []) if k not in self.consts]
        if missing:       # the model inputs after the token ids live with stage 0's constants
            raise H2Error(f"stage {self.stage_idx}'s constants lack the model input {missing[0]}",
                          str(st.consts), hint="recompile the build with `h2c compile`")
        self.param_names = list(self.sig["params"])
        # tied parameters (h2ir/schedule/streams.py): copies held here are updated by their owner
        tied = build.manifest["stages"][self.stage_idx].get("tied") or {}
        self.tied_copies = list(tied.get("copies", []))
        self.tied_shared = {int(s): list(ps) for s, ps in tied.get("shared", {}).items()}
        self.opt_names = [k for k in self.param_names if k not in self.tied_copies]
        shapes = {k: tuple(self.be.to_numpy(self.params[k]).shape) for k in self.opt_names}
        # ZeRO-1 (a stage's zero=1, dp > 1): AdamW state only for this replica's shard
        self.zero = zero_shard(self, shapes)
        state = self.zero.state_shapes() if self.zero else shapes
        self.exp_avg = {k: self.be.zeros(s, "f32") for k, s in state.items()}
        self.exp_avg_sq = {k: self.be.zeros(s, "f32") for k, s in state.items()}
        self.opt_steps = 0
        # weight decay per parameter (h2ir/config.py `decays`: 1-D, bias and norm excluded)
        self.decayed = {k: decays(k, len(self.be.to_numpy(self.params[k]).shape), opt["optimizer"])
                        for k in self.opt_names}
        self.sharding = self.sig.get("sharding") or {}
        self.in_types = {k: TensorType.parse(v) for k, v in self.sig["input_types"].items()}
        self.out_types = {k: TensorType.parse(v) for k, v in self.sig["output_types"].items()}
        # float boundary values get a gradient back (zeros when nothing flows into them)
        self.grad_inputs = [k for k in self.sig["inputs"]
                            if self.in_types[k].dtype in FLOAT_DTYPES]
        self.grad_outputs = [k for k in self.sig["outputs"] if k != "loss" and
                             self._type_of(k).dtype in FLOAT_DTYPES]
        self.takes_rng = any(v.name == DROPOUT_SEED_INPUT for v in st.fwd.inputs)
        self.trace: list = []
        self.ccl = None         # the stack's collective library (executor/ccl.py), if any group
        # peak memory: live tensors (backends/memory.py); a chunk shares its worker's meter
        self.meter = LiveTensorMeter(self.be.storage)
        self.mem_owner = self
        self.reset_step(0)

    def _type_of(self, name: str) -> TensorType:
        return self.out_types.get(name) or self.in_types[name]

    def reset_step(self, step: int):
        self.step = step
        self.acts_in: dict[int, dict] = {}        # mb -> received boundary inputs
        self.acts_out: dict[int, dict] = {}       # mb -> outputs to send (incl. pass-through)
        self.saved: dict[int, dict] = {}          # mb -> saved for backward
        self.grads_out: dict[int, dict] = {}      # mb -> received output grads
        self.grads_in: dict[int, dict] = {}       # mb -> input grads to send upstream
        self.w_pending: dict[int, dict] = {}      # mb -> what zero-bubble W needs (after B)
        self.param_grads: dict = {}
        self.owned_grads: set = set()
        self.losses: list[float] = []
        self.moe.reset()
        self.verdict: dict | None = None          # the step's global gradient norm (opt_step)

    # ---- compute -------------------------------------------------------------------------------
    def fwd(self, ins):
        mb = ins.mb
        env = self._program_params()
        env.update(self.consts)
        if self.first or self.last:
            tokens, targets = self.data.micro_batch(self.step, self.replica, mb)
        if self.first:
            env[self.sig["inputs"][0]] = self.be.from_numpy(tokens, "i64")
        else:
            env.update(self.acts_in.pop(mb))
        if self.last:
            env["targets"] = self.be.from_numpy(targets, "i64")
        if self.takes_rng:
            m = self.build.manifest
            seed = dropout_seed(m["seed"], self.step, self.replica, m["dp"], self.m, mb)
            env[DROPOUT_SEED_INPUT] = self.be.from_numpy(np.array(seed, dtype=np.int64), "i64")
        outs = self._run(self.st.fwd, env)
        n_out = len(self.sig["outputs"]) - len(self.sig["passthrough"])
        computed = [k for k in self.sig["outputs"] if k not in self.sig["passthrough"]]
        result = dict(zip(computed, outs[:n_out]))
        for k in self.sig["passthrough"]:
            result[k] = env[k]
        saved = {v.name: o for v, o in zip(self.st.fwd.outputs[n_out:], outs[n_out:])}
        # saved values that are program inputs (params, the stage input) are read from env
        self.saved[mb] = saved
        if self.last:
            self.losses.append(float(self.be.to_numpy(self._declared(result["loss"], "loss"))))
        else:
            self.acts_out[mb] = result

    def _bwd_env(self, mb: int) -> tuple[dict, dict]:
        env = self._program_params()
        env.update(self.consts)
        env.update(self.saved.pop(mb))
        received = self.grads_out.pop(mb, {})
        if self.last:
            env["grad.loss"] = self.be.from_numpy(np.asarray(1.0 / self.m, dtype=np.float32), "f32")
        for k in self.sig["tangents"]:
            if k != "loss":
                env[f"grad.{k}"] = received[k]
        return env, received

    def bwd(self, ins):
        env, received = self._bwd_env(ins.mb)
        outs = self._run(self.st.bwd, env)
        self._take_grads(ins.mb, dict(zip(self.sig["input_grads"], outs)), received)

    def bwd_input(self, ins):
        """Zero-bubble B: the gradients of the stage's inputs (sent upstream next); what W will
        need — saved values, output gradients, B's shared intermediates — is kept."""
        zb = self.st.zero_bubble
        env, received = self._bwd_env(ins.mb)
        outs = self._run(zb["bwd_input"], env)
        n = len(zb["b_outputs"])
        keep = {k: env[k] for k in zb["w_inputs"]}
        keep.update(zip(zb["stash"], outs[n:]))
        self.w_pending[ins.mb] = keep
        self._take_grads(ins.mb, dict(zip(zb["b_outputs"], outs[:n])), received)

    def bwd_weight(self, ins):
        """Zero-bubble W: the parameter gradients of a micro-batch whose B ran earlier."""
        zb = self.st.zero_bubble
        env = self._program_params()
        env.update(self.consts)
        env.update(self.w_pending.pop(ins.mb))
        outs = self._run(zb["bwd_weight"], env)
        self._take_grads(ins.mb, dict(zip(zb["w_outputs"], outs)), None)

    # ---- mixed precision (a torch stage's bf16 policy, backends/torch/runtime.py) -------------
    def _program_params(self) -> dict:
        """The parameters as the stage's programs read them: bf16 copies under a bf16 policy."""
        return dict(self.be.compute_params(self.params))

    def _declared(self, t, name: str):
        """A value leaving the stage (boundary tensor, loss) in the dtype its signature declares."""
        if t is None or (name not in self.out_types and name not in self.in_types):
            return t
        return self.be.as_dtype(t, self._type_of(name).dtype)

    def _as_master(self, k: str, g):
        """A parameter gradient in its master's dtype, so micro-batches accumulate in f32."""
        return g if g is None else self.be.as_dtype(g, self.be.dtype_of(self.params[k]))

    def _run(self, graph, env: dict) -> list:
        """Run a stage program, its values and everything the worker holds metered."""
        self.meter.begin(self.mem_owner.held_tensors(env.values()), graph.name)
        return run_program(graph, self.be, env, comm=self.prog_comm, meter=self.meter)

    def held_tensors(self, extra=()):
        """Every tensor this worker holds between instructions (and `extra`)."""
        yield from extra
        for table in (self.params, self.consts, self.exp_avg, self.exp_avg_sq, self.param_grads):
            yield from table.values()
        for per_mb in (self.acts_in, self.acts_out, self.saved, self.grads_out, self.grads_in,
                       self.w_pending):
            for d in per_mb.values():
                yield from d.values()

    def _take_grads(self, mb: int, grads: dict, received: dict | None):
        """Accumulate the parameter gradients in `grads`; with `received` (a backward that makes
        the input gradients), keep those for send_grad."""
        add = self.be.ops["add"]
        for k in self.param_names:
            if k in grads:
                g = self._as_master(k, grads[k])
                if k not in self.param_grads:
                    self.param_grads[k] = g             # may be a view of something else: not ours
                elif k not in self.owned_grads:
                    self.param_grads[k] = add(self.param_grads[k], g)   # a fresh buffer we own
                    self.owned_grads.add(k)
                else:                                   # accumulate in place: no new allocation
                    self.be.accumulate(self.param_grads[k], g)
        if received is not None and not self.first:
            gin = {}
            for k in self.grad_inputs:
                g = grads.get(k)
                if k in self.sig["passthrough"] and k in received:
                    g = received[k] if g is None else add(g, received[k])
                gin[k] = g
            self.grads_in[mb] = gin

    # ---- communication -------------------------------------------------------------------------
    def _tag(self, stage: int) -> str:
        return f"@{stage}" if self.virtual else ""

    # one peer, or a TP group: each sender transmits its share (executor/redistribute.py)
    def send_act(self, ins):
        if self._ccl_p2p(self.wid, ins.peer):
            acts = self.acts_out.pop(ins.mb)
            for k in sorted(acts):      # one order on both ends: NCCL matches sends in order
                self.sent_bytes["act"] += self.ccl.send(ins.peer, self._declared(acts[k], k),
                                                        f"act:{k}", ins.mb)
            return
        for k, t in self.acts_out.pop(ins.mb).items():
            t = self._declared(t, k)
            self.sent_bytes["act"] += send_shares(self.comm, self.be.to_numpy(t), ins,
                                                  f"act:{k}{self._tag(self.stage_idx)}",
                                                  self.stage_idx)

    def recv_act(self, ins):
        if self._ccl_p2p(ins.peer, self.wid):
            self.acts_in[ins.mb] = {k: self.ccl.recv(ins.peer, self.in_types[k].shape,
                                                     self.in_types[k].dtype, f"act:{k}", ins.mb)
                                    for k in sorted(self.sig["inputs"])}
            return
        got = {}
        for k in self.sig["inputs"]:
            a = recv_shares(self.comm, ins, f"act:{k}{self._tag(self.stage_idx - 1)}",
                            self.in_types[k].shape)
            got[k] = self.be.from_numpy(a, self.in_types[k].dtype)
        self.acts_in[ins.mb] = got

    def send_grad(self, ins):
        if self._ccl_p2p(self.wid, ins.peer):
            grads = self.grads_in.pop(ins.mb)
            for k in sorted(grads):
                t = self.in_types[k]
                g = grads[k] if grads[k] is not None else self.be.zeros(t.shape, t.dtype)
                self.sent_bytes["grad"] += self.ccl.send(ins.peer, self._declared(g, k),
                                                         f"grad:{k}", ins.mb)
            return
        for k, g in self.grads_in.pop(ins.mb).items():
            t = self.in_types[k]
            g = self._declared(g, k)
            arr = self.be.to_numpy(g) if g is not None else np.zeros(t.shape, host_dtype(t.dtype))
            self.sent_bytes["grad"] += send_shares(self.comm, arr, ins,
                                                   f"grad:{k}{self._tag(self.stage_idx)}",
                                                   self.stage_idx)

    def recv_grad(self, ins):
        if self._ccl_p2p(ins.peer, self.wid):
            self.grads_out[ins.mb] = {k: self.ccl.recv(ins.peer, self._type_of(k).shape,
                                                       self._type_of(k).dtype, f"grad:{k}", ins.mb)
                                      for k in sorted(self.grad_outputs)}
            return
        got = {}
        for k in self.grad_outputs:
            a = recv_shares(self.comm, ins, f"grad:{k}{self._tag(self.stage_idx + 1)}",
                            self._type_of(k).shape)
            got[k] = self.be.from_numpy(a, self._type_of(k).dtype)
        self.grads_out[ins.mb] = got

    def _ccl_p2p(self, sender: int | None, receiver: int | None) -> bool:
        """A one-peer stage transfer the build puts on the stack's library (executor/ccl.py)."""
        return self.ccl is not None and None not in (sender, receiver) and \
            self.ccl.owns("p2p", (sender, receiver))

    # ---- tied parameters -----------------------------------------------------------------------
    # transfers are tagged with the holder's stage (a virtual-stage worker may hold the owner
    # and the holder chunk both, or chunks of two owners)
    def _holder_on(self, peer: int) -> int:
        """The stage holding copies of this owner's tied parameters on worker `peer`."""
        w = self.build.workers[peer]
        if not self.virtual:
            return w["stage"]
        return next(h for h in self.tied_shared if h in w["chunks"])

    def send_tied_grads(self, ins):
        for k in self.tied_copies:
            self.comm.send(ins.peer, np.ascontiguousarray(self.be.to_numpy(self._grad(k))),
                           kind=f"tied_grad:{k}{self._tag(self.stage_idx)}", mb=0,
                           stage=self.stage_idx)

    def recv_tied_grads(self, ins):
        add = self.be.ops["add"]
        h = self._holder_on(ins.peer)
        for k in self.tied_shared[h]:
            a = self.comm.recv(ins.peer, kind=f"tied_grad:{k}{self._tag(h)}", mb=0)
            self.param_grads[k] = add(self._grad(k), self.be.from_numpy(a, "f32"))
            self.owned_grads.add(k)

    def send_tied_params(self, ins):
        h = self._holder_on(ins.peer)
        for k in self.tied_shared[h]:
            self.comm.send(ins.peer, np.ascontiguousarray(self.be.to_numpy(self.params[k])),
                           kind=f"tied_param:{k}{self._tag(h)}", mb=0, stage=self.stage_idx)

    def recv_tied_params(self, ins):
        for k in self.tied_copies:
            a = self.comm.recv(ins.peer, kind=f"tied_param:{k}{self._tag(self.stage_idx)}", mb=0)
            self.params[k] = self.be.from_numpy(np.array(a), "f32")

    def all_reduce(self, ins):
        experts = set()
        if ins.ep:          # an EP stage: expert gradients have their own group and scale
            experts = {k for ks in self.moe.params.values() for k in ks} & set(self.opt_names)
        names = [k for k in self.opt_names if k not in experts]
        if self.ccl is not None and self.ccl.owns("dp", ins.group):
            self._ccl_all_reduce(ins, names, experts)
            return
        arrs = [np.ascontiguousarray(self.be.to_numpy(self._grad(k))) for k in names]
        self.comm.all_reduce(arrs, group=list(ins.group), op="avg")
        for k, a in zip(names, arrs):
            self.param_grads[k] = self.be.from_numpy(a, "f32")
        if experts:
            # the all-to-all's backward already summed the EP group's tokens into each expert's
            # gradient (each replica's loss scaled by 1/m): divide by ep, and average over the
            # replicas holding the same experts (same EP rank in every EP group)
            ep = ins.ep[0]
            group = [g for i, g in enumerate(ins.group) if i % ep == self.ep_rank]
            names = sorted(experts)
            arrs = [np.ascontiguousarray(self.be.to_numpy(self._grad(k)), dtype=np.float32) / ep
                    for k in names]
            if len(group) > 1:
                self.comm.all_reduce(arrs, group=group, op="avg")
            for k, a in zip(names, arrs):
                self.param_grads[k] = self.be.from_numpy(np.ascontiguousarray(a), "f32")

    def _ccl_all_reduce(self, ins, names: list, experts: set) -> None:
        """`all_reduce` on the stack's library: the same sums and scaling, on the device."""
        group = list(ins.group)
        self.param_grads.update(zip(names, self.ccl.all_reduce([self._grad(k) for k in names],
                                                               group)))
        if experts:
            ep = ins.ep[0]
            sub = [g for i, g in enumerate(group) if i % ep == self.ep_rank]
            names = sorted(experts)
            grads = [self._grad(k).float() / ep for k in names]
            if len(sub) > 1:
                if not self.ccl.owns("dp", sub):
                    raise H2Error(f"worker w{self.wid}: the expert gradients' group {sub} is not "
                                  f"on {self.ccl.library} while its stage's group {group} is",
                                  str(self.build.path / "manifest.json"),
                                  hint="recompile the build with `h2c compile`")
                grads = self.ccl.all_reduce(grads, sub)
            self.param_grads.update(zip(names, grads))

    def use_ccl(self, ccl) -> None:
        """Run the groups the build puts on the stack's collective library there (executor/ccl.py):
        the DP all-reduce, one-peer stage transfers, the programs' TP collectives and EP
        all-to-all."""
        from executor.ccl import EPExchange, TPCollectives
        self.ccl = ccl
        pc = self.prog_comm
        if pc is None:
            return
        if pc.tp is not None and ccl.owns("tp", pc.tp.group):
            pc.tp = TPCollectives(ccl, pc.tp.group, pc.tp.rank)
        if len(pc.ep_group) > 1 and ccl.owns("ep", pc.ep_group):
            exchange = EPExchange(ccl)
            pc.comm_of = lambda: exchange

    def _via(self, ins) -> str | None:
        """The collective library an instruction's transfers run on when it is not DiComm."""
        c = self.ccl
        if c is None:
            return None
        if ins.op == "all_reduce":
            on = c.owns("dp", ins.group)
        elif ins.op in ("send_act", "send_grad"):
            on = self._ccl_p2p(self.wid, ins.peer)
        elif ins.op in ("recv_act", "recv_grad"):
            on = self._ccl_p2p(ins.peer, self.wid)
        elif ins.op in ("fwd", "bwd", "bwd_input", "bwd_weight"):
            on = (ins.group is not None and c.owns("tp", ins.group)) or \
                (ins.ep is not None and c.owns("ep", ins.ep))
        else:
            on = False
        return c.library if on else None

    # ZeRO-1 (executor/zero.py): the all-reduce's halves around the optimizer step
    def reduce_scatter(self, ins):
        self._zero_shard(ins).reduce_scatter(self, ins)

    def all_gather(self, ins):
        self._zero_shard(ins).all_gather(self, ins)

    def _zero_shard(self, ins):
        if self.zero is None:
            raise H2Error(f"worker w{self.wid}: '{ins}' but stage {self.stage_idx} has no "
                          "ZeRO-1 shard (zero=0 in the manifest, or dp 1)",
                          str(self.build.path / "manifest.json"),
                          hint="recompile the build with `h2c compile`")
        return self.zero

    def _grad(self, k):
        if k not in self.param_grads:      # a parameter no micro-batch touched: zero gradient
            self.param_grads[k] = self.be.zeros(tuple(self.be.to_numpy(self.params[k]).shape), "f32")
        return self.param_grads[k]

    def opt_step(self, ins):
        self.apply_update(global_verdict(self, [self]))

    def grad_norm_share(self) -> tuple[float, bool]:
        """(sum of squares, any non-finite) of the gradients this worker counts towards the
        global norm: each logical parameter once over stages, TP shards, EP ranks and replicas
        (after the DP all-reduce the replicas hold equal gradients: replica 0 counts them; an
        EP stage's experts: the first EP group; a TP-replicated parameter: TP rank 0; tied
        copies: their owner). With ZeRO-1 each replica counts its own gradient shard."""
        if self.zero is not None:
            return self.zero.norm_share(self)
        experts = {k for ks in self.moe.params.values() for k in ks} if self.moe else set()
        ep = len(self.ep_group)
        total, bad = 0.0, False
        for k in self.opt_names:
            first_replica = self.replica < ep if k in experts else self.replica == 0
            if not (first_replica and self.tp_counts(k)):
                continue
            n = self.be.l2_norm(self._grad(k))
            if not math.isfinite(n):
                bad = True
            total += n * n
        return total, bad

    def tp_counts(self, k: str) -> bool:
        """This TP rank counts parameter k's gradient towards the norm: its own shard of a
        TP-sharded one, a replicated one on rank 0 only."""
        sh = self.sharding.get(k)
        return len(self.tp_group) == 1 or self.tp_rank == 0 or \
            (sh is not None and sh.get("kind") != "replicated")

    def apply_update(self, v: dict) -> None:
        """AdamW with the step's lr over the decayed and the non-decayed group, gradients scaled
        by the clipping coefficient; nothing on a skipped step (no optimizer state advances)."""
        if v["skip"]:
            return
        self.opt_steps += 1
        if self.zero is not None:           # this replica's shard; all_gather spreads it
            self.zero.apply(self, v)
            return
        o = self.opt["optimizer"]
        names = self.opt_names
        grads = {k: self._grad(k) for k in names}
        if v["scale"] < 1.0:
            c = np.float32(v["scale"])
            grads = {k: self.be.from_numpy(np.asarray(self.be.to_numpy(g)) * c, "f32")
                     for k, g in grads.items()}
            self.meter.sample(self.mem_owner.held_tensors(grads.values()))
        for wd, group in ((o["weight_decay"], [k for k in names if self.decayed[k]]),
                          (0.0, [k for k in names if not self.decayed[k]])):
            if group:
                self.be.adamw_step([self.params[k] for k in group], [grads[k] for k in group],
                                   [self.exp_avg[k] for k in group],
                                   [self.exp_avg_sq[k] for k in group], self.opt_steps, v["lr"],
                                   o["beta1"], o["beta2"], o["eps"], wd)

    def all_to_all(self, ins):
        raise H2Error(f"worker w{self.wid}: '{ins}' — a stand-alone all_to_all instruction; "
                      "expert-parallel exchanges run inside the stage programs (ep[...])",
                      hint="recompile the build with this h2's h2c")

    def migrate(self, ins):
        m = self.build.manifest.get("moe") or {}
        dp_group = [w["id"] for w in self.build.workers
                    if w["stage"] == self.stage_idx and int(w.get("tp_rank", 0)) == self.tp_rank]
        update_loads(self, self.moe, dp_group)
        every = int(m.get("migration_every") or 0)
        if m.get("migration") != "periodic" or not every or (self.step + 1) % every:
            return
        migrate_experts(self, self.moe, list(ins.group), float(m.get("threshold", 1.3)))

    def set_placement_consts(self, placements: dict):
        """The programs' placement constants for `placements` (module path -> expert per slot)."""
        for path, order in placements.items():
            order = np.asarray(order, dtype=np.int64)
            for name, arr in ((f"{path}.h2_placement", order),
                              (f"{path}.h2_slot", np.argsort(order).astype(np.int64))):
                if name in self.consts:
                    self.consts[name] = self.be.from_numpy(arr, "i64")

    # ---- the step loop -------------------------------------------------------------------------
    _LANES = {"fwd": "compute", "bwd": "compute", "bwd_input": "compute", "bwd_weight": "compute",
              "opt_step": "compute"}

    def before_instr(self, pc, ins):
        self.status[:] = (time.time(), self.step, pc, 0)
        self._t0 = time.perf_counter()

    def after_instr(self, pc, ins):
        t1 = time.perf_counter()
        name = {"fwd": f"F{ins.mb}", "bwd": f"B{ins.mb}", "bwd_input": f"I{ins.mb}",
                "bwd_weight": f"W{ins.mb}"}.get(ins.op, str(ins))
        if ins.chunk is not None and ins.op in self._LANES and ins.op != "opt_step":
            name += f"c{ins.chunk}"
        via = self._via(ins)
        if via:
            name += f" via {via}"
        self.trace.append((self._LANES.get(ins.op, "comm"), name, self._t0 - self.t_origin,
                           t1 - self._t0, self.step))

    def run(self, start: int, steps: int, ckpt_every: int, ckpt_dir: Path | None, t_origin: float):
        self.t_origin = t_origin
        # Reference counting frees tensors; the cyclic collector only adds pauses mid-step.
        gc.collect()
        gc.freeze()
        gc.disable()
        for step in range(start, steps):
            self.reset_step(step)
            t_step = time.perf_counter()
            self.run_stream()
            ev = {"event": "step", "worker": self.wid, "step": step,
                  "compute_s": time.perf_counter() - t_step, "sent_bytes": self.take_sent_bytes()}
            loss = self.step_loss()
            if loss is not None:
                ev["loss"] = loss
            if self.verdict is not None:
                ev.update(grad_norm=self.verdict["norm"], lr=self.verdict["lr"],
                          skipped=self.verdict["skip"])
            ev["peak_memory"] = peak_memory(self.be, self.meter)
            self.check_memory_cap(step, ev["peak_memory"])
            if self.moe and self.tp_rank == 0:
                ev["moe"] = self.moe.report()
                if self.prog_comm is not None and self.prog_comm.a2a_calls:
                    ev["a2a"] = {"algo": self.prog_comm.a2a, "calls": self.prog_comm.a2a_calls,
                                 "bytes": self.prog_comm.a2a_bytes}
                    self.prog_comm.a2a_calls = self.prog_comm.a2a_bytes = 0
                t = time.perf_counter() - self.t_origin     # loads as trace counters
                for layer, r in ev["moe"].items():
                    self.trace.append(("counter", f"tokens per expert {layer}", t, 0.0, step,
                                       {f"e{i}": n for i, n in enumerate(r["load"])}))
            self.emit(ev)
            gc.collect(0)
            if self.eval_due(step, steps):
                loss = self.evaluate()
                if loss is not None:
                    self.emit({"event": "eval", "worker": self.wid, "step": step + 1,
                               "loss": loss})
            if getattr(self, "writer_error", None) is not None:
                self.wait_for_writer()      # a checkpoint failed: stop at once, naming it
            if ckpt_every and ckpt_dir is not None and (step + 1) % ckpt_every == 0:
                self.checkpoint(ckpt_dir, step + 1)
        self.wait_for_writer()
        self.status[3] = 1

    def take_sent_bytes(self) -> dict:
        out, self.sent_bytes = dict(self.sent_bytes), {"act": 0, "grad": 0}
        return out

    def check_memory_cap(self, step: int, peak: dict) -> None:
        """Stop when the step's live tensors outgrew what the plan may fill on this worker's
        chip (the cluster file's mem_gib less its reserved bytes and fragmentation): the plan's
        memory promise is broken, as an out-of-memory error would say on a device."""
        mem = self.build.manifest["stages"][self.stage_idx].get("memory") or {}
        cap = mem.get("capacity_bytes")
        if not cap or peak["tensors"] <= cap:
            return
        pred = mem.get("predicted_bytes")
        raise H2Error(
            f"worker w{self.wid} (stage {self.stage_idx}) held {peak['tensors'] / 2**20:.1f} MiB "
            f"of live tensors in step {step + 1} (in {peak['at'] or 'its optimizer step'}), over "
            f"the {cap / 2**20:.1f} MiB its chip type may fill"
            + (f"; the plan predicted {pred / 2**20:.1f} MiB" if pred else ""),
            str(self.build.path / "cluster.toml"),
            hint="raise the chip's mem_gib in the cluster file, or recompile with recompute="
                 "selective or full, zero=1, fewer layers or a smaller micro-batch on this stage")

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, root: Path, step: int) -> None:
        """Snapshot the weights and AdamW state now (a copy), write them on a background thread
        while the next steps run; a checkpoint still being written is waited for first. The
        "checkpoint" event goes out once the files are durable (the launcher then writes
        COMPLETE when every worker's are); non-finite state is reported, never written."""
        self.wait_for_writer()
        tensors, meta = snapshot(self, step)

        def write():
            try:
                files = write_snapshot(root, step, self.wid, tensors, meta)
                self.emit({"event": "checkpoint", "worker": self.wid, "step": step,
                           "files": files})
            except NonFinite as e:       # never a COMPLETE checkpoint of NaN weights
                self.emit({"event": "checkpoint", "worker": self.wid, "step": step,
                           "nonfinite": e.names[:8]})
            except BaseException as e:   # noqa: BLE001 - re-raised on the worker's thread
                self.writer_error = e
        self.writer_error = None
        self.writer = threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True)
        self.writer.start()

    def wait_for_writer(self) -> None:
        w = getattr(self, "writer", None)
        if w is not None:
            w.join()
            self.writer = None
            if self.writer_error is not None:
                raise self.writer_error

    # ---- evaluation ----------------------------------------------------------------------------
    EVAL_OPS = ("fwd", "send_act", "recv_act")

    def eval_due(self, step: int, steps: int) -> bool:
        ev = self.opt.get("eval")
        if not ev:
            return False
        every = int(ev["every"])
        return step + 1 == steps or (every > 0 and (step + 1) % every == 0)

    def evaluate(self) -> float | None:
        """The held-out loss: the training stream's forward instructions alone (their order is
        the schedule's, so it cannot deadlock) over eval.steps global batches of eval data; no
        backward, no optimizer step. The last stage's TP rank 0 returns the mean loss."""
        ev = self.opt["eval"]
        if not hasattr(self, "eval_data"):
            self.eval_data = _token_batches(self.build, self.wid, ev["data"])
        stream = [ins for ins in self.stream if ins.op in self.EVAL_OPS]
        train_data = self.set_data(self.eval_data)
        losses = []
        try:
            for k in range(int(ev["steps"])):
                self.reset_step(k)
                for ins in stream:
                    self.run_instr(ins)
                loss = self.step_loss()
                if loss is not None:
                    losses.append(loss)
        finally:
            self.set_data(train_data)
        return float(np.mean(losses)) if losses else None

    def set_data(self, data):
        """Swap the batches fwd draws from; returns the old ones."""
        old, self.data = self.data, data
        return old

    def step_loss(self) -> float | None:
        if self.last and self.tp_rank == 0:      # a TP group's ranks hold one loss
            return float(np.mean(self.losses))
        return None


def peak_memory(be, meter: LiveTensorMeter) -> dict:
    """This worker's peak memory in the step just run: `tensors`, the high-water mark of its
    live tensors (backends/memory.py says what is counted; on CUDA the allocator's own peak of
    allocated device memory), and `host_rss`, the process's peak resident set since it started
    (weights, activations, buffers, the interpreter and libraries)."""
    import resource
    at = meter.at
    live = meter.reset_peak()
    device = be.device_peak()
    return {"tensors": device if device is not None else live, "at": at[0],
            "held": at[1], "program": at[2],
            "host_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def global_verdict(worker, parts: list) -> dict:
    """The step's global gradient norm and what the optimizer does with it, the same on every
    worker: one all-reduce over all workers of [sum of squares, loss sum, non-finite loss, one
    non-finite flag per stage]. `parts`: the worker's stages (several chunks on a virtual-stage
    worker). A non-finite loss or norm stops the run (nan_policy "stop") or skips the step."""
    build, recipe = worker.build, worker.opt
    S = build.num_stages
    vec = np.zeros(3 + S, dtype=np.float64)
    for p in parts:
        sq, bad = p.grad_norm_share()
        vec[0] += sq
        vec[3 + p.stage_idx] += bad
        if p.last and p.tp_rank == 0 and p.losses:
            loss = float(np.mean(p.losses))
            if math.isfinite(loss):
                vec[1] += loss
            else:
                vec[2] += 1
    W = len(build.workers)
    if W > 1:
        worker.comm.all_reduce([vec], group=list(range(W)), op="sum")
    norm = math.sqrt(vec[0]) if math.isfinite(vec[0]) else float("inf")
    step, tr = worker.step, recipe["training"]
    lr = learning_rate(recipe, step)
    v = {"skip": False, "norm": norm, "lr": lr, "scale": 1.0}
    stages = [s for s in range(S) if vec[3 + s] > 0]
    if vec[2] > 0 or stages or not math.isfinite(norm):
        what = "; ".join(x for x in (
            "the loss is not finite (last stage)" if vec[2] > 0 else "",
            f"the gradients of stage(s) {', '.join(map(str, stages))} are not finite" if stages
            else "", "" if stages or vec[2] > 0 else f"the global gradient norm is {norm}") if x)
        fix = ("lower optimizer.lr or set training.clip_grad_norm, then continue with --resume "
               "(checkpoints hold only finite weights)")
        if tr["nan_policy"] == "stop":
            raise H2Error(f"step {step + 1}: {what}; the run stopped (training.nan_policy = "
                          "\"stop\")", hint=fix + "; training.nan_policy = \"skip\" skips such "
                          "steps instead")
        worker.skipped_in_row += 1
        if worker.skipped_in_row >= tr["max_skipped"]:
            raise H2Error(f"step {step + 1}: {what}; {worker.skipped_in_row} steps in a row "
                          f"were skipped (training.max_skipped = {tr['max_skipped']}): the run "
                          "stopped", hint=fix)
        v["skip"] = True
    else:
        worker.skipped_in_row = 0
        clip = float(tr["clip_grad_norm"])
        if clip > 0:                    # torch.nn.utils.clip_grad_norm_'s coefficient
            v["scale"] = min(1.0, clip / (norm + 1e-6))
    worker.verdict = v
    return v


class _Merged(MutableMapping):
    """One table of a virtual-stage worker's chunks ('params', 'exp_avg', ...), keyed
    'c<chunk>.<name>': what checkpoints read and write."""

    def __init__(self, chunks: list, attr: str):
        self.chunks, self.attr = chunks, attr

    def _split(self, key: str):
        c, _, k = key.partition(".")
        return getattr(self.chunks[int(c[1:])], self.attr), k

    def __getitem__(self, key):
        table, k = self._split(key)
        return table[k]

    def __setitem__(self, key, value):
        table, k = self._split(key)
        table[k] = value

    def __delitem__(self, key):
        table, k = self._split(key)
        del table[k]

    def __iter__(self):
        for c, ch in enumerate(self.chunks):
            for k in getattr(ch, self.attr):
                yield f"c{c}.{k}"

    def __len__(self):
        return sum(len(getattr(ch, self.attr)) for ch in self.chunks)


class ChunkedWorker(Worker):
    """A worker of a virtual-stage schedule (interleaved 1F1B, zero bubble: h2ir/schedule/
    streams.py): it holds several stages as chunks, one `Worker` each, and interprets the one
    stream whose instructions name their chunk. Step loop, trace and status are `Worker`'s;
    checkpoints see the chunks' tables as one (`_Merged`)."""

    def __init__(self, build: BuildDir, wid: int, comm, data, opt: dict, emit, status,
                 device: str = "cpu"):
        StreamInterpreter.__init__(self, wid, build.stream(wid))
        w = build.workers[wid]
        self.build, self.emit, self.status, self.opt = build, emit, status, opt
        self.replica, self.stage_idx = w["replica"], w["stage"]
        self.skipped_in_row, self.verdict, self.pending = 0, None, []
        self.chunks = [Worker(build, wid, comm, data, opt, emit, status, device, stage=v)
                       for v in w["chunks"]]
        self.be = self.chunks[0].be
        self.meter = self.chunks[0].meter
        for ch in self.chunks:
            ch.meter, ch.mem_owner = self.meter, self
        self.tp_rank, self.moe, self.prog_comm, self.ccl = 0, None, None, None
        self.param_names = [f"c{c}.{k}" for c, ch in enumerate(self.chunks)
                            for k in ch.param_names]
        self.opt_names = [f"c{c}.{k}" for c, ch in enumerate(self.chunks) for k in ch.opt_names]
        self.params = _Merged(self.chunks, "params")
        self.exp_avg = _Merged(self.chunks, "exp_avg")
        self.exp_avg_sq = _Merged(self.chunks, "exp_avg_sq")
        self.trace: list = []

    @property
    def comm(self):
        return self.chunks[0].comm

    @comm.setter
    def comm(self, comm):
        for ch in self.chunks:
            ch.comm = comm

    @property
    def opt_steps(self) -> int:
        return self.chunks[0].opt_steps

    @opt_steps.setter
    def opt_steps(self, n: int):
        for ch in self.chunks:
            ch.opt_steps = n

    def use_ccl(self, ccl) -> None:
        self.ccl = ccl
        for ch in self.chunks:
            ch.use_ccl(ccl)

    def reset_step(self, step: int):
        self.step = step
        self.verdict, self.pending = None, []
        for ch in self.chunks:
            ch.reset_step(step)

    def held_tensors(self, extra=()):
        yield from extra
        for ch in self.chunks:
            yield from ch.held_tensors()

    def take_sent_bytes(self) -> dict:
        out = {"act": 0, "grad": 0}
        for ch in self.chunks:
            for k, n in ch.take_sent_bytes().items():
                out[k] += n
        return out

    def step_loss(self) -> float | None:
        return next((ch.step_loss() for ch in self.chunks if ch.last), None)

    def set_data(self, data):
        olds = [ch.set_data(data) for ch in self.chunks]
        return next((o for o in olds if o is not None), None)

    def _on_chunk(self, ins):
        if ins.op == "opt_step":
            # every chunk's gradients are final (all-reduced) only at the last chunk's opt_step:
            # the global norm is taken then, and every chunk updates with it
            self.pending.append(self.chunks[ins.chunk])
            if len(self.pending) == len(self.chunks):
                v = global_verdict(self, self.chunks)
                for ch in self.pending:
                    ch.apply_update(v)
            return None
        return getattr(self.chunks[ins.chunk], ins.op)(ins)


for _op in OPS:
    setattr(ChunkedWorker, _op, ChunkedWorker._on_chunk)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="h2x-worker")
    ap.add_argument("--build", required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--status", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--resume-from", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--device-map", default=None)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--recipe", required=True, help="the training recipe (JSON, the launcher's)")
    return ap


def _event_writer(out):
    """emit(event): the event as one JSON line on `out`, the launcher's pipe; a lock keeps each
    line whole when several threads emit."""
    lock = threading.Lock()

    def emit(ev):
        with lock:
            out.write(json.dumps(ev) + "\n")
            out.flush()
    return emit


def _status_slot(path: str, num_workers: int, wid: int) -> np.ndarray:
    """This worker's row of the launcher's shared status file (see STATUS_FIELDS)."""
    status_all = np.memmap(path, dtype=np.float64, mode="r+", shape=(num_workers, STATUS_FIELDS))
    return status_all[wid]


def _start_heartbeat(status: np.ndarray, parent: int) -> None:
    def heartbeat():   # also: exit if the launcher is gone, so no worker outlives h2x
        while True:
            status[0] = time.time()
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=heartbeat, daemon=True).start()


def _token_batches(build: BuildDir, wid: int, mix: dict) -> TokenBatches | None:
    """The micro-batches of tokens (first stage) and targets (last stage); None in between."""
    m = build.manifest
    w = build.workers[wid]
    needs_data = bool({0, build.num_stages - 1} & set(w.get("chunks") or [w["stage"]]))
    return open_batches(DataMix.from_json(mix), m["micro_batch"], m["seq_len"],
                        m["num_microbatches"], m["dp"], m["seed"]) if needs_data else None


def main(argv=None) -> int:
    """Run one worker; whatever stops it is one "error" event for the launcher (the worker's
    message: kind "user" for an H2Error, "comm" for a broken link, which is often another
    worker's failure seen from here, "internal" for a bug, whose traceback goes to a crash
    report named in the event) and an exit code (2 user/comm, 1 internal)."""
    a = _parser().parse_args(argv)
    emit = _event_writer(sys.stdout)
    try:
        return _serve(a, emit)
    except KeyboardInterrupt:          # the launcher (or the terminal) stops us
        return 130
    except BaseException as e:         # noqa: BLE001 - every failure becomes one event
        return _report_failure(a.worker, emit, e)


def _report_failure(wid: int, emit, e: BaseException) -> int:
    """The "error" event for `e` (kind: "user", "comm" for a broken link, "os" for what this
    machine refused the worker itself, "internal" for a bug) and the exit code. `t` stamps when
    it failed, so the launcher can tell the first failure from what it caused in its peers."""
    import traceback

    from h2ir.errors import crash_report
    try:
        from executor.dicomm import CommError
    except Exception:                  # noqa: BLE001 - DiComm itself may be what failed
        CommError = ()
    if isinstance(e, SystemExit):
        if e.code in (None, 0):
            return 0
        e = RuntimeError(f"sys.exit({e.code!r}) inside the worker")
    ev = {"event": "error", "worker": wid, "t": time.time()}
    code = 2
    own = local_os_error(e)             # out of descriptors, memory or disk: its own failure
    if isinstance(e, H2Error):
        kind = "comm" if isinstance(e, CommError) else "user"
        hint = e.hint
        if kind == "comm" and own is not None:
            kind = "os"
            hint = "\n  ".join(h for h in (f"the cause is this worker's own: {os_error_cause(own)}",
                                            os_error_hint(own), hint) if h)
        ev.update(kind=kind, message=e.message, file=e.file, line=e.line, col=e.col, hint=hint)
    elif isinstance(e, OSError):        # the machine refused it something: a run error, no bug
        ev.update(kind="os", message=f"worker w{wid}: {os_error_cause(e)}"
                  + (f": {e.filename}" if e.filename else "") + _doing(e),
                  hint=os_error_hint(e))
        traceback.print_exc(file=sys.stderr)       # the worker's log has where it happened
    else:
        try:
            report = crash_report(f"h2x worker w{wid}", e)
        except Exception:              # noqa: BLE001 - e.g. no descriptor left to write it
            report = None
        msg = " ".join(str(e).split())
        ev.update(kind="internal", message=f"{type(e).__name__}: {msg[:300]}", report=report)
        traceback.print_exc(file=sys.stderr)       # the worker's log, beside the crash report
        code = 1
    try:
        emit(ev)
    except (OSError, ValueError):      # the launcher is gone: nobody to tell
        pass
    return code


def _doing(e: BaseException) -> str:
    """' (in write_snapshot, executor/checkpoint.py:250)': the innermost h2 frame of `e`."""
    import traceback
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if fr.filename.startswith(root) and "site-packages" not in fr.filename:
            return f" (in {fr.name}, {fr.filename[len(root):]}:{fr.lineno})"
    return ""


def _serve(a, emit) -> int:
    build = BuildDir(a.build, check="used")     # the launcher checked the rest
    W = len(build.workers)
    pin_to_core(a.worker, sharing=W)
    status = _status_slot(a.status, W, a.worker)
    _start_heartbeat(status, os.getppid())
    limit_torch_threads()
    keep_freed_memory()
    recipe = json.loads(Path(a.recipe).read_text())
    data = _token_batches(build, a.worker, recipe["data"])
    # the stage is loaded before connecting: a bad stage file is this worker's start-up error,
    # not its peers' broken handshake
    kind = ChunkedWorker if build.workers[a.worker].get("chunks") else Worker
    devices = worker_devices(build, a.device, a.device_map)
    take_device(devices[a.worker], a.worker, build)
    worker = kind(build, a.worker, None, data, recipe, emit, status, devices[a.worker])
    from executor import dicomm
    comm = dicomm.connect(a.worker, W, "127.0.0.1", a.store_port, os.environ["H2_SECRET"],
                          transport=a.transport, fallback=True, timeout=a.timeout)
    worker.comm = comm
    from executor.ccl import open_ccl
    ccl = open_ccl(build.manifest, a.worker, devices, lambda: _store_client(a), timeout=a.timeout)
    if ccl is not None:
        worker.use_ccl(ccl)
    emit({"event": "ready", "worker": a.worker, "transport": getattr(comm, "transport", a.transport)})
    if a.resume_from:
        load_worker_checkpoint(Path(a.resume_from), worker)
    t_origin = float(os.environ.get("H2_T0", time.perf_counter()))
    trace = Path(a.run_dir, f"trace_w{a.worker}.json")
    try:
        worker.run(a.start, a.steps, a.checkpoint_every,
                   Path(a.checkpoint_dir) if a.checkpoint_dir else None, t_origin)
    except BaseException:
        try:                            # the trace so far; never in place of the failure itself
            trace.write_text(json.dumps(worker.trace))
        except OSError:
            pass
        raise
    trace.write_text(json.dumps(worker.trace))
    comm.barrier(list(range(W)))
    links = [dict(link, src=a.worker) for link in comm.links()   # what really carried the run
             + (ccl.links() if ccl is not None else [])]
    if ccl is not None:
        ccl.close()
    comm.close()
    emit({"event": "done", "worker": a.worker, "links": links})
    return 0


def _store_client(a):
    """A client of the launcher's rendezvous store (torch's TCPStore)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", a.store_port, is_master=False,
                    timeout=timedelta(seconds=max(a.timeout, 30.0)), wait_for_workers=False)


def worker_devices(build: BuildDir, device: str | None, device_map: str | None,
                   hosts: list[int] | None = None) -> list:
    """Every worker's torch device in this run (h2ir/schedule/devices.py `run_devices`; `hosts`:
    each worker's machine, None: all on this one); a worker the manifest gives none runs on its
    stage's."""
    from h2ir.schedule.devices import run_devices
    stages = build.manifest["stages"]
    return [dev or stages[w["stage"]].get("device") or "cpu"
            for w, dev in zip(build.workers, run_devices(build.workers, device, device_map, hosts))]


def take_device(dev: str | None, wid: int, build: BuildDir) -> None:
    """Make a CUDA `dev` this process's current device (NCCL and the caching allocator use it);
    an index this host does not have is refused."""
    if not dev or not dev.startswith("cuda"):
        return
    import torch
    index = torch.device(dev).index or 0
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= have:
        raise H2Error(f"worker w{wid} is to run on {dev}, but this host has {have} CUDA "
                      "device(s)", str(build.path / "manifest.json"),
                      hint="the cluster file's chips_per_node says how many a host has; "
                           "--device-map places workers explicitly (\"w0+w1=cuda:0\" shares one)")
    torch.cuda.set_device(index)


if __name__ == "__main__":
    sys.exit(main())
