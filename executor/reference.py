"""Eager single-process PyTorch training of a build's model: the reference h2x must match.

Same model file and arguments, same seed (so the same initial weights), same data, same AdamW
(torch.optim.AdamW with the build's hyper-parameters), gradient accumulation over the same
micro-batches in the same order. Used by the model-level accuracy check (H2's bottom-up
alignment, end-to-end level) and as an anchor in benchmarks.
"""
from __future__ import annotations

import time

import torch

from executor.build import BuildDir
from executor.data import TokenBatches, load_corpus


def eager_losses(build_path: str, steps: int, data: str | None = None, threads: int = 1,
                 timings: list | None = None, model_args: dict | None = None,
                 prepare=None) -> list[float]:
    """Losses of `steps` eager steps; `model_args` overrides some of the build's model
    arguments (e.g. moe_tiny's dense reference form: {"routing": "dense"}); `prepare(model)`
    may change the built model before training (tests install reference forwards)."""
    from frontend.capture import load_model_file
    b = BuildDir(build_path)
    m = b.manifest
    mf = load_model_file(m["model"]["path"])
    torch.set_num_threads(threads)
    torch.manual_seed(m["seed"])
    model = mf.build({**m["model"]["args"], **(model_args or {})})
    if prepare is not None:
        prepare(model)
    loss_fn = mf.loss_fn()
    o = m["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"])
    batches = TokenBatches(load_corpus(data), m["micro_batch"], m["seq_len"], m["num_microbatches"],
                           m["dp"], m["seed"])
    n = m["dp"] * m["num_microbatches"]
    from frontend.moe import set_aux_loss_scale
    set_aux_loss_scale(1.0 / n)          # routers' auxiliary losses weighted like the loss
    fixed = mf.fixed_inputs(m["micro_batch"], m["seq_len"])   # inputs after the token ids
    losses = []
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, targets in batches.global_batch(step):
            out = model(torch.from_numpy(tokens), *fixed)
            loss = loss_fn(out, torch.from_numpy(targets))
            (loss / n).backward()
            total += loss.item()
        opt.step()
        losses.append(total / n)
        if timings is not None:
            timings.append(time.perf_counter() - t0)
    return losses
