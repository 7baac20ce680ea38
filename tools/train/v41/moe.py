"""MoE (model-spec §3.5): sqrt-softplus router with a selection-only bias, top-k, renormalised and
scaled weights; SwiGLU experts with clamps; a shared expert."""
import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear, weight
from .numerics import Numerics, bf16, plain_linear


class Expert(nn.Module):
    def __init__(self, dim, inter, storage, limit, num: Numerics):
        super().__init__()
        self.w1 = Linear(dim, inter, storage, "q", num)
        self.w2 = Linear(inter, dim, storage, "q", num)
        self.w3 = Linear(dim, inter, storage, "q", num)
        self.limit, self.num = limit, num

    def forward(self, x, route_weight=None):
        gate = self.w1(x)  # each GEMM's output is bf16 before it is widened (linear_quantized)
        up = self.w3(x)
        if self.limit > 0:
            up = torch.clamp(up, min=-self.limit, max=self.limit)
            gate = torch.clamp(gate, max=self.limit)
        h = F.silu(gate) * up
        if route_weight is not None:  # the routing weight goes in before w2
            h = route_weight * h
        return self.w2(bf16(h, self.num.exact))


class Gate(nn.Module):
    def __init__(self, dim, n_experts, topk, cfg, num: Numerics):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, dim))
        # The noaux_tc correction bias only steers selection (a top-k), so no gradient can reach it:
        # DeepSeek updates it by the auxiliary-loss-free balancing rule, outside autograd. Hence
        # requires_grad=False, by design.
        self.bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
        self.topk = topk
        self.score_func = cfg.get("score_func", "sqrtsoftplus")
        self.temp = cfg.get("gate_temp", 1.0)
        self.norm_topk = cfg.get("norm_topk_prob", True)
        self.route_scale = cfg.get("route_scale", 1.0)
        self.num = num

    def forward(self, x):
        """x [n, d] -> weights [n, k], indices [n, k]."""
        w = weight(self.weight, "bf16", self.num)
        scores = plain_linear(x, w, self.num) / self.temp  # fp32 router
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        with torch.no_grad():
            idx = (scores + self.bias).topk(self.topk, dim=-1)[1]
        wts = scores.gather(1, idx)
        if self.norm_topk and self.topk > 1:
            wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)  # this literal, not norm_eps
        return wts * self.route_scale, idx


class MoE(nn.Module):
    def __init__(self, cfg, n_experts, topk, num: Numerics):
        super().__init__()
        d, inter, lim = cfg["dim"], cfg["moe_inter_dim"], cfg.get("swiglu_limit", 0.0)
        self.gate = Gate(d, n_experts, topk, cfg, num)
        storage = "fp4" if cfg.get("expert_dtype", "fp4") == "fp4" else "fp8"
        self.experts = nn.ModuleList([Expert(d, inter, storage, lim, num) for _ in range(n_experts)])
        self.shared_experts = Expert(d, inter, "fp8", lim, num)
        self.num = num

    def forward(self, x, capture=None):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        wts, idx = self.gate(x)
        if capture is not None:
            capture.append(idx)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):  # ascending expert id: the reference's sum order
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            y = y.index_add(0, tok, expert(x[tok], wts[tok, slot].unsqueeze(-1)))
        y = y + self.shared_experts(x)
        return bf16(y, self.num.exact).reshape(shape)
