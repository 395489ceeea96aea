"""The planner's limits, tolerances and fixed choices, each defined once.

Read by the search (`h2ir/planner/search/`), the validator and the resource model; this module
imports nothing of the planner, so every one of them may depend on it. Limits on user input
(sequence length, batch, micro-batches, workers) are `h2ir.errors`', shared with the readers.
"""
from __future__ import annotations

# layer kinds that are transformer blocks (a uniform split shares them out; the embedding and
# the head stay on the first and last stage)
BLOCK_KINDS = ("transformer_block", "moe_block")

# micro-batch sizes the search tries (those dividing the global batch), unless one is asked for
MICRO_BATCHES = (1, 2, 4, 8)

# schedules `choose_schedule` times for a searched pipeline (gpipe only holds more memory than
# 1f1b for the same bubble); the virtual-stage ones are searched as their one-chunk counterpart
# (same memory class), then each worker's share of the model is cut into chunks
SCHEDULE_CHOICES = ("1f1b", "zb1", "interleaved", "izb", "zbv")
VIRTUAL_BASE = {"interleaved": "1f1b", "izb": "zb1", "zbv": "zb1"}

# safety margin on memory capacity: the search's float sums vs the validator's integer items
CAP_MARGIN = 1.0 - 1e-9

# the layer-split DFS does not chase improvements smaller than this fraction of the bound
REL_TOL = 1e-4

# a configuration with at most EXACT_WORK / layers lines of stages is enumerated line by line,
# while the search has enumerated fewer than EXACT_TOTAL lines in all (best configurations
# first: they are expanded in bound order)
EXACT_WORK = 40_000
EXACT_TOTAL = 20_000

# outside exact mode, a configuration whose starting line is this much behind the best line
# found is not explored
PROBE_SLACK = 0.15

# a layer-split search that runs out of nodes is repeated with 4x the nodes, up to this many
# times the first budget
NODE_BUDGET_GROWTH = 64

# the final ranking's simulation budget (`_Search.sim_budget`), in simulated worker x
# micro-batch units
SIM_WORK_MIN = 12_500

# `--search exhaustive` refuses more layer splits than these, per line of stages and in all
EXHAUSTIVE_LINE_LIMIT = 3_000_000
EXHAUSTIVE_TOTAL_LIMIT = 50_000_000
