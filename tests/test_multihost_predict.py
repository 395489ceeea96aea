"""The planner's predicted step time across emulated hosts (examples/testbed, tc tbf at
100 Mbit/s) is within 15 % of the measured one for llama_tiny on 2 hosts x 2 workers.

The plan is 2 stages x dp 2: a replica per host, so both stages' gradient all-reduces cross the
100 Mbit/s link at once (the NIC split between them, `LinePlacement`). That makes the step
mostly network time, which tbf makes deterministic; the compute share (4 workers on this
machine's cores) is what moves with the machine's load, so the band is the issue's 15 %, not
tighter. Skipped without network namespaces."""
import re
import statistics
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from examples.testbed.netns import available

OK, WHY = available()
pytestmark = [pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}"),
              pytest.mark.slow]    # ~80 s: `make test-slow`

sys.path.insert(0, str(ROOT / "bench"))
STEPS = 5


def test_prediction_within_15_percent_at_100_mbit(tmp_path, monkeypatch):
    from bench_multihost import cluster_file, run_two_hosts
    from bench_multihost_plan import fixed_plan
    from executor.build import BuildDir
    from executor.launcher import predicted_step_time
    # this run's own calibration: the backend and llama_tiny's layer times measured now, on
    # this machine as loaded as the run will find it (the shared test file may hold neither)
    monkeypatch.setenv("H2_CALIBRATION", str(tmp_path / "calibration.json"))
    cl = cluster_file(tmp_path, 100)
    plan = fixed_plan(tmp_path, "dp2", cl)
    build = tmp_path / "b"
    # --plan uniform measures llama_tiny's layer times at micro-batch 1 x 128 (a hand-written
    # plan uses the stored ones), then the dp 2 plan is compiled with them
    for plan_arg, out in (("uniform", tmp_path / "u"), (str(plan), build)):
        r = run_cli("h2c", "compile", "examples/llama_tiny.py", "--cluster", str(cl), "--plan",
                    plan_arg, "--global-batch", "16", "--seq-len", "128", "-o", str(out), timeout=600)
        assert r.returncode == 0, r.stderr
    predicted = predicted_step_time(BuildDir(build)).step_time_s
    run = run_two_hosts(str(build), 100, STEPS, port=29470)
    measured = statistics.median(run["times"][1:])
    err = (predicted - measured) / measured
    print(f"predicted {predicted:.3f} s, measured {measured:.3f} s, error {err:+.1%}")
    # what h2x run printed is the same prediction (the emulated host trusts this machine's
    # calibration: same boot id)
    assert run["printed_predicted"] == pytest.approx(predicted, rel=1e-3)
    assert re.search(r"between hosts: \d+ tcp", run["links"]), run["links"]
    assert abs(err) <= 0.15, (predicted, measured, run["times"])
