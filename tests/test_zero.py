"""ZeRO-1 (a stage's `zero=1`): AdamW state sharded over the stage's dp replicas.

Unit level: the flat-buffer partition, DiComm's reduce-scatter / all-gather (the ring all-reduce's
halves, bit for bit), the shard update against AdamW on whole parameters, the plan syntax and its
refusals, the streams and the cost model. Run level (h2x, a torch replica and a NumPy replica in
one dp group): losses equal zero=0's, each worker holds 1/dp of the optimizer state, replicas
hold identical weights, a build whose streams skip the all-gather is caught, resume from a ZeRO
checkpoint is exact, and `h2x reshard` goes from zero=1 to zero=0 and back.
"""
from __future__ import annotations

import json
import math
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, run_cli

ARGS = ["--arg", "n_layers=2", "--arg", "max_seq=64"]
# a learning rate that makes a wrong update show; weight decay (0.1 by default) on the matrices
RECIPE = ["--optimizer.lr", "3e-3", "--lr_schedule.kind", "cosine", "--lr_schedule.warmup_steps",
          "3", "--lr_schedule.decay_steps", "17"]
STEPS = 6          # the default runs; the slow variants run 20


# ---- the partition and DiComm's halves of the ring ---------------------------------------------

def test_partition_covers_every_element_once_in_near_equal_shards():
    from executor.dicomm import shard_bounds
    from executor.zero import segments
    sizes = [("a", 5), ("b", 3), ("c", 7), ("d", 1)]
    for dp in range(1, 6):
        b = shard_bounds(16, dp)
        assert b[0] == 0 and b[-1] == 16 and max(np.diff(b)) - min(np.diff(b)) <= 1
        seen = {k: np.zeros(n, int) for k, n in sizes}
        for r in range(dp):
            segs = segments(sizes, dp, r)
            assert sum(hi - lo for lo, hi in segs.values()) == b[r + 1] - b[r]
            for k, (lo, hi) in segs.items():
                seen[k][lo:hi] += 1
        assert all((v == 1).all() for v in seen.values()), dp


def _ranks(world: int, body, transport: str = "tcp"):
    """body(rank, comm) on `world` DiComm ranks, one thread each; re-raises the first failure."""
    from executor import dicomm
    store = dicomm.host_store()
    errors, out = [], [None] * world

    def run(r):
        try:
            comm = dicomm.connect(r, world, "127.0.0.1", store.port, "s", transport=transport,
                                  namespace=f"zero-{transport}-{world}", timeout=20.0)
            out[r] = body(r, comm)
            comm.close()
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_reduce_scatter_and_all_gather_are_the_all_reduce(world, transport):
    from executor.dicomm import shard_bounds

    def body(r, comm):
        group = list(range(world))
        for size in (0, 2, 1001):
            x = np.random.default_rng(10 * r + size).standard_normal(size).astype(np.float32)
            whole = x.copy()
            comm.all_reduce([whole], group, op="avg")
            b = shard_bounds(size, world)
            mine = comm.reduce_scatter(x.copy(), group, op="avg")
            assert np.array_equal(mine, whole[b[r]:b[r + 1]])      # the same sums, bit for bit
            assert np.array_equal(comm.all_gather(np.ascontiguousarray(mine), group, size), whole)
        ints = np.full(7, r + 1, dtype=np.int64)
        assert (comm.reduce_scatter(ints, group, op="sum") == sum(range(1, world + 1))).all()
        with pytest.raises(ValueError, match="1-D"):
            comm.reduce_scatter(np.zeros((2, 2), np.float32), group)
        with pytest.raises(ValueError, match="holds elements"):
            comm.all_gather(np.zeros(99, np.float32), group, 10)
    _ranks(world, body, transport)


# ---- the shard update ---------------------------------------------------------------------------

