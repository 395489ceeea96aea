"""State-space mixers: their selective scan captured as the op set's one `selective_scan` op.

Mamba-family mixers run the scan as a Python loop over the sequence (Mamba's slow path) or as
Mamba-2's chunked einsums; traced, either becomes hundreds of small ops per layer. transformers
routes every such mixer through the kernel interface of the `mamba_ssm` CUDA package, one
function per form, which `kernels` (the hub) or mamba_ssm replace on GPUs:

    selective_scan_fn          Mamba, FalconMamba, Jamba, Zamba          (`mamba_selective_scan`)
    mamba_chunk_scan_combined  Mamba-2, Bamba, GraniteMoeHybrid, Zamba2,  (`mamba2_chunk_scan`)
                               FalconH1, NemotronH

That interface is the cut point (as transformers' experts interface is frontend/moe.py's): while
a model is captured (`scan_kernels`), each modeling module's function of that interface is h2's,
which writes its inputs into the op set's layout, calls the custom op `h2ssm::selective_scan`
(whose backward is `h2ssm::selective_scan_bwd`, so AOTAutograd records both as single calls),
and leaves delta's bias and softplus, the skip term D and the gate to ordinary ops, as the
reference code does. The mixers' own code (projections, the causal depthwise convolution, norms)
is traced as it is: its convolution lowers to the op set's `depthwise_conv1d`. A scan outside
this interface (a model's own loop) is still captured, unrolled into ordinary ops.

The recurrent and cached forms (a state carried in, the last state returned) are inference
paths; they keep the original function.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from backends.torch import ops as torch_ops


# ---- the op, as a torch custom op --------------------------------------------------------------
# Outside an h2 program (eager torch on the CPU) they run the torch backend's kernels.

@torch.library.custom_op("h2ssm::selective_scan", mutates_args=())
def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor) -> torch.Tensor:
    """The op set's selective_scan: u, delta [b,d,l], A [d,n], B, C [b,g,n,l] -> y [b,d,l]."""
    return torch_ops.selective_scan(u, delta, A, B, C)


@selective_scan.register_fake
def _(u, delta, A, B, C):
    return torch.empty_like(u)


@torch.library.custom_op("h2ssm::selective_scan_bwd", mutates_args=())
def selective_scan_bwd(grad: torch.Tensor, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor,
                       B: torch.Tensor, C: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    return torch_ops.selective_scan_bwd(grad, u, delta, A, B, C)


@selective_scan_bwd.register_fake
def _(grad, u, delta, A, B, C):
    return tuple(torch.empty_like(t) for t in (u, delta, A, B, C))


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


selective_scan.register_autograd(
    lambda ctx, g: selective_scan_bwd(g.contiguous(), *ctx.saved_tensors),
    setup_context=_save_inputs)


# ---- the kernel interface's two functions ----------------------------------------------------------

def _packed(kwargs: dict) -> bool:
    """Packed sequences (several documents in one row): the original keeps them apart."""
    return kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None


def mamba_scan(original):
    """selective_scan_fn(u [b,d,l], delta [b,d,l], A [d,n], B, C [b,n,l] or [b,g,n,l], D, z,
    delta_bias, delta_softplus) of Mamba's mixers, as their reference code computes it."""
    def scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, **kwargs):
        if return_last_state or _packed(kwargs):
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state,
                            **kwargs)
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        B, C = (t.unsqueeze(1) if t.dim() == 3 else t for t in (B, C))
        y = selective_scan(hidden_states.float(), dt.float(), A.float(), B.float(), C.float())
        y = y.to(hidden_states.dtype)
        if D is not None:
            y = y + hidden_states * D[None, :, None]
        if z is not None:
            y = y * F.silu(z)
        return y
    return scan


def mamba2_scan(original):
    """mamba_chunk_scan_combined(x [b,l,h,p], dt [b,l,h], A [h], B, C [b,l,g,n], chunk_size, D,
    dt_bias, dt_softplus, dt_limit) of Mamba-2's mixers: channel (head, p) of the op has the
    head's dt and A; the result in f32, [b,l,h,p], as the reference's."""
    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
             dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
             **kwargs):
        if initial_states is not None or return_final_states or _packed(kwargs) \
                or kwargs.get("z") is not None:
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus,
                            dt_limit=dt_limit, return_final_states=return_final_states,
                            **kwargs)
        b, l, h, p = hidden_states.shape
        n = B.shape[-1]
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        x = hidden_states.float()
        u = x.permute(0, 2, 3, 1).reshape(b, h * p, l)
        delta = dt.float().permute(0, 2, 1).unsqueeze(2).expand(b, h, p, l).reshape(b, h * p, l)
        A = A.float()[:, None, None].expand(h, p, n).reshape(h * p, n)
        B, C = (t.float().permute(0, 2, 3, 1) for t in (B, C))
        y = selective_scan(u, delta, A, B, C).reshape(b, h, p, l).permute(0, 3, 1, 2)
        if D is not None:
            y = y + D[..., None] * x
        return y.contiguous()
    return scan


# the interface's functions by their kernel-hub names, and by what transformers' modeling files
# call them (without the `kernels` package they are plain functions)
KERNELS = {"selective_scan_fn": mamba_scan, "mamba_chunk_scan_combined": mamba2_scan}
NAMES = {"mamba_selective_scan": "selective_scan_fn", "mamba2_chunk_scan": "mamba_chunk_scan_combined"}


def _interface_functions(model: nn.Module) -> list[tuple[object, str, object]]:
    """(module namespace, global name, its function) of each kernel-interface function the
    modeling modules of `model`'s classes define."""
    out, seen = [], set()
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is None or id(mod) in seen:
            continue
        seen.add(id(mod))
        for name, fn in list(vars(mod).items()):
            hub = getattr(fn, "kernel_layer_name", None) if callable(fn) else None
            if hub in KERNELS or (callable(fn) and name in NAMES):
                out.append((mod, name, fn))
    return out


def ssm_functions(model: nn.Module) -> list[str]:
    """'module.function' of each scan h2 runs as its op in `model` (for messages and tests)."""
    return [f"{mod.__name__}.{name}" for mod, name, _ in _interface_functions(model)]


@contextlib.contextmanager
def scan_kernels(model: nn.Module):
    """While the block runs, the scan functions of `model`'s modeling modules are h2's (the
    module docstring); restored afterwards, so eager runs of the model are transformers' own."""
    swapped = []
    for mod, name, fn in _interface_functions(model):
        hub = getattr(fn, "kernel_layer_name", None)
        hub = hub if hub in KERNELS else NAMES[name]
        setattr(mod, name, KERNELS[hub](fn))
        swapped.append((mod, name, fn))
    try:
        yield
    finally:
        for mod, name, fn in swapped:
            setattr(mod, name, fn)
