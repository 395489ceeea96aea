"""Collectives inside a stack on the vendor's library (executor/ccl.py, h2ir/planner/collectives.py)
and a device per worker (h2ir/schedule/devices.py).

With `comm ccl` the groups that share a software stack run on torch.distributed process groups
(gloo here) and give the losses of `comm dicomm`; a group that crosses stacks stays on DiComm,
and the streams say which library carries each group."""
import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, run_cli
from executor.ccl import CCL, EPExchange, TPCollectives, groups_of
from executor.dicomm import CommError
from h2ir.clusters.clusterfile import parse_cluster
from h2ir.errors import H2Error
from h2ir.planner.collectives import CommGroup, Member, build_groups, choose
from h2ir.plans.dsl import format_plan, parse_plan
from h2ir.schedule.devices import assign_devices, run_devices
from h2ir.schedule.streams import WorkerLayout, worker_hosts

LLAMA = str(ROOT / "examples/llama_tiny.py")
MOE = str(ROOT / "examples/moe_tiny.py")
TINY = {"n_layers": 2, "dim": 64, "n_heads": 4, "ffn": 96, "vocab": 256}
MOE_ARGS = {"n_layers": 2, "dim": 64, "ffn": 128, "vocab": 512, "max_seq": 64}
STEPS = 10

# this machine as 8 torch and 8 NumPy workers: two node groups, so two (emulated) hosts
CLUSTER = '''name = "ccl-local"
dtype = "fp32"
[chips.cpu-torch]
vendor = "cpu"
backend = "torch"
peak_tflops = { fp32 = 0.1 }
mem_gib = 4
mem_bw_gbs = 10
[chips.cpu-numpy]
vendor = "cpu"
backend = "numpy"
peak_tflops = { fp32 = 0.05 }
mem_gib = 4
mem_bw_gbs = 10
[[nodes]]
chip = "cpu-torch"
count = 1
chips_per_node = 8
intra_bw_gbs = 2
nic_gbps = 10
[[nodes]]
chip = "cpu-numpy"
count = 1
chips_per_node = 8
intra_bw_gbs = 2
nic_gbps = 10
'''

# one host with 8 NVIDIA GPUs, one with 8 AMD GPUs
GPUS = '''name = "two-vendors"
dtype = "bf16"
[chips.H]
vendor = "nvidia"
backend = "cuda"
peak_tflops = { bf16 = 989 }
mem_gib = 80
mem_bw_gbs = 3350
[chips.M]
vendor = "amd"
backend = "rocm"
peak_tflops = { bf16 = 1307 }
mem_gib = 192
mem_bw_gbs = 5300
[[nodes]]
chip = "H"
count = 1
chips_per_node = 8
intra_bw_gbs = 450
nic_gbps = 400
[[nodes]]
chip = "M"
count = 1
chips_per_node = 8
intra_bw_gbs = 448
nic_gbps = 400
'''


# ---- the library, in one process (one thread per rank) -------------------------------------------

def _ranks(n: int, groups: list[CommGroup], body, timeout: float = 20.0) -> list:
    """body(rank, ccl) on n threads, each rank its own CCL over one in-memory store."""
    store = dist.HashStore()
    out, errs = [None] * n, []

    def run(r):
        try:
            ccl = CCL(r, groups, store, device="cpu", timeout=timeout)
            out[r] = body(r, ccl)
            ccl.close()
        except BaseException as e:       # noqa: BLE001 - re-raised below
            errs.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out


