"""Workers that share CPU cores (`shared_cores` in a cluster file): the simulator's processor-
sharing fixed point, and layer-time records taken at one process per core."""
import dataclasses

import pytest

from h2ir.clusters.clusterfile import parse_cluster
from h2ir.errors import H2Error
from h2ir.planner.calibration import record_sharing
from h2ir.planner.simulate import simulate
from tests.test_simulate import blocks_only, cluster, even_plan


def _shared(cl, n):
    return dataclasses.replace(cl, shared_cores=n)


@pytest.mark.parametrize("S,m", [(2, 8), (4, 8), (3, 6)])
def test_one_core_serialises_every_compute(S, m):
    """On one shared core the step is all workers' compute in a row (whoever is idle gives
    the core to the others), to within the fixed point's tolerance."""
    c, cl = blocks_only(layers=S * 2), cluster()
    plan = even_plan(c, S, m)
    alone = simulate(c, plan, cl)
    one = simulate(c, plan, _shared(cl, 1))
    work = sum(alone.busy_s.values()) + sum(t.opt_step_s for t in alone.stage_times)
    assert one.step_time_s == pytest.approx(work, rel=0.03)
    assert one.step_time_s > alone.step_time_s * (S - 0.5) / 1.5


def test_enough_cores_change_nothing():
    c, cl = blocks_only(layers=8), cluster()
    plan = even_plan(c, 4, 8)
    assert simulate(c, plan, _shared(cl, 4)).step_time_s == simulate(c, plan, cl).step_time_s


def test_an_unbalanced_pipeline_gets_the_idle_workers_share():
    """Two cores, four workers, the last stage twice as heavy: it runs faster than at half a
    core while the others idle, so the step is below the busiest worker at half a core."""
    c, cl = blocks_only(layers=10), cluster()
    names = c.layer_names()
    plan = even_plan(c, 4, 8)
    for st, ls in zip(plan.stages, [names[0:2], names[2:4], names[4:6], names[6:10]]):
        st.layers = ls
    alone = simulate(c, plan, cl)
    two = simulate(c, plan, _shared(cl, 2))
    heavy = max(alone.busy_s.values())
    assert heavy < two.step_time_s < 2 * heavy


def test_records_are_taken_at_one_process_per_core_and_the_key_parses():
    rec = {"key": {"workers": 4}, "host": {"cpu_count": 2}, "cores": 2}
    assert record_sharing(rec) == 0.5
    assert record_sharing({"key": {"workers": 2}, "host": {"cpu_count": 8}}) == 1.0
    assert parse_cluster(_toml("3")).shared_cores == 3
    assert parse_cluster(_toml('"auto"')).shared_cores >= 1
    with pytest.raises(H2Error, match="shared_cores: expected a positive number of cores"):
        parse_cluster(_toml("0"), file="c.toml")


def _toml(value: str) -> str:
    return (f'name = "x"\ndtype = "fp32"\nshared_cores = {value}\n'
            '[chips.c]\nvendor = "cpu"\nbackend = "torch"\npeak_tflops = { fp32 = 0.1 }\n'
            'mem_gib = 4\nmem_bw_gbs = 10\n'
            '[[nodes]]\nchip = "c"\ncount = 1\nchips_per_node = 2\nintra_bw_gbs = 2\n'
            'nic_gbps = 1\n')
