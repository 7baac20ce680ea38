"""Weight-holding building blocks shared by the model's parts: linears that know their checkpoint
format, RMSNorm, and the interleaved RoPE (model-spec §3.1)."""
import math

import torch
from torch import nn

from .numerics import Numerics, bf16, fake_quant, linear_bf16, linear_f32, linear_quantized, rms_norm


class Linear(nn.Module):
    """y = x·Wᵀ. `storage` is the checkpoint format ('fp8', 'fp4', 'bf16', 'f32'; used by weight
    fake quantization), `compute` how the reference runs it: 'q' (FP8 activation QDQ + block-scaled
    GEMM, bf16 out), 'bf16' (F.linear in bf16), 'f32' (fp32 in, fp32 out)."""

    def __init__(self, k, n, storage, compute, num: Numerics):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, k))
        self.storage, self.compute = storage, compute
        self.num = num

    def w(self):
        return fake_quant(self.weight, self.storage) if self.num.fake_quant_weights else self.weight

    def forward(self, x):
        w = self.w()
        if self.compute == "q":
            return linear_quantized(x, w, self.num)
        if self.compute == "bf16":
            return linear_bf16(x, w, self.num)
        return linear_f32(x, w, self.num)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, num: Numerics):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.num = eps, num

    def forward(self, x):
        w = fake_quant(self.weight, "bf16") if self.num.fake_quant_weights else self.weight
        return rms_norm(x, w, self.eps, self.num)


def weight(param, storage, num: Numerics):
    """A raw parameter as the forward pass uses it (fake-quantized when asked)."""
    return fake_quant(param, storage) if num.fake_quant_weights else param


# ---- RoPE -------------------------------------------------------------------------------------

def rope_frequencies(rope_dim, base, original_seq_len=0, factor=1.0, beta_fast=32, beta_slow=1):
    """fp32 frequencies exactly as precompute_freqs_cis evaluates them: fp32 pow and reciprocal;
    YaRN (when original_seq_len > 0) with a linear ramp between the correction dims, in fp32."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def corrected(rot):
            return rope_dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corrected(beta_fast)), 0)
        high = min(math.ceil(corrected(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


class Rope:
    """cos, sin [..., rope_dim/2] of the fp32 angles fp32(pos)·f for some positions, with the
    full-width multipliers apply_rope needs cached per (width, direction)."""

    def __init__(self, cos, sin):
        self.cos, self.sin = cos, sin
        self._full, self._heads = {}, None

    def heads(self):
        """The same table broadcast over a heads dim (x [..., H, D])."""
        if self._heads is None:
            self._heads = Rope(self.cos.unsqueeze(-2), self.sin.unsqueeze(-2))
        return self._heads

    def full(self, D, rope_dim, inverse):
        key = (D, rope_dim, inverse)
        if key not in self._full:
            sin = -self.sin if inverse else self.sin
            lead = self.cos.shape[:-1]
            keep = D - rope_dim
            c2 = torch.cat([torch.ones(lead + (keep,)), self.cos.repeat_interleave(2, dim=-1)], -1)
            s2 = torch.cat([torch.zeros(lead + (keep,)), torch.stack([-sin, sin], dim=-1).flatten(-2)], -1)
            self._full[key] = (c2, s2)
        return self._full[key]


def rope_cos_sin(freqs, positions):
    """The Rope table of `positions` (an int tensor of any shape). torch.polar gives the
    reference's own cos/sin table entries."""
    angle = positions.to(torch.float32).unsqueeze(-1) * freqs
    c = torch.polar(torch.ones_like(angle), angle)
    return Rope(c.real.contiguous(), c.imag.contiguous())


def apply_rope(x, rope, rope_dim, num: Numerics, inverse=False):
    """Rotate the last rope_dim lanes of x, adjacent pairs (x[2i], x[2i+1]) as complex numbers:
    (a, b) -> (a·cos - b·sin, a·sin + b·cos), each product rounded in fp32, then one bf16 rounding.
    rope: a Rope broadcastable to x[..., :rope_dim/2]. Written over the whole vector (cos 1 and
    sin 0 on the other lanes) so the backward pass needs no slicing; on those lanes the result is
    x·1 + (±0) = x, and a bf16 value stays itself under the rounding."""
    c2, s2 = rope.full(x.shape[-1], rope_dim, inverse)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)      # (b, a) for every pair
    return bf16(x * c2 + swapped * s2, num.exact)