def test_collectives_and_transfers_on_gloo():
    g = [CommGroup(kind, (0, 1, 2), "ccl", "gloo", "") for kind in ("dp", "ep", "tp")] + \
        [CommGroup("p2p", (0, 2), "ccl", "gloo", ""),
         CommGroup("p2p", (1, 2), "dicomm", "dicomm", "")]

    def body(r, ccl):
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1)
        a, b = ccl.all_reduce([x, x.double()], [0, 1, 2])
        s, n = ccl.all_reduce([x, torch.tensor([r + 1])], [0, 1, 2], op="sum")
        tp = TPCollectives(ccl, [0, 1, 2], r)
        hi = tp("tp_all_reduce", torch.full((2,), float(r)), size=3, reduce="max")
        a2a = ccl.all_to_all(torch.arange(3.0).reshape(3, 1) + 10 * r, [0, 1, 2])
        parts = EPExchange(ccl).all_to_all([np.full((1, 2), 10 * r + i, np.float32)
                                            for i in range(3)], [0, 1, 2])
        got = None
        if r == 0:                       # two tags, received in the other order
            ccl.send(2, torch.ones(4), "act:h", 1)
            ccl.send(2, torch.zeros(2, 2), "act:h", 0)
        elif r == 2:
            got = (ccl.recv(0, (2, 2), "f32", "act:h", 0), ccl.recv(0, (4,), "f32", "act:h", 1))
        return a, b, s, n, hi, a2a, parts, got, ccl.links(), x
    out = _ranks(3, g, body)
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for r, (a, b, s, n, hi, a2a, parts, got, links, x) in enumerate(out):
        assert torch.equal(a, base * 2) and torch.equal(s, base * 6)   # mean of 1x, 2x, 3x
        assert b.dtype == torch.float64 and torch.equal(b, base.double() * 2)  # own bucket
        assert n.dtype == torch.int64 and n.tolist() == [6]
        assert torch.equal(x, base * (r + 1))                           # inputs untouched
        assert hi.tolist() == [2.0, 2.0]
        assert a2a.flatten().tolist() == [r, 10 + r, 20 + r]
        assert [p.item(0) for p in parts] == [r, 10 + r, 20 + r]
        assert {l["dst"] for l in links} == {0, 1, 2} - {r} and links[0]["transport"] == "gloo"
    assert out[2][7][0].tolist() == [[0, 0], [0, 0]] and out[2][7][1].tolist() == [1] * 4


def test_tp_rank_and_a_group_that_is_not_this_libraries():
    def body(r, ccl):
        assert not ccl.owns("p2p", (1, 0))          # a dicomm group makes no process group
        with pytest.raises(CommError, match="no p2p group"):
            ccl.recv(1, (1,), "f32", "act:x", 0)
        return int(TPCollectives(ccl, [0, 1], r)("tp_rank", size=2))
    assert _ranks(2, [CommGroup("tp", (0, 1), "ccl", "gloo", ""),
                      CommGroup("p2p", (1, 0), "dicomm", "dicomm", "")], body) == [0, 1]


def test_a_silent_peer_is_a_comm_error_not_a_hang():
    def body(r, ccl):
        if r == 1:
            with pytest.raises(CommError, match="recv of 'act:x' mb 0 over \\[0, 1\\] failed"):
                ccl.recv(0, (4,), "f32", "act:x", 0)       # rank 0 never sends
        return r
    _ranks(2, [CommGroup("p2p", (0, 1), "ccl", "gloo", "")], body, timeout=1.0)


# ---- which library, per group ------------------------------------------------------------------

def _member(stack="torch", backend="torch", device="cpu", host=0, chip="c", stage=0):
    return Member(stack, backend, device, host, chip, stage)


def test_choice_per_group():
    cpu, npy = _member(), _member("numpy", "numpy", None)
    assert choose("ccl", "dp", [cpu, cpu], 1 << 20)[:2] == ("ccl", "gloo")
    assert choose("dicomm", "dp", [cpu, cpu], 1 << 20)[:2] == ("dicomm", "dicomm")
    via, lib, why = choose("ccl", "p2p", [cpu, npy], 1 << 20)
    assert (via, lib) == ("dicomm", "dicomm") and why == "crosses stacks (numpy, torch)"
    assert choose("ccl", "dp", [npy, npy], 1 << 20)[2] == "numpy has no collective library"
    cuda, rocm = _member("cuda", device="cuda", chip="H"), _member("rocm", device="cuda", chip="M")
    assert choose("ccl", "dp", [cuda, rocm], 1 << 20)[:2] == ("dicomm", "dicomm")  # two vendors
    gpus = parse_cluster(GPUS)
    # auto: the link table's NVLink against DiComm's host path, for GPUs of one vendor
    assert choose("auto", "dp", [cuda, cuda], 64 << 20, gpus)[:2] == ("ccl", "nccl")
    assert choose("auto", "ep", [rocm, rocm], 1 << 20, gpus)[:2] == ("ccl", "rccl")
    # auto on one machine's CPUs: the faster of the two at the measured host rates
    from h2ir.planner.collectives import HOST_RATES, message_time
    for nbytes in (1 << 10, 1 << 20, 64 << 20):
        faster = min(HOST_RATES, key=lambda lib: message_time(lib, "dp", nbytes, 2))
        via, lib, why = choose("auto", "dp", [cpu, cpu], nbytes)
        assert lib == faster and why.startswith(("one stack (torch), auto:", "auto:")), why


