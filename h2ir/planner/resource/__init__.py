"""Resource model: memory per device, compute and communication time per stage.

The planner (`h2ir/planner/search/`), the simulator (`h2ir/planner/simulate.py`) and the validator
(`h2ir/planner/validate.py`) all cost a plan through this module, so a number printed by one agrees with
the others. Every formula cites where it comes from.

Units: bytes, seconds, FLOP, FLOP/s, B/s. "Per device" means one chip: a stage's `chips` are
dp * tp chips, and each holds 1/tp of the stage's dense parameters and activations.

Model-state accounting (bytes per parameter, per device, before dividing by TP):

    dtype     weights  grads  optimizer                     total
    bf16/fp16    2       2    12 (fp32 master, m, v)          16   mixed-precision Adam,
                                                                   ZeRO (Rajbhandari et al. 2020) Sec. 3.1
    fp32         4       4     8 (m, v)                       16   fp32 AdamW (the CPU backends)

The planning issue quotes "12 B/param for fp32 AdamW": that is the persistent state
(weights 4 + m 4 + v 4). We also count the 4 B/param gradient buffer as its own item, because
under 1F1B it is live from the first backward until `opt_step`, i.e. for most of the step, so a
device that only fits 12 B/param would run out of memory in the middle of the step. A ZeRO-1
stage (`zero=1`) keeps 1/dp of the optimizer column on each replica (`stage_memory`).

Where each part lives: `memory` (model-state bytes, layer arrays, a stage's memory), `links`
(collective formulas, link and EP geometry, the build's placement), `model` (`ResourceModel`:
compute rates, layer and stage times, step-end collectives), `analytic` (analytic costs).
"""
from h2ir.planner.resource.memory import (DeviceArrays, LayerArrays, MemoryBreakdown,
                                          PiperMoEMemory, StateBytes, attention_score_bytes,
                                          chunk_inflight, costs_at, device_capacity, dtype_bytes,
                                          inflight_microbatches, layer_arrays, memory_items,
                                          piper_moe_memory, stage_layer_range, stage_memory,
                                          state_bytes_per_param, tied_copy_bytes,
                                          tied_exchange_bytes, zero_optimizer_bytes)
from h2ir.planner.resource.links import (EPGeometry, GroupGeometry, LinePlacement,
                                         all_to_all_flat_time, all_to_all_halo_time,
                                         default_ep_geometry, ep_groups, group_allreduce_time,
                                         hierarchical_allreduce_time, moe_a2a_pass_time, nic_share,
                                         p2p_link, p2p_time, replica_geometry, ring_allreduce_time,
                                         tp_allreduce_time)
from h2ir.planner.resource.model import (ChipRates, LayerTimes, ResourceModel, StageTimes,
                                         chip_rates, layer_op_split, measured_calibration,
                                         tp_memory_share)
from h2ir.planner.resource.analytic import analytic_llama_costs, analytic_moe_costs

__all__ = [
    "ChipRates", "DeviceArrays", "EPGeometry", "GroupGeometry", "LayerArrays", "LayerTimes",
    "LinePlacement", "MemoryBreakdown", "PiperMoEMemory", "ResourceModel", "StageTimes",
    "StateBytes", "all_to_all_flat_time", "all_to_all_halo_time", "analytic_llama_costs",
    "analytic_moe_costs", "attention_score_bytes", "chip_rates", "chunk_inflight",
    "costs_at", "default_ep_geometry", "device_capacity", "dtype_bytes", "ep_groups",
    "group_allreduce_time", "hierarchical_allreduce_time", "inflight_microbatches",
    "layer_arrays", "layer_op_split", "measured_calibration",
    "memory_items", "moe_a2a_pass_time", "nic_share", "p2p_link", "p2p_time", "piper_moe_memory", "replica_geometry", "ring_allreduce_time", "stage_layer_range", "stage_memory",
    "state_bytes_per_param", "tied_copy_bytes", "tied_exchange_bytes", "tp_allreduce_time",
    "tp_memory_share", "zero_optimizer_bytes",
]
