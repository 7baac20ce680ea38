"""mHC, the 4-copy residual stream (model-spec §3.1 hc_split_sinkhorn, §3.2)."""
import torch

from .numerics import Numerics, bf16, mean_sq, plain_linear


class _SinkhornComb(torch.autograd.Function):
    """comb = Sinkhorn(softmax(z) + eps): the forward pass is exactly the reference's sequence of
    fp32 ops; the backward pass is written out by hand (each normalisation y = x / (Σ_a x + eps)
    has dx = (dy - Σ_a dy·y) / (Σ_a x + eps)), which is several times cheaper than autograd's
    graph over 2·iters tiny 4x4 steps."""

    @staticmethod
    def forward(ctx, z, iters, eps):
        e = torch.exp(z - z.amax(dim=-1, keepdim=True))
        p = e / e.sum(dim=-1, keepdim=True)
        comb = p + eps
        outs, dens, axes = [], [], []
        for t in range(2 * iters - 1):
            axis = -2 if t % 2 == 0 else -1  # first a column normalisation, then row/column rounds
            den = comb.sum(dim=axis, keepdim=True) + eps
            comb = comb / den
            outs.append(comb)
            dens.append(den)
            axes.append(axis)
        ctx.save_for_backward(p, *outs, *dens)
        ctx.axes = axes
        return comb

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        n = len(ctx.axes)
        p, outs, dens = saved[0], saved[1:1 + n], saved[1 + n:]
        for t in reversed(range(n)):
            y, den, axis = outs[t], dens[t], ctx.axes[t]
            g = (g - (g * y).sum(dim=axis, keepdim=True)) / den
        g = p * (g - (g * p).sum(dim=-1, keepdim=True))
        return g, None, None


def sinkhorn_split(mixes, scale, base, hc, iters, eps):
    """mixes [..., (2+hc)·hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc] (rows j are
    sources, columns k destinations): sigmoid gates, then a softmax + eps made doubly stochastic by
    a column normalisation and iters-1 rounds of row/column normalisation."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    z = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    return pre, post, _SinkhornComb.apply(z, iters, eps)


def hc_mixes(X, fn, scale, base, norm_eps, hc, iters, hc_eps, num: Numerics):
    """One RMS statistic over the whole flattened hc·d stream of a token, then the 24 mixes."""
    x = X.flatten(-2)
    rsqrt = torch.rsqrt(mean_sq(x, num) + norm_eps)
    mixes = plain_linear(x, fn, num) * rsqrt
    return sinkhorn_split(mixes, scale, base, hc, iters, hc_eps)


def hc_pre(X, pre, num: Numerics):
    """Collapse [.., hc, d] with weights [.., hc] in fp32, one bf16 rounding."""
    if num.exact:
        return bf16(torch.sum(pre.unsqueeze(-1) * X, dim=-2))
    xs, ws = X.unbind(-2), pre.unbind(-1)  # a 4-term sum: elementwise beats a batched 4x4 GEMM
    y = ws[0].unsqueeze(-1) * xs[0]
    for c in range(1, len(xs)):
        y = y + ws[c].unsqueeze(-1) * xs[c]
    return y


def hc_post(u, X, post, comb, num: Numerics):
    """Expand the sublayer output u [.., d] into the copies: post[k]·u + Σ_j comb[j][k]·X[j]."""
    if num.exact:  # the reference's order: the mixed residual summed over sources, then added
        mixed = torch.sum(comb.unsqueeze(-1) * X.unsqueeze(-2), dim=-3)
        return bf16(post.unsqueeze(-1) * u.unsqueeze(-2) + mixed)
    # Σ_j comb[j][k]·X[j] as 4 elementwise terms: torch's batched GEMM over per-token 4x4 matrices
    # loops over the batch one tiny GEMM at a time, 10-50x slower than this (forward and backward).
    xs, rows = X.unbind(-2), comb.unbind(-2)  # rows[j]: [.., hc] over destinations k
    y = post.unsqueeze(-1) * u.unsqueeze(-2)
    for j in range(len(xs)):
        y = y + rows[j].unsqueeze(-1) * xs[j].unsqueeze(-2)
    return y