def test_groups_are_read_from_the_streams():
    from h2ir.schedule.streams import build_streams
    streams = build_streams("1f1b", 2, 2, dp=4, tp=[2, 1], ep=[1, 2])
    lay = WorkerLayout(4, (2, 1))
    members = [_member(stage=lay.where(w)[1], backend="numpy" if w == 11 else "torch")
               for w in range(lay.num_workers)]
    groups = {(g.kind, g.workers): g for g in build_groups(streams, members, "ccl")}
    assert groups[("tp", (0, 1))].library == "gloo"
    assert groups[("dp", (0, 3, 6, 9))].via == "ccl"
    assert groups[("ep", (2, 5))].via == "ccl"
    # the EP stage's all-reduce, and its expert gradients' sub-groups (same EP rank)
    assert groups[("dp", (2, 5, 8, 11))].why.startswith("crosses stacks")
    assert ("dp", (2, 8)) in groups and groups[("dp", (5, 11))].via == "dicomm"
    # TP shares (a TP stage's boundary) are DiComm's; one-peer transfers, each direction
    assert not [k for k in groups if k[0] == "p2p"]
    pipe = build_groups(build_streams("1f1b", 2, 2), [_member(), _member(stage=1)], "ccl")
    assert [(g.kind, g.workers, g.via) for g in pipe] == [("p2p", (0, 1), "ccl"),
                                                         ("p2p", (1, 0), "ccl")]


def test_the_plan_says_which_library():
    text = (ROOT / "examples/plans/llama_tiny_2stage.h2plan").read_text()
    plan = parse_plan(text + "comm ccl\n")
    assert plan.comm == "ccl" and parse_plan(format_plan(plan)) == plan
    assert "comm" not in format_plan(parse_plan(text))             # auto: printed as before
    with pytest.raises(H2Error, match="unknown comm setting 'nccl'") as e:
        parse_plan(text + "comm nccl\n", file="p.h2plan")
    assert e.value.line == text.count("\n") + 1


# ---- a device per worker -----------------------------------------------------------------------

def _gpu_workers():
    """A dp 2 pipeline on the two-vendor cluster: stage 0 tp 2 on H, stage 1 on M; the manifest's
    workers as h2c writes them."""
    cl = parse_cluster(GPUS, file="two-vendors.toml")
    lay = WorkerLayout(2, (2, 1))
    chips = ["H", "M"]
    hosts = worker_hosts(lay, chips, cl)
    workers = [{"id": w, "stage": lay.where(w)[1], "chip": chips[lay.where(w)[1]],
                "host": hosts[w], "backend": "torch"} for w in range(lay.num_workers)]
    for w, d in zip(workers, assign_devices(workers, ["cuda", "cuda"], cl)):
        w.update(d)
    return cl, workers


def test_fake_8_device_hosts_give_each_worker_its_own_device():
    cl, workers = _gpu_workers()
    got = [(w["id"], w["chip"], w["host"], w["device"]) for w in workers]
    # replica-major ids: w0 w1 (stage 0, H), w2 (stage 1, M), w3 w4 (H), w5 (M)
    assert got == [(0, "H", 0, "cuda:0"), (1, "H", 0, "cuda:1"), (2, "M", 1, "cuda:0"),
                   (3, "H", 0, "cuda:2"), (4, "H", 0, "cuda:3"), (5, "M", 1, "cuda:1")]
    hosts = [w["host"] for w in workers]
    assert run_devices(workers, hosts=hosts) == [w["device"] for w in workers]
    # an explicit map wins for the workers it names
    assert run_devices(workers, device_map="w0=cuda:7, w2=cuda:5", hosts=hosts)[:3] == \
        ["cuda:7", "cuda:1", "cuda:5"]
    # a device type numbers each machine's workers; an indexed device: all on it, as stated
    assert run_devices(workers, device="cuda", hosts=hosts) == [w["device"] for w in workers]
    assert run_devices(workers, device="cuda") == [f"cuda:{i}" for i in range(6)]
    assert set(run_devices(workers, device="cuda:0")) == {"cuda:0"}
    # both hosts' workers started on one machine would share its devices 0 and 1
    with pytest.raises(H2Error, match="w0 and w2 would share cuda:0"):
        run_devices(workers)


