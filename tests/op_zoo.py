"""A model file nobody wrote for h2: one block calls ~70 torch functions a model might (norms done
by hand, exotic activations, index tricks, reductions, flips, rolls, remainders, a causal
convolution, a recurrence). The tests
train it on both backends against eager and check its stage gradients against eager autograd
(tests/test_lowering_fallbacks.py, tests/test_compiler.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def _ar(x):
    return torch.arange(x.shape[-1], device=x.device)


OPS = [
    lambda s, x: x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[None, :, None],
    lambda s, x: F.softplus(x), lambda s, x: torch.erf(x), lambda s, x: torch.atan(x),
    lambda s, x: x * torch.cos(torch.outer(torch.arange(x.shape[1], device=x.device).float(),
                                           torch.ones(x.shape[-1], device=x.device)))[None],
    lambda s, x: torch.flip(x, dims=[-1]), lambda s, x: torch.roll(x, 1, dims=-1),
    lambda s, x: torch.gather(x, -1, _ar(x).flip(0).expand_as(x).contiguous()),
    lambda s, x: torch.stack([x, -x], 0).sum(0) * 0.5 + x,
    lambda s, x: x - torch.logsumexp(x, -1, keepdim=True), lambda s, x: F.normalize(x, dim=-1),
    lambda s, x: torch.clamp(x, -1, 1), lambda s, x: F.glu(torch.cat([x, x], -1), dim=-1),
    lambda s, x: F.elu(x), lambda s, x: F.leaky_relu(x, 0.1), lambda s, x: F.mish(x),
    lambda s, x: F.hardswish(x), lambda s, x: x - x.amax(-1, keepdim=True),
    lambda s, x: (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True,
                                                                  unbiased=False) + 1e-5),
    lambda s, x: x / (x.std(-1, keepdim=True) + 1e-5),
    lambda s, x: x - torch.var_mean(x, -1, keepdim=True)[1] + 0.01 * (
        torch.std_mean(x, dim=-1, keepdim=True)[0] + torch.var(x, dim=(1, 2), correction=0,
                                                               keepdim=True)),
    lambda s, x: torch.sign(x) * x.abs().pow(1.5), lambda s, x: torch.log1p(torch.exp(-x.abs())),
    lambda s, x: torch.sin(x) + torch.cos(x), lambda s, x: s.gn(x.transpose(1, 2)).transpose(1, 2),
    lambda s, x: x - x.max(-1, keepdim=True).values, lambda s, x: torch.where(x > 0, x, 0.1 * x),
    lambda s, x: (x.transpose(1, 2) @ torch.triu(torch.ones(x.shape[1], x.shape[1],
                                                            device=x.device))).transpose(1, 2),
    lambda s, x: x[..., :x.shape[-1] // 2].repeat(1, 1, 2) / x.shape[1],
    lambda s, x: x[..., :x.shape[-1] // 2].repeat_interleave(2, dim=-1),
    lambda s, x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    lambda s, x: x * torch.sigmoid(1.702 * x), lambda s, x: F.gelu(x, approximate="tanh"),
    lambda s, x: F.gelu(x), lambda s, x: F.silu(x),
    lambda s, x: torch.minimum(x, torch.zeros_like(x) + 0.5),
    lambda s, x: x.index_select(-1, _ar(x).flip(0)), lambda s, x: x + x.square() * 0.1,
    lambda s, x: x * torch.reciprocal(x.abs() + 1),
    lambda s, x: x.masked_fill(torch.ones_like(x, dtype=torch.bool).tril(), 0.0) + x,
    lambda s, x: torch.einsum("bsd,de->bse", x, s.mix),
    lambda s, x: F.layer_norm(x, x.shape[-1:]), lambda s, x: F.rms_norm(x, x.shape[-1:]),
    lambda s, x: x + 0.1 * F.one_hot(x.argmax(-1), x.shape[-1]).float(),
    lambda s, x: torch.sort(x, -1).values,
    lambda s, x: torch.baddbmm(x, x, s.mix.expand(x.shape[0], -1, -1)) * 0.5,
    lambda s, x: torch.addmm(s.bias, x.reshape(-1, x.shape[-1]), s.mix).view_as(x),
    lambda s, x: F.softmax(x, -1) * x.shape[-1], lambda s, x: F.log_softmax(x, -1),
    lambda s, x: torch.tanh(x) + (_ar(x) // 2).float() * 0.01 + (_ar(x) % 3).float() * 0.01,
    lambda s, x: torch.remainder(x, 1.5) + torch.fmod(x, 0.75),
    lambda s, x: torch.lerp(x, torch.zeros_like(x), 0.3), lambda s, x: torch.addcmul(x, x, x, value=0.1),
    lambda s, x: torch.hypot(x, torch.ones_like(x)), lambda s, x: torch.maximum(x, -x),
    lambda s, x: x * (x.abs() > 0.01).float(), lambda s, x: torch.nan_to_num(x),
    lambda s, x: torch.expm1(x.clamp(max=2)), lambda s, x: torch.log2(x.abs() + 1),
    lambda s, x: F.relu6(x) + F.hardtanh(x), lambda s, x: F.selu(x) + F.celu(x),
    lambda s, x: F.softsign(x) + F.logsigmoid(x), lambda s, x: F.tanhshrink(x),
    lambda s, x: torch.cat(x.chunk(4, -1)[::-1], -1),
    lambda s, x: torch.cat([x.narrow(-1, 0, 8), x[..., 8:]], -1) * 1.0,
    lambda s, x: x.clone().index_fill(-1, torch.tensor([0], device=x.device), 0.0),
    # a causal depthwise convolution (nn.Conv1d padded on both sides, cut to the past) and a
    # linear recurrence written as a Python loop over the steps
    lambda s, x: s.dw(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2),
    lambda s, x: _decayed_sum(x, 0.8),
    lambda s, x: F.pad(x, (2, -2)) + F.pad(x[:, 1:], (0, 0, 1, 0), value=0.5),
]


def _decayed_sum(x, a):
    h, out = torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        h = a * h + (1 - a) * x[:, t]
        out.append(h)
    return torch.stack(out, 1)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gn = nn.GroupNorm(4, d)
        self.mix = nn.Parameter(torch.eye(d) + 0.01 * torch.randn(d, d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.dw = nn.Conv1d(d, d, 3, groups=d, padding=2)

    def forward(self, x):
        h = self.lin(x)
        for op in OPS:
            h = op(self, h)
        return x + 0.1 * h


class Net(nn.Module):
    def __init__(self, d=32, layers=3):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, 256)

    def forward(self, ids):
        x = self.emb(ids)
        for l in self.layers:
            x = l(x)
        return self.head(x)


def build_model(layers=3):
    return Net(layers=layers)
