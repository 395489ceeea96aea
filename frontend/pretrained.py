"""`init.from = DIR`: a build's initial weights from a pretrained checkpoint.

For a model file holding a transformers model (examples/hf/decoders.py wraps one), DIR is a
transformers directory (config.json + model.safetensors or a sharded index; fp32, bf16 or fp16
on disk) and transformers' own loader reads it, key renames and expert-stack conversions of
its families included; the tensors are then checked against the build's model by name and
shape and copied in as fp32. For any other model file, DIR holds `model.safetensors` under the
model's own parameter names (what `h2x export` writes for it). A missing or mis-shaped tensor is
an error naming it. The whole model is in host memory while this runs.
"""
from __future__ import annotations

from pathlib import Path

from h2ir.errors import H2Error


def _hf_module(model):
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None, ""
    for name, m in model.named_modules():
        if isinstance(m, PreTrainedModel):
            return m, (name + "." if name else "")
    return None, ""


def _source_state(model, directory: Path) -> tuple[dict, str, str]:
    """(tensors by the model's own names, what they were read with, a name prefix)."""
    import torch
    hf, prefix = _hf_module(model)
    if hf is not None:
        from transformers import AutoModelForCausalLM
        if not (directory / "config.json").is_file():
            raise H2Error("init.from: not a transformers directory (no config.json)",
                          str(directory))
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()    # its load report: missing tensors are told below
        try:
            src, info = AutoModelForCausalLM.from_pretrained(
                str(directory), dtype=torch.float32, output_loading_info=True)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise H2Error(f"init.from: transformers cannot load it: {str(e).splitlines()[0]}",
                          str(directory)) from None
        finally:
            hf_logging.set_verbosity(level)
        # transformers initializes what the checkpoint lacks at random: for a start from
        # pretrained weights that is an error
        missing = sorted(info.get("missing_keys") or []) + \
            sorted(str(k[0]) if isinstance(k, tuple) else str(k)
                   for k in info.get("mismatched_keys") or [])
        if missing:
            raise H2Error(f"init.from: the checkpoint has no usable tensor {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                          str(directory))
        return src.state_dict(), "transformers", prefix
    f = directory / "model.safetensors"
    if not f.is_file():
        raise H2Error("init.from: no model.safetensors here (a model file that is not a "
                      "transformers model reads its own parameter names from it)", str(directory))
    from safetensors.torch import load_file
    return {k: v.float() for k, v in load_file(str(f)).items()}, "safetensors", ""


def load_pretrained(model, directory: str) -> str:
    """Copy DIR's weights into `model` (every trainable parameter; buffers stay as built);
    returns a one-line note of what was read."""
    import torch
    d = Path(directory)
    if not d.is_dir():
        raise H2Error("init.from: directory not found", directory)
    state, how, prefix = _source_state(model, d)
    params = dict(model.named_parameters())
    aliases = dict(model.named_parameters(remove_duplicate=False))
    loaded = 0
    with torch.no_grad():
        for k, p in params.items():
            names = [n for n, q in aliases.items() if q is p]
            keys = [n[len(prefix):] for n in names if n.startswith(prefix)]
            key = next((n for n in keys if n in state), None)
            if key is None:
                if not p.requires_grad:
                    continue
                raise H2Error(f"init.from: the checkpoint has no tensor for parameter {k} "
                              f"(looked for {', '.join(keys) or k})", directory)
            t = state[key]
            if tuple(t.shape) != tuple(p.shape):
                raise H2Error(f"init.from: tensor {key} has shape {list(t.shape)}; the model's "
                              f"{k} is {list(p.shape)}", directory)
            p.copy_(t.to(p.dtype))
            loaded += 1
    return f"init.from {directory}: {loaded} parameters read with {how}"