def test_two_workers_on_one_device_are_refused_unless_stated():
    cl, workers = _gpu_workers()
    hosts = [w["host"] for w in workers]
    with pytest.raises(H2Error, match="w0 and w1 would share cuda:1") as e:
        run_devices(workers, device_map="w0=cuda:1", hosts=hosts)
    assert "w0+w1=cuda:1" in e.value.hint
    assert run_devices(workers, device_map="w0+w1=cuda:1", hosts=hosts)[:2] == \
        ["cuda:1", "cuda:1"]
    for bad, what in (("w9=cuda:0", "w9 is not a worker"), ("w0=cuda:0,w0=cuda:2", "given twice"),
                      ("w0:cuda:0", "not an entry"), ("w0=cuda", "not a device")):
        with pytest.raises(H2Error, match=what):
            run_devices(workers, device_map=bad, hosts=hosts)
    with pytest.raises(H2Error, match="--device: 'gpu' is not a device"):
        run_devices(workers, device="gpu")
    # a plan with more workers of a type than the cluster has chips of it
    with pytest.raises(H2Error, match="9 workers on H chips but cluster 'two-vendors' has 8") as e:
        assign_devices([{"chip": "H", "stage": 0, "host": 0}] * 9, ["cuda"], cl)
    assert e.value.file == "two-vendors.toml"


def test_h2c_records_devices_and_libraries_in_the_manifest(tmp_path):
    """A dry-run compile for the two-vendor cluster: cuda:<i> per worker, NCCL between the NVIDIA
    replicas, RCCL between the AMD ones, DiComm between the vendors."""
    (tmp_path / "gpus.toml").write_text(GPUS)
    (tmp_path / "p.h2plan").write_text(
        f'model "{LLAMA}"\ncluster "{tmp_path / "gpus.toml"}"\nbatch global=8 micro=2 seq=32\n'
        "dp 2\nstage chip=H chips=2 layers=embed, 0\nstage chip=M chips=2 layers=1, head\n")
    from frontend.compiler import compile_model
    compile_model(LLAMA, model_args=TINY, plan_arg=str(tmp_path / "p.h2plan"),
                  out_dir=str(tmp_path / "b"), dry_run=True, log=lambda *a: None)
    m = json.loads((tmp_path / "b/manifest.json").read_text())
    assert [w["device"] for w in m["workers"]] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    libs = {(g["kind"], tuple(g["workers"])): g["library"] for g in m["comm"]["groups"]}
    assert libs[("dp", (0, 2))] == "nccl" and libs[("dp", (1, 3))] == "rccl"
    assert libs[("p2p", (0, 1))] == "dicomm" and m["comm"]["setting"] == "auto"
    assert "# comm p2p [w0 w1] dicomm: crosses stacks (cuda (torch), rocm (torch))" in \
        (tmp_path / "b/streams/w0.txt").read_text()


# ---- training: comm ccl gives comm dicomm's losses ----------------------------------------------

def _train(tmp: Path, name: str, model: str, args: dict, plan: str, comm: str, steps: int = STEPS):
    from executor.launcher import run
    from frontend.compiler import compile_model
    (tmp / "cluster.toml").write_text(CLUSTER)
    text = plan.format(cluster=tmp / "cluster.toml", model=model) + f"comm {comm}\n"
    (tmp / f"{name}-{comm}.h2plan").write_text(text)
    out = tmp / f"{name}-{comm}"
    compile_model(model, model_args=args, plan_arg=str(tmp / f"{name}-{comm}.h2plan"),
                  out_dir=str(out), log=lambda *a: None)
    log = tmp / f"{name}-{comm}.jsonl"
    lines: list = []
    res = run(str(out), steps=steps, json_log=str(log), trace=str(tmp / f"{name}-{comm}.trace"),
              out=lines.append, predict=False)
    assert len(res.losses) == steps
    return res, out, lines