SHAPES = {"a.weight": (3, 5), "norm.weight": (7,), "b.weight": (4, 4), "c.bias": (2,)}
OPT = {"weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


class _Worker:
    """What executor/zero.py reads of a Worker, on the NumPy backend."""

    def __init__(self, r: int, dp: int, comm, grads: dict):
        from backends.registry import get_backend
        from executor.zero import ZeroShard
        from h2ir.config import decays
        self.be = get_backend("numpy")
        self.wid = self.replica = r
        self.stage_idx, self.build, self.comm = 0, None, comm
        rng = np.random.default_rng(0)
        self.params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        self.param_grads = {k: g.copy() for k, g in grads.items()}
        self.owned_grads: set = set()
        self.opt = {"optimizer": {**OPT, "no_decay": ["bias", "norm"]}}
        self.decayed = {k: decays(k, len(s), self.opt["optimizer"]) for k, s in SHAPES.items()}
        self.zero = ZeroShard(SHAPES, dp, r)
        st = self.zero.state_shapes()
        self.exp_avg = {k: np.zeros(s, np.float32) for k, s in st.items()}
        self.exp_avg_sq = {k: np.zeros(s, np.float32) for k, s in st.items()}
        self.opt_steps = 0
        from backends.memory import LiveTensorMeter
        self.meter, self.mem_owner = LiveTensorMeter(self.be.storage), self

    def held_tensors(self, extra=()):
        yield from extra
        for table in (self.params, self.exp_avg, self.exp_avg_sq, self.param_grads):
            yield from table.values()

    def _grad(self, k):
        return self.param_grads[k]

    def tp_counts(self, k):
        return True


def test_shard_update_equals_adamw_on_the_whole_parameters():
    """Three replicas, shards cut inside parameters of both weight decay groups: reduce-scatter,
    norm shares, AdamW on the segments and all-gather give AdamW on the averaged whole
    gradients, bit for bit, and each replica holds only its shard's moments."""
    from backends.registry import get_backend
    dp, steps = 3, 3
    rngs = [np.random.default_rng(100 + r) for r in range(dp)]
    grads = [[{k: rngs[r].standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
              for r in range(dp)] for _ in range(steps)]

    def body(r, comm):
        w = _Worker(r, dp, comm, grads[0][r])
        norms, avg = [], []
        for t in range(steps):          # the all-reduced gradients, for the reference below
            a = [grads[t][r][k].copy() for k in SHAPES]
            comm.all_reduce(a, list(range(dp)), op="avg")
            avg.append(dict(zip(SHAPES, a)))
        for t in range(steps):
            w.param_grads = {k: g.copy() for k, g in grads[t][r].items()}
            group = list(range(dp))
            w.zero.reduce_scatter(w, _Ins(group))
            norms.append(w.zero.norm_share(w)[0])
            w.opt_steps += 1
            w.zero.apply(w, {"skip": False, "scale": 1.0, "lr": 1e-2})
            w.zero.all_gather(w, _Ins(group))
        held = sum(a.size for a in w.exp_avg.values()) + sum(a.size for a in w.exp_avg_sq.values())
        return w.params, norms, held, avg

    out = _ranks(dp, body)
    be = get_backend("numpy")
    ref = _Worker(0, 1, None, grads[0][0])
    for t in range(steps):
        avg = out[0][3][t]
        sq = sum(float(np.dot(g.ravel().astype(np.float64), g.ravel())) for g in avg.values())
        assert sum(o[1][t] for o in out) == pytest.approx(sq, rel=1e-6)   # each element once
        for wd, group in ((OPT["weight_decay"], [k for k in SHAPES if ref.decayed[k]]),
                          (0.0, [k for k in SHAPES if not ref.decayed[k]])):
            be.adamw_step([ref.params[k] for k in group], [avg[k] for k in group],
                          [ref.exp_avg[k].reshape(SHAPES[k]) for k in group],
                          [ref.exp_avg_sq[k].reshape(SHAPES[k]) for k in group], t + 1, 1e-2,
                          OPT["beta1"], OPT["beta2"], OPT["eps"], wd)
    total = sum(math.prod(s) for s in SHAPES.values())
    for params, _, held, _ in out:
        for k in SHAPES:
            assert np.array_equal(params[k], ref.params[k]), k
        assert held in (2 * (total // dp), 2 * (total // dp + 1))
    assert sum(o[2] for o in out) == 2 * total


def test_a_non_finite_gradient_in_any_shard_is_flagged():
    grads = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    for r in range(2):
        w = _Worker(r, 2, None, grads)
        w.zero.grads = {k: np.ones(hi - lo, np.float32) for k, (lo, hi) in w.zero.segments.items()}
        sq, bad = w.zero.norm_share(w)
        assert not bad and sq == pytest.approx(sum(hi - lo for lo, hi in w.zero.segments.values()))
        k = next(iter(w.zero.segments))
        w.zero.grads[k][-1] = np.nan
        assert w.zero.norm_share(w)[1] is True


class _Ins:
    def __init__(self, group):
        self.group = tuple(group)


# ---- plan syntax, refusals, streams and the cost model ------------------------------------------

PLAN = """model "examples/llama_tiny.py"
cluster "{cluster}"
batch global={gb} micro=1 seq=32
schedule 1f1b
dp {dp}
stage chip=cpu-torch chips={dp} tp=1{zero} layers=embed, 0..1, head
"""


def _plan(dp=2, zero=1, cluster="local"):
    return PLAN.format(dp=dp, gb=2 * dp, cluster=cluster, zero=" zero=1" if zero else "")


def test_plan_syntax_and_refusals():
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.errors import H2Error
    from h2ir.planner.resource import analytic_moe_costs
    from h2ir.costs import MoEInfo
    from h2ir.planner.validate import validate_plan
    from h2ir.plans.dsl import format_plan, parse_plan
    p = parse_plan(_plan())
    assert p.stages[0].zero == 1 and parse_plan(format_plan(p)) == p
    assert "zero=1" in format_plan(p) and "zero" not in format_plan(parse_plan(_plan(zero=0)))
    with pytest.raises(H2Error) as e:
        parse_plan(_plan().replace("zero=1", "zero=2"), "p.h2plan")
    assert str(e.value).startswith("p.h2plan:6:") and "expected 0" in str(e.value)
    # an expert-parallel stage: its experts follow the EP groups, refused at validation
    costs = analytic_moe_costs("moe", 2, 64, 4, 256, 32, MoEInfo(num_experts=4, top_k=2,
                               d_model=64, d_ffn=96, expert_params=0), attn_params=4 * 64 * 64)
    names = ", ".join(f'"{n}"' for n in costs.layer_names())
    text = (f'model "m"\ncluster "local4"\nbatch global=8 micro=1 seq=32\ndp 2\n'
            f"stage chip=cpu-torch chips=2 zero=1 layers={names}\nmoe ep=2\n")
    with pytest.raises(H2Error) as e:
        validate_plan(parse_plan(text, "moe.h2plan"), costs, load_cluster("local4"))
    assert str(e.value).startswith("moe.h2plan:5:") and "zero=1 with expert parallelism" in \
        str(e.value)
    validate_plan(parse_plan(text.replace("moe ep=2", "moe ep=1"), "moe.h2plan"), costs,
                  load_cluster("local4"))


def test_streams_and_cost_model():
    from h2ir.clusters.clusterfile import parse_cluster
    from h2ir.planner.resource import analytic_llama_costs, stage_memory
    from h2ir.planner.simulate import simulate
    from h2ir.plans.dsl import parse_plan
    from h2ir.schedule.streams import Instr, build_streams, format_stream, parse_stream
    s = build_streams("1f1b", 2, 2, dp=2, zero=[1, 0])
    assert format_stream(s[0]).endswith("reduce_scatter grads [w0 w2]\nopt_step\n"
                                        "all_gather params [w0 w2]\n")
    assert "all_reduce grads [w1 w3]" in format_stream(s[1])
    assert all(parse_stream(format_stream(v)) == v for v in s.values())
    assert Instr.parse("all_gather params [w1 w3] c1") == Instr("all_gather", group=(1, 3),
                                                                 chunk=1)
    costs = analytic_llama_costs("tiny", 2, 256, 8, 688, 8192, 32)
    # local4 with its placeholder rates (no calibration here)
    text = (ROOT / "examples/clusters/local4.toml").read_text()
    cluster = parse_cluster(text.replace("measured    = true", ""), "local4.toml")
    plans = {z: parse_plan(_plan(dp=4, zero=z, cluster="local4")) for z in (0, 1)}
    mem = {z: stage_memory(costs, p, cluster, 0) for z, p in plans.items()}
    assert mem[1].items["optimizer"] == math.ceil(mem[0].items["optimizer"] / 4)
    assert mem[0].total - mem[1].total == mem[0].items["optimizer"] - mem[1].items["optimizer"]
    sims = {z: simulate(costs, p, cluster, symmetric=False) for z, p in plans.items()}
    t0, t1 = sims[0].stage_times[0], sims[1].stage_times[0]
    # fp32: the reduce-scatter of the gradients and the all-gather of the weights move what the
    # all-reduce did; the optimizer step touches 1/dp of the parameters
    assert t1.reduce_scatter_s == pytest.approx(t0.dp_allreduce_s / 2)
    assert t1.all_gather_s == pytest.approx(t0.dp_allreduce_s / 2)
    assert t1.opt_step_s == pytest.approx(t0.opt_step_s / 4)
    names = {e.name for e in sims[1].events}
    assert {"reduce_scatter grads", "all_gather params"} <= names
    assert "all_reduce grads" not in names
    assert sims[1].step_time_s < sims[0].step_time_s


# ---- h2x runs -----------------------------------------------------------------------------------

def _compile(d: Path, name: str, text: str) -> Path:
    (d / f"{name}.h2plan").write_text(text)
    b = d / name
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *ARGS, "--plan",
                str(d / f"{name}.h2plan"), "-o", str(b))
    assert r.returncode == 0, r.stderr
    return b


def _on_numpy(build: Path, replicas) -> Path:
    """Run `replicas` on the NumPy backend: the plan language gives one chip type per stage, so
    a dp group across backends is made by editing the manifest (each worker runs its entry's
    backend)."""
    m = json.loads((build / "manifest.json").read_text())
    for w in m["workers"]:
        if w["replica"] in replicas:
            w["backend"] = "numpy"
    (build / "manifest.json").write_text(json.dumps(m, indent=1))
    from frontend.compiler import write_digests
    write_digests(build)            # the edit is the test's: its digests come along
    return build


class _Builds(dict):
    """builds[("dp2" | "dp4", zero)], compiled when first asked for (the dp4 ones only by the
    slow tests)."""
    def __init__(self, d: Path):
        super().__init__()
        self.d = d

    def __missing__(self, key):
        dp, z = key
        self[key] = {"dp2": lambda: _on_numpy(_compile(self.d, f"dp2z{z}", _plan(2, z)), [1]),
                     "dp4": lambda: _on_numpy(_compile(self.d, f"dp4z{z}", _plan(4, z, "local4")),
                                              [1, 3])}[dp]()
        return self[key]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return _Builds(tmp_path_factory.mktemp("zero"))


def _run(build: Path, steps: int, *extra) -> dict[int, dict]:
    log = build / f"log{len(list(build.glob('log*.jsonl')))}.jsonl"
    r = run_cli("h2x", "run", str(build), "--steps", str(steps), *RECIPE, "--json-log", str(log),
                *extra)
    assert r.returncode == 0, r.stderr + r.stdout
    return {e["step"]: e for e in map(json.loads, log.read_text().splitlines())}


def _worst(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"]) for s in a)


def _tensors(ckpt: Path, wid: int) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(ckpt / f"w{wid}.safetensors"))


def _opt_bytes(ckpt: Path, wid: int) -> int:
    """The worker's AdamW state as it held it (the checkpoint snapshots its tables)."""
    return sum(v.nbytes for k, v in _tensors(ckpt, wid).items() if k.startswith("exp_avg"))


def _check_run(b0: Path, b1: Path, dp: int, steps: int):
    ck = f"step_{steps:08d}"
    z0 = _run(b0, steps, "--checkpoint-every", str(steps))
    z1 = _run(b1, steps, "--checkpoint-every", str(steps))
    worst = _worst(z1, z0)
    print(f"dp{dp} zero=1 vs zero=0 over {steps} steps: worst relative loss difference "
          f"{worst:.2e}; optimizer bytes per worker "
          f"{[_opt_bytes(b1 / 'ckpt' / ck, w) for w in range(dp)]} vs "
          f"{[_opt_bytes(b0 / 'ckpt' / ck, w) for w in range(dp)]}")
    assert worst <= 1e-6, (z0, z1)
    assert z1[steps]["loss"] < z1[1]["loss"]
    full = _opt_bytes(b0 / "ckpt" / ck, 0)
    for w in range(dp):
        assert _opt_bytes(b0 / "ckpt" / ck, w) == full
        assert _opt_bytes(b1 / "ckpt" / ck, w) == full // dp      # 1/dp, to the element
    # the all-gather leaves every replica (torch and NumPy alike) with the same weights
    p = [_tensors(b1 / "ckpt" / ck, w) for w in range(dp)]
    for k in p[0]:
        if k.startswith("param."):
            assert all(np.array_equal(p[0][k], q[k]) for q in p[1:]), k
    return z0, z1


def test_dp2_torch_and_numpy_replicas_equal_zero0_resume_and_reshard(builds, tmp_path):
    b0, b1 = builds[("dp2", 0)], builds[("dp2", 1)]
    for b in (b0, b1):
        shutil.rmtree(b / "ckpt", ignore_errors=True)
    z0, z1 = _check_run(b0, b1, 2, STEPS)
    # resume from a ZeRO checkpoint (each worker's shard of the moments) is exact
    half = STEPS // 2
    r = run_cli("h2x", "run", str(b1), "--steps", str(half), *RECIPE, "--checkpoint-every",
                str(half), "--checkpoint-dir", str(tmp_path / "ck1"))
    assert r.returncode == 0, r.stderr
    resumed = _run(b1, STEPS, "--resume", "--checkpoint-dir", str(tmp_path / "ck1"))
    assert {s: e["loss"] for s, e in resumed.items()} == \
        {s: z1[s]["loss"] for s in range(half + 1, STEPS + 1)}
    # zero=1 -> zero=0: the segments joined back into whole moments, and a zero=0 run on
    r = run_cli("h2x", "reshard", str(b1), str(b0), "--step", str(half), "--checkpoint-dir",
                str(tmp_path / "ck1"), "--to-checkpoint-dir", str(tmp_path / "ck0"))
    assert r.returncode == 0, r.stderr
    back = _run(b0, STEPS, "--resume", "--checkpoint-dir", str(tmp_path / "ck0"))
    assert _worst(back, {s: z1[s] for s in back}) <= 1e-6
    # ... and zero=0 -> zero=1: whole moments cut into each replica's segments, the very
    # tensors and layout the zero=1 run wrote (resuming from them is the resume above)
    r = run_cli("h2x", "reshard", str(b0), str(b1), "--step", str(half), "--checkpoint-dir",
                str(tmp_path / "ck0"), "--to-checkpoint-dir", str(tmp_path / "ck1b"))
    assert r.returncode == 0, r.stderr
    import msgpack
    for w in range(2):
        a, b = (_tensors(tmp_path / c / f"step_{half:08d}", w) for c in ("ck1", "ck1b"))
        assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
        za, zb = (msgpack.unpackb((tmp_path / c / f"step_{half:08d}" / f"w{w}.msgpack")
                                  .read_bytes())["zero"] for c in ("ck1", "ck1b"))
        assert za == zb and za["rank"] == w
    # export joins the shards: the moments equal zero=0's (up to the last bits the two runs'
    # NumPy AdamW steps differ in: a segment put back in the wrong place is off by the moment)
    from executor.export import merged_tensors
    m0 = merged_tensors(_build(b0), b0 / "ckpt" / f"step_{STEPS:08d}")
    m1 = merged_tensors(_build(b1), b1 / "ckpt" / f"step_{STEPS:08d}")
    for prefix in ("exp_avg.", "exp_avg_sq."):
        assert sorted(m0[prefix]) == sorted(m1[prefix])
        for k, a in m0[prefix].items():
            assert a.shape == m1[prefix][k].shape
            assert np.abs(m1[prefix][k] - a).max() <= 1e-4 * np.abs(a).max(), (prefix, k)


def _build(path: Path):
    from executor.build import BuildDir
    return BuildDir(str(path))


@pytest.mark.slow          # the dp2 test above checks the same at two replicas
def test_dp4_torch_and_numpy_replicas_equal_zero0(builds):
    _check_run(builds[("dp4", 0)], builds[("dp4", 1)], 4, 4)


@pytest.mark.slow          # checks the check above, not h2
def test_a_build_that_skips_the_all_gather_is_caught(builds, tmp_path):
    """The comparison above has teeth: without the all-gather each replica keeps its old weights
    (only its shard was updated, and never written back), and the losses leave zero=0's."""
    b = tmp_path / "broken"
    shutil.copytree(builds[("dp2", 1)], b, ignore=shutil.ignore_patterns("ckpt", "log*"))
    for f in (b / "streams").glob("w*.txt"):
        f.write_text("".join(l for l in f.read_text().splitlines(True)
                             if not l.startswith("all_gather")))
    from frontend.compiler import write_digests
    write_digests(b)                # else the changed streams are refused, never run
    broken, good = _run(b, 3), _run(builds[("dp2", 0)], 3)
    assert _worst(broken, good) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_twenty_steps_equal_zero0(builds, dp):
    b0, b1 = builds[(f"dp{dp}", 0)], builds[(f"dp{dp}", 1)]
    for b in (b0, b1):
        shutil.rmtree(b / "ckpt", ignore_errors=True)
    _check_run(b0, b1, dp, 20)
