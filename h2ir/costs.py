"""Per-layer cost summary: what the planner, resource model and simulator read from an h2ir graph.

The planner never looks inside an h2ir graph; it reads this summary (the earlier step's artifact).
All per-micro-batch figures are for the micro-batch and sequence length the graph was traced at;
`ModelCosts.scaled` rescales them (every term is linear in the micro-batch size).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class MoEInfo:
    """Shape of a Mixture-of-Experts layer, for the Piper memory and all-to-all terms."""
    num_experts: int
    top_k: int
    d_model: int
    d_ffn: int
    expert_params: int          # parameters of ONE expert


@dataclass(frozen=True)
class LayerCost:
    name: str                   # 'embed', 'block.0' ... 'block.N-1', 'head'
    kind: str                   # 'embedding' | 'transformer_block' | 'moe_block' | 'head'
    params: int
    param_bytes: int
    fwd_flops: int              # per micro-batch
    bwd_flops: int              # per micro-batch
    act_saved_bytes: int        # saved for backward, per micro-batch
    out_bytes: int              # activations crossing the layer's output boundary, per micro-batch
    moe: MoEInfo | None = None
    # saved for backward under selective recomputation (h2ir/recompute.py); None: not priced
    act_selective_bytes: int | None = None

    def selective_bytes(self) -> int:
        return self.act_saved_bytes if self.act_selective_bytes is None else self.act_selective_bytes

    def per_token_scaled(self, r: float) -> "LayerCost":
        """This layer's per-micro-batch figures times r (more or fewer tokens per micro-batch)."""
        return dataclasses.replace(
            self, fwd_flops=int(self.fwd_flops * r), bwd_flops=int(self.bwd_flops * r),
            act_saved_bytes=int(self.act_saved_bytes * r), out_bytes=int(self.out_bytes * r),
            act_selective_bytes=None if self.act_selective_bytes is None
            else int(self.act_selective_bytes * r))


@dataclass(frozen=True)
class TiedParam:
    """One parameter read by several layers (an embedding tied to the LM head): it stays one
    logical parameter, owned (and updated) by its first layer."""
    name: str
    nbytes: int
    owner: str                  # the layer that owns it: its first user
    users: tuple[str, ...]      # the other layers that read it


@dataclass(frozen=True)
class ModelCosts:
    model: str
    micro_batch: int
    seq_len: int
    layers: tuple[LayerCost, ...]
    d_model: int = 0
    n_heads: int = 0
    vocab: int = 0
    dtype_bytes: int = 4        # bytes per parameter/activation element as traced
    ties: tuple[TiedParam, ...] = ()

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)

    def layer(self, name: str) -> LayerCost:
        for l in self.layers:
            if l.name == name:
                return l
        raise KeyError(name)

    def layer_names(self) -> list[str]:
        return [l.name for l in self.layers]

    def scaled(self, micro_batch: int) -> "ModelCosts":
        """Costs at another micro-batch size (all per-micro-batch terms are linear in it)."""
        if micro_batch == self.micro_batch:
            return self
        r = micro_batch / self.micro_batch
        layers = tuple(l.per_token_scaled(r) for l in self.layers)
        return dataclasses.replace(self, micro_batch=micro_batch, layers=layers)

    def to_json(self) -> dict:
        return {
            "model": self.model, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
            "d_model": self.d_model, "n_heads": self.n_heads, "vocab": self.vocab,
            "dtype_bytes": self.dtype_bytes,
            "layers": [dataclasses.asdict(l) for l in self.layers],
            "ties": [dataclasses.asdict(x) for x in self.ties],
            "total_params": self.total_params,
        }

    @classmethod
    def from_json(cls, d: dict) -> "ModelCosts":
        layers = []
        for l in d["layers"]:
            l = dict(l)
            moe = l.pop("moe", None)
            layers.append(LayerCost(**l, moe=MoEInfo(**moe) if moe else None))
        return cls(model=d["model"], micro_batch=d["micro_batch"], seq_len=d["seq_len"],
                   layers=tuple(layers), d_model=d.get("d_model", 0), n_heads=d.get("n_heads", 0),
                   vocab=d.get("vocab", 0), dtype_bytes=d.get("dtype_bytes", 4),
                   ties=tuple(TiedParam(x["name"], x["nbytes"], x["owner"], tuple(x["users"]))
                              for x in d.get("ties", ())))
