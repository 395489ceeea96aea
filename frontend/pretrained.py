"""`init.from = DIR`: a build's initial weights from a pretrained checkpoint.

For a model file holding a transformers model (examples/hf/decoders.py wraps one), DIR is a
transformers directory (config.json + model.safetensors or a sharded index; fp32, bf16 or fp16
on disk) and transformers' own loader reads it, key renames and expert-stack conversions of
its families included; the tensors are then checked against the build's model by name and
shape and copied in as fp32. For any other model file, DIR holds `model.safetensors` under the
model's own parameter names (what `h2x export` writes for it). A missing or mis-shaped tensor is
an error naming it.

Lazily when it can be (`LazyWeights`): the model is built with its parameters on the meta device
(buffers real), every parameter is matched by name and shape against the safetensors headers
first, and `h2c compile` then reads one stage's tensors at a time, so it holds about one stage's
weights. A checkpoint whose names need transformers' conversions (renamed or re-stacked keys)
goes through transformers' loader, with the whole model in host memory.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from h2ir.errors import H2Error


def hf_module(model):
    """The transformers PreTrainedModel inside an h2 model file's module, and its name prefix
    ('lm.' for examples/hf/decoders.py), or (None, '')."""
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
    hf, prefix = hf_module(model)
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


@contextmanager
def parameters_on_meta():
    """Modules built inside keep their parameters on the meta device (each is made, then
    moved: one parameter's memory at a time) and their buffers real, as accelerate's
    init_empty_weights does."""
    import torch
    from torch import nn
    orig = nn.Module.register_parameter

    def register(self, name, param):
        orig(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"),
                                                  requires_grad=param.requires_grad)
    nn.Module.register_parameter = register
    try:
        with torch.no_grad():
            yield
    finally:
        nn.Module.register_parameter = orig


def _safetensors_files(directory: Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, from model.safetensors or a sharded
    index; None when there is neither."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise H2Error("init.from: unreadable model.safetensors.index.json (expected a "
                          "'weight_map' object)", str(index)) from None
        return {k: directory / f for k, f in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


class LazyWeights:
    """A checkpoint's tensors for a model whose parameters are on the meta device, read on
    demand as fp32 host arrays (`array(name)`) after every parameter was matched by name and
    shape from the files' headers."""

    def __init__(self, model, directory: Path, files: dict[str, Path], prefix: str):
        from safetensors import safe_open
        self.directory, self.files = directory, files
        self.key: dict[str, str] = {}
        aliases = dict(model.named_parameters(remove_duplicate=False))
        shapes: dict[str, tuple] = {}
        for path in sorted(set(files.values()), key=str):
            with safe_open(str(path), framework="pt") as f:
                for k in f.keys():
                    shapes[k] = tuple(f.get_slice(k).get_shape())
        for name, p in aliases.items():
            cands = [name[len(prefix):]] if name.startswith(prefix) else [name]
            key = next((c for c in cands if c in shapes), None)
            if key is None:
                # a tied alias reads its owner's tensor
                owner = next((n for n, q in aliases.items() if q is p and n[len(prefix):] in shapes),
                             None)
                key = owner[len(prefix):] if owner else None
            if key is None:
                raise KeyError(name)
            if shapes[key] != tuple(p.shape):
                raise H2Error(f"init.from: tensor {key} has shape {list(shapes[key])}; the "
                              f"model's {name} is {list(p.shape)}", str(directory))
            self.key[name] = key

    def array(self, name: str):
        """The parameter `name` (any alias) as a fresh fp32 numpy array."""
        from safetensors import safe_open
        key = self.key[name]
        # opened per tensor on purpose: a file kept open keeps the pages read so far mapped,
        # and the resident set grows to the whole checkpoint (3.41 GiB against 1.60 GiB for
        # bench/bench_init_from.py's 1 B model)
        with safe_open(str(self.files[key]), framework="pt") as f:
            return f.get_tensor(key).float().numpy()


def lazy_weights(model_file, model_args: dict, directory: str):
    """(the model with parameters on meta, LazyWeights) when DIR's safetensors name every
    parameter directly; None when they do not (transformers' loader is needed)."""
    d = Path(directory)
    if not d.is_dir():
        raise H2Error("init.from: directory not found", directory)
    files = _safetensors_files(d)
    if files is None:
        return None
    with parameters_on_meta():
        model = model_file.build(model_args)
    _, prefix = hf_module(model)
    try:
        return model, LazyWeights(model, d, files, prefix)
    except KeyError:
        return None
