"""Eager single-process PyTorch training of a build's model: the reference h2x must match.

Same model file and arguments, same seed (so the same initial weights), same data, gradient
accumulation over the same micro-batches in the same order, and the training recipe done by
PyTorch's own pieces: torch.optim.AdamW with the same parameter groups (weight decay off for the
parameters h2ir/config.py `decays` excludes), torch.optim.lr_scheduler.LambdaLR for the lr
schedule, torch.nn.utils.clip_grad_norm_ for clipping. Used by the model-level accuracy check
(H2's bottom-up alignment, end-to-end level) and as an anchor in benchmarks.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from executor.build import BuildDir
from executor.data import TokenBatches, open_batches, prepare_mix
from h2ir.config import decays, lr_factor


@dataclass
class EagerRun:
    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)     # before clipping, as h2x logs it
    lrs: list = field(default_factory=list)
    eval_losses: list = field(default_factory=list)    # (step, loss)
    model: object = None                               # the trained module


def _batches(build: BuildDir, sources: list[dict], shuffle: bool, data) -> TokenBatches:
    """The batches h2x draws for these sources under the config's data section `data`."""
    m = build.manifest
    mix = prepare_mix(m, build.path / "data", sources, tokenizer=data.tokenizer, shuffle=shuffle,
                      eod=data.eod_token, packing=data.packing, out=lambda *_: None)
    return open_batches(mix, m["micro_batch"], m["seq_len"], m["num_microbatches"], m["dp"],
                        m["seed"])


def eager_train(build_path: str, steps: int, *, config=None, data: str | None = None,
                lr_lambda=None, threads: int = 1, timings: list | None = None,
                model_args: dict | None = None, prepare=None) -> EagerRun:
    """`steps` eager steps under `config` (h2ir/config.py; None: the build's train.toml).
    `lr_lambda(step)`: LambdaLR's multiplier (None: the config's schedule); `model_args`
    overrides some of the build's model arguments (e.g. moe_tiny's dense reference form:
    {"routing": "dense"}); `prepare(model)` may change the built model before training."""
    from frontend.capture import load_model_file
    b = BuildDir(build_path)
    m = b.manifest
    cfg = config or b.config()
    cfg.training.steps = steps
    mf = load_model_file(m["model"]["path"])
    torch.set_num_threads(threads)
    torch.manual_seed(m["seed"])
    model = mf.build({**m["model"]["args"], **(model_args or {})})
    if prepare is not None:
        prepare(model)
    if cfg.init.from_:                   # the build's pretrained start (frontend/pretrained.py)
        from frontend.pretrained import load_pretrained
        load_pretrained(model, cfg.init.from_)
    loss_fn = mf.loss_fn()
    o, tr = cfg.optimizer, cfg.training
    opt_d = {"no_decay_1d": o.no_decay_1d, "no_decay": o.no_decay}
    named = list(model.named_parameters())          # tied parameters once, as PyTorch counts
    groups = [{"params": [p for k, p in named if decays(k, p.ndim, opt_d)],
               "weight_decay": o.weight_decay},
              {"params": [p for k, p in named if not decays(k, p.ndim, opt_d)],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=(o.beta1, o.beta2),
                            eps=o.eps)
    sched = {"kind": cfg.lr_schedule.kind, "warmup_steps": cfg.lr_schedule.warmup_steps,
             "decay_steps": cfg.lr_schedule.decay_steps, "min_lr": cfg.lr_schedule.min_lr}
    lam = lr_lambda or (lambda s: lr_factor(sched, s, steps, o.lr))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    d = cfg.data
    sources = d.sources or [{"path": data if data is not None else d.path, "format": d.format,
                             "max_bytes": d.max_bytes}]
    batches = _batches(b, sources, d.shuffle, d)
    held_out = _batches(b, [{"path": cfg.eval.data, "format": cfg.eval.format,
                             "max_bytes": d.max_bytes}], False, d) \
        if cfg.eval.data else None
    n = m["dp"] * m["num_microbatches"]
    from frontend.moe import set_aux_loss_scale
    set_aux_loss_scale(1.0 / n)          # routers' auxiliary losses weighted like the loss
    fixed = mf.fixed_inputs(m["micro_batch"], m["seq_len"])   # inputs after the token ids
    params = [p for _, p in named]
    run = EagerRun()
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, targets in batches.global_batch(step):
            out = model(torch.from_numpy(tokens), *fixed)
            loss = loss_fn(out, torch.from_numpy(targets))
            (loss / n).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, tr.clip_grad_norm if tr.clip_grad_norm > 0
                                              else math.inf)
        run.lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
        run.losses.append(total / n)
        run.grad_norms.append(float(norm))
        if timings is not None:
            timings.append(time.perf_counter() - t0)
        every = cfg.eval.every
        if held_out is not None and (step + 1 == steps or (every and (step + 1) % every == 0)):
            with torch.no_grad():
                ls = [loss_fn(model(torch.from_numpy(x), *fixed), torch.from_numpy(y)).item()
                      for k in range(cfg.eval.steps) for x, y in held_out.global_batch(k)]
            run.eval_losses.append((step + 1, sum(ls) / len(ls)))
    run.model = model
    return run


def eager_losses(build_path: str, steps: int, data: str | None = None, threads: int = 1,
                 timings: list | None = None, model_args: dict | None = None,
                 prepare=None) -> list[float]:
    """Losses of `steps` eager steps with the build's own recipe (its train.toml)."""
    return eager_train(build_path, steps, data=data, threads=threads, timings=timings,
                       model_args=model_args, prepare=prepare).losses
