"""What a search returns: a candidate plan with its bound and simulation, and the search's
result with what it proved (`SearchResult.proof`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from h2ir.plans.plan import Plan
from h2ir.planner.search.space import Config
from h2ir.planner.simulate import SimResult


@dataclass
class Candidate:
    plan: Plan
    estimate_s: float              # lower bound of the simulated step (`step_lower_bound`)
    kind: str                      # 'auto' | 'uniform' | 'exhaustive'
    config: Config | None = None
    bounds: tuple = ()
    sim: SimResult | None = None
    sim_work: int = 0              # its simulation's work (worker x micro-batch units)

    @property
    def step_time_s(self) -> float:
        return self.sim.step_time_s if self.sim else self.estimate_s

    @property
    def tokens_per_s(self) -> float:
        return self.plan.global_batch * self.plan.seq_len / self.step_time_s


@dataclass
class SearchResult:
    best: Candidate
    runner_ups: list[Candidate]
    uniform: Candidate | None
    search_time_s: float
    method: str
    configs_total: int = 0
    configs_searched: int = 0
    dfs_nodes: int = 0
    simulations: int = 0
    timed_out: bool = False        # stopped by `time_limit`: the best plan found so far
    lines: int = 0
    # The least lower bound (of the simulated step) of every plan of the search's space it did
    # not simulate: the heap when it stopped, configurations whose lines coordinate descent
    # sampled, truncated layer-split searches; inf when nothing was left.
    unexplored_bound_s: float = math.inf
    lines_by: str = "enumeration"  # how lines were generated: 'enumeration' or 'coordinate-descent'
    stopped_by: str = "bound"      # 'bound', 'simulation budget' or 'time limit'

    @property
    def exact(self) -> bool:
        """Proved optimal over the search's plan space: nothing left unsimulated has a lower
        bound below the chosen plan's simulated step. Derived from the bounds, never set."""
        return bool(self.unexplored_bound_s >= self.best.step_time_s * (1 - 1e-9))

    @property
    def lower_bound_s(self) -> float:
        """No plan of the search's space is predicted faster than this (the chosen plan's step
        when `exact`)."""
        return float(min(self.unexplored_bound_s, self.best.step_time_s))

    def proof(self) -> dict:
        """What the search proved, for reports: `exact`, how lines were generated, what
        stopped it, the lower bound and the chosen plan's distance from it."""
        lb, step = self.lower_bound_s, self.best.step_time_s
        if self.exact:
            proved = "optimal over the search's plan space (docs/planning.md, 'The plan space')"
        elif lb > 0:
            proved = (f"no plan of the search's space is predicted faster than {lb:.4g} s; the "
                      f"chosen one is within {step / lb - 1:.1%} of that bound")
        else:
            proved = "nothing: part of the space was left without a bound"
        return {"exact": self.exact, "search": self.lines_by, "stopped_by": self.stopped_by,
                "lower_bound_s": lb, "gap_to_bound": float(step / lb - 1) if lb > 0 else None,
                "proved": proved}

    @property
    def plan(self) -> Plan:
        return self.best.plan

    @property
    def sim(self) -> SimResult:
        return self.best.sim
