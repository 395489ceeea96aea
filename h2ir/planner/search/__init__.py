"""HeteroAuto: search a heterogeneous pipeline plan (H2, arXiv 2505.17548, HeteroPP/HeteroAuto).

What it ranks by. Every layer split is scored by `step_lower_bound`, a lower bound of the
simulator's step time built from the same resource model terms the simulator charges (compute,
the p2p link queue of every worker in both directions, DP all-reduce, TP collectives inside the
stage times, optimizer step, memory feasibility). The search is a best-first queue over lower
bounds: configurations, then lines of stages, then layer splits, and candidates are simulated
(h2ir/planner/simulate.py) in bound order; it stops when the next bound is no better than the
best simulated step (then the choice is the simulator's optimum over what was generated), or
when the simulation budget or `time_limit` is spent. `SearchResult.exact` is derived, not set:
true only when the least lower bound of everything left unsimulated (the heap, configurations
whose lines coordinate descent sampled, truncated split searches) is not below the chosen plan.

The plan space (`PlanSpace`, each dimension switchable):
  micro-batch size   1, 2, 4, 8 dividing the global batch (or the one asked for)
  dp                 one data-parallel degree for the whole pipeline (the executor replicates the
                     whole pipeline: a per-stage dp is not expressible in its streams)
  stages of a type   a type's dp-way replicated chips become stages of tp chips each; every stage
                     has its own tp (`mixed_tp`: a type's first stages at one tp, the rest at
                     another, either higher first or lower first); chips, part of a type (any
                     number of its stages: `partial`) or a whole type may stay idle (`idle`)
  tp                 dividing the heads and chips-per-node, or whole nodes (costed over NICs)
  stage order        any order of the types' blocks; one type may form two blocks (`split_types`:
                     A-B-A orders)
  recompute          per stage: none if it fits, else selective if that fits, else full
  zero               per stage with dp > 1 and ep 1 (`zero`): ZeRO-1 where zero=0 does not fit at
                     that recompute, or where the resource model times it faster
  schedule           1f1b and/or gpipe (`schedules`), each with its own memory (in-flight count)
  layer split        contiguous ranges: branch-and-bound DFS on the lower bound

Small spaces (at most `EXACT_WORK` / layers lines per configuration) are enumerated line by line; larger
ones are explored by coordinate descent over each type's stage sequence, block moves in the order
and A-B-A splits (`_LocalLines`), so type orders are never enumerated as k!.

Where each part lives: `space` (the plan space, configurations, TP options), `stage_kind` (one
stage's range costs and memory fits), `bound` (the lower bounds), `split` (a line's layer split),
`lines` (a configuration's lines of stages), `experts` (EP degrees and groups), `best_first` (the
search itself), `uniform` (the baseline), `virtual` (schedules of a searched pipeline), `report`
(HeteroSpeedupRatio), `result` (what a search returns). Limits live in h2ir/planner/limits.py.
"""
from h2ir.planner.limits import SCHEDULE_CHOICES, VIRTUAL_BASE
from h2ir.planner.search.best_first import fits_memory, search
from h2ir.planner.search.bound import step_lower_bound
from h2ir.planner.search.experts import ep_local, ep_options
from h2ir.planner.search.lines import type_sequences
from h2ir.planner.search.report import SpeedupReport, hetero_speedup, share_batch, sub_cluster
from h2ir.planner.search.result import Candidate, SearchResult
from h2ir.planner.search.space import (Config, PlanSpace, chip_counts, memory_order, memory_orders,
                                       micro_batch_options, tp_options, tp_reach)
from h2ir.planner.search.split import StageLine
from h2ir.planner.search.stage_kind import StageKind
from h2ir.planner.search.uniform import uniform_candidates, uniform_plan
from h2ir.planner.search.virtual import apply_schedule, choose_schedule, virtualize

__all__ = [
    "SCHEDULE_CHOICES", "VIRTUAL_BASE", "Candidate", "Config", "PlanSpace", "SearchResult",
    "SpeedupReport", "StageKind", "StageLine", "apply_schedule", "chip_counts", "choose_schedule",
    "ep_local", "ep_options", "fits_memory", "hetero_speedup", "memory_order", "memory_orders",
    "micro_batch_options", "search", "share_batch", "step_lower_bound", "sub_cluster",
    "tp_options", "tp_reach", "type_sequences", "uniform_candidates", "uniform_plan", "virtualize",
]