def _same_losses(tmp, name, model, args, plan) -> tuple[Path, list]:
    ref, _, _ = _train(tmp, name, model, args, plan, "dicomm")
    got, build, lines = _train(tmp, name, model, args, plan, "ccl")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses))
    assert worst <= 1e-6, (got.losses, ref.losses)
    trace = json.loads((tmp / f"{name}-ccl.trace").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any(str(e.get("name", "")).endswith("via gloo") for e in events)
    assert any("gloo" in l for l in lines if l.startswith("links:")), lines
    return build, lines


HEAD = 'model "{model}"\ncluster "{cluster}"\nbatch global=8 micro=2 seq=32\n'

PIPE3 = HEAD + ("dp 1\nstage chip=cpu-torch chips=1 layers=embed, 0\n"
                "stage chip=cpu-torch chips=1 layers=1\nstage chip=cpu-numpy chips=1 layers=head\n")


def test_pipeline_on_gloo_equals_dicomm_and_crosses_to_numpy_on_dicomm(tmp_path):
    """Three stages, torch -> torch -> NumPy: the torch pair's transfers on gloo, the ones to and
    from the NumPy stage on DiComm (the stream says so), the losses of comm dicomm."""
    build, _ = _same_losses(tmp_path, "pipe", LLAMA, TINY, PIPE3)
    w1 = (build / "streams/w1.txt").read_text()
    assert "# comm p2p [w0 w1] gloo: one stack (torch), plan comm ccl" in w1
    assert "# comm p2p [w1 w2] dicomm: crosses stacks (numpy, torch)" in w1
    assert "# comm p2p [w2 w1] dicomm: crosses stacks (numpy, torch)" in w1
    m = json.loads((build / "manifest.json").read_text())
    assert groups_of(m, ["cpu"] * 3) == [CommGroup.from_json(g) for g in m["comm"]["groups"]
                                         if g["via"] == "ccl"]
    assert {tuple(g.workers) for g in groups_of(m, ["cpu"] * 3)} == {(0, 1), (1, 0)}


def test_device_map_sharing_is_refused_before_any_worker_starts(tmp_path):
    (tmp_path / "cluster.toml").write_text(CLUSTER)
    (tmp_path / "p.h2plan").write_text(PIPE3.format(model=LLAMA, cluster=tmp_path / "cluster.toml"))
    args = [x for k, v in TINY.items() for x in ("--arg", f"{k}={v}")]
    r = run_cli("h2c", "compile", LLAMA, *args, "--plan", str(tmp_path / "p.h2plan"), "-o",
                str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    r = run_cli("h2x", "run", str(tmp_path / "b"), "--steps", "1", "--device-map",
                "w0=cuda:0,w1=cuda:0")
    assert r.returncode == 2 and "w0 and w1 would share cuda:0" in r.stderr, r.stderr
    assert "starting" not in r.stdout
    r = run_cli("h2x", "run", str(tmp_path / "b"), "--steps", "1", "--device-map", "w2=cuda:0")
    assert r.returncode == 2 and "w2 runs the numpy backend" in r.stderr, r.stderr


DP2 = HEAD + "dp 2\nstage chip=cpu-torch chips=2 layers=embed, 0..1, head\n"
TP2 = HEAD + ("dp 1\nstage chip=cpu-torch chips=2 tp=2 layers=embed, 0\n"
              "stage chip=cpu-torch chips=1 layers=1, head\n")
EP2 = HEAD + ("dp 2\nstage chip=cpu-torch chips=2 ep=2 layers=embed, 0\n"
              "stage chip=cpu-torch chips=2 ep=2 layers=1, head\nmoe ep=2\n")


@pytest.mark.slow
@pytest.mark.parametrize("name,model,args,plan,kinds", [
    ("dp2", LLAMA, TINY, DP2, {"dp"}),
    ("tp2", LLAMA, TINY, TP2, {"tp"}),
    ("ep2", MOE, MOE_ARGS, EP2, {"dp", "ep", "p2p"}),
])
def test_parallel_groups_on_gloo_equal_dicomm(tmp_path, name, model, args, plan, kinds):
    build, _ = _same_losses(tmp_path, name, model, args, plan)
    m = json.loads((build / "manifest.json").read_text())
    on = {g["kind"] for g in m["comm"]["groups"] if g["library"] == "gloo"}
    assert kinds <= on, m["comm"]


@pytest.mark.slow
def test_gloo_between_emulated_hosts_equals_one_host_on_dicomm(tmp_path):
    """dp 2 x 2 stages, a replica per host (network namespaces): the all-reduce's gloo group
    spans the hosts; the losses are the single-host DiComm run's."""
    from test_multihost import PLAN_DP, _compile, _losses, _run_two_hosts, _single_host, OK, WHY
    if not OK:
        pytest.skip(f"no network namespaces here: {WHY}")
    batch = ["--global-batch", "4", "--micro-batch", "1"]
    ref = _compile(tmp_path, "dp", PLAN_DP + "comm dicomm\n", batch)
    b = _compile(tmp_path, "dp-ccl", PLAN_DP + "comm ccl\n", batch)
    assert "# comm dp [w0 w2] gloo" in (b / "streams/w0.txt").read_text()
    single = _single_host(ref, tmp_path / "single.jsonl")
    out0, _, _ = _run_two_hosts(b, tmp_path / "multi.jsonl")
    assert _losses(tmp_path / "multi.jsonl") == single
    assert re.search(r"between hosts: \d+ tcp, \d+ gloo", out0), out0
