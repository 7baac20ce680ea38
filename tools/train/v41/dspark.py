"""DSpark, the block drafter (`mtp.*`, model-spec §3.8), vectorised over draft blocks.

A draft block at target position p takes [t_{p+1}, noise × (B-1)] at positions p+1..p+B, runs the
DSpark blocks (ratio-0 attention, their own MoE), collapses with the last pre, applies stage
n-1's `norm` and the backbone's fp32 head. Each block's attention sees its own 128-slot (here
`window_size`) ring of rows projected from main_x = main_norm(main_proj(taps)) — the valid slots
in slot order, so position j sits at list index j % W — then all B draft rows of its block
(bidirectional inside the block), the same list for every query (src/model/dspark.cpp,
get_dspark_topk_idxs). The ring row for p is written before the attention, so it is included.

Here every requested p drafts in parallel: ring rows are the main rows j with p-W < j <= p.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .layers import Linear, RMSNorm, rope_cos_sin, weight
from .numerics import bf16, plain_einsum


class _Holder(nn.Module):
    pass


class DSpark:
    """Methods over a V41's `mtp` blocks (not a module: the tensors live in model.mtp)."""

    def __init__(self, model):
        self.m = model

    @staticmethod
    def add_stage_tensors(model, cfg):
        num, d, V = model.num, cfg["dim"], cfg["vocab_size"]
        R = cfg["dspark_markov_rank"]
        first, last = model.mtp[0], model.mtp[-1]
        first.main_proj = Linear(d * len(cfg["dspark_target_layer_ids"]), d, "fp8", "q", num)
        first.main_norm = RMSNorm(d, cfg["norm_eps"], num)
        last.norm = RMSNorm(d, cfg["norm_eps"], num)
        last.markov_head = _Holder()
        last.markov_head.embed = _Holder()
        last.markov_head.embed.weight = nn.Parameter(torch.zeros(V, R))
        last.markov_head.head = _Holder()
        last.markov_head.head.weight = nn.Parameter(torch.zeros(V, R))  # bf16 on disk, fp32 in the model
        last.confidence_head = _Holder()
        # bf16 on disk, fp32 in the model: an fp32 linear over [x_i, e_i]
        last.confidence_head.proj = Linear(d + R, 1, "bf16", "f32", num)

    @property
    def block_size(self):
        return self.m.cfg["dspark_block_size"]

    def main_x(self, taps):
        """taps [b, s, n_taps·d] (V41.forward(taps=True)['taps']) -> main_x [b, s, d]."""
        first = self.m.mtp[0]
        return first.main_norm(first.main_proj(taps))

    def _attention(self, attn, u, main_x, p_idx):
        """One DSpark block's attention. u [b, P, B, d] (after attn_norm), main_x [b, s, d],
        p_idx [P] target positions. The ring of block p is laid out in slot order: slot L holds
        the newest position j <= p with j % W == L (valid once j >= 0), then the B draft rows."""
        num, W, B = attn.num, attn.W, u.shape[2]
        if num.exact and num.exact_order and len(p_idx) > 1 and bool((p_idx + 1 < W).any()):
            # while the ring fills, the list width min(W, p+1) + B differs between blocks, and the
            # kernel's chunk sums follow it: one block at a time
            outs = [self._attention(attn, u[:, i:i + 1], main_x, p_idx[i:i + 1]) for i in range(len(p_idx))]
            return torch.cat(outs, dim=1)
        s = main_x.shape[1]
        main_kv = attn.window_kv(main_x, rope_cos_sin(attn.freqs, torch.arange(s)))      # [b, s, D]
        win = F.pad(main_kv, (0, 0, W - 1, 0)).unfold(1, W, 1).transpose(-1, -2)        # [b, s, W, D]
        L = torch.arange(W)
        w_of = torch.remainder(L.view(1, -1) - (p_idx.view(-1, 1) - W + 1), W)           # [P, W] slot -> row
        ring_kv = win[:, p_idx.view(-1, 1), w_of]                                        # [b, P, W, D]
        ring_ok = (p_idx.view(-1, 1) - W + 1 + w_of) >= 0                                # [P, W]
        pos = p_idx.view(-1, 1) + 1 + torch.arange(B)                                    # [P, B]
        dcs = rope_cos_sin(attn.freqs, pos)
        _, q = attn.queries(u, dcs)                                                      # [b,P,B,H,D]
        kv_d = attn.window_kv(u, dcs)                                                    # [b,P,B,D]
        lr = plain_einsum("bpihd,bpwd->bhpiw", q, ring_kv, num)
        ld = plain_einsum("bpihd,bpjd->bhpij", q, kv_d, num)
        logits = torch.cat([lr, ld], dim=-1)                                             # [b,H,P,B,W+B]
        valid = torch.cat([ring_ok, torch.ones(len(p_idx), B, dtype=torch.bool)], dim=-1).view(1, 1, -1, 1, W + B)
        logits = torch.where(valid, logits, torch.tensor(float("-inf"))) * attn.D ** -0.5
        n_ring = torch.clamp(p_idx + 1, max=W)
        list_pos = torch.cat([L.view(1, -1).expand(len(p_idx), W), n_ring.view(-1, 1) + torch.arange(B)], dim=-1)
        list_pos = list_pos.view(1, 1, -1, 1, W + B)
        sink = weight(attn.attn_sink, "f32", num).view(1, -1, 1, 1)
        vals = torch.cat([ring_kv, kv_d], dim=2).unsqueeze(1)                            # [b,1,P,W+B,D]
        seq = num.exact and num.exact_order

        def pv(P):  # one chain per output in list order under exact_order
            if seq:
                acc = P[..., 0:1] * vals[:, :, :, 0:1, :]
                for t in range(1, W + B):
                    acc = acc + P[..., t:t + 1] * vals[:, :, :, t:t + 1, :]
                return acc
            return torch.matmul(P, vals)

        o = attend(logits, list_pos if num.exact_order else None, int(n_ring.max()) + B, sink, num, pv)
        o = bf16(o.permute(0, 2, 3, 1, 4), num.exact)                                  # [b,P,B,H,D]
        return attn.output(o, dcs)

    def block(self, main_x, p_idx, first_tokens):
        """The drafter's blocks for the target positions p_idx [P], first tokens t_{p+1} [b, P].
        Returns the block logits before the Markov bias [b, P, B, V] and the collapsed pre-norm
        hidden [b, P, B, d]."""
        m, B = self.m, self.block_size
        b, P = first_tokens.shape
        toks = torch.full((b, P, B), int(m.cfg["dspark_noise_token_id"]), dtype=torch.int64)
        toks[..., 0] = first_tokens
        X = m.embed_tokens(toks)
        pre = torch.zeros(b, P, B, m.hc)
        pre[..., 0] = 1.0
        for blk in m.mtp:
            X, pre = blk(X, pre, lambda u, blk=blk: self._attention(blk.attn, u, main_x, p_idx))
        return m.head_logits(X, pre, m.mtp[-1].norm)

    def markov(self, ids):
        """(bias [.., V], e [.., R]) for the previous tokens ids [..]: a rank-R bilinear map."""
        mh, num = self.m.mtp[-1].markov_head, self.m.num
        e = F.embedding(ids, weight(mh.embed.weight, "bf16", num))
        return F.linear(e, weight(mh.head.weight, "bf16", num)), e

    def confidence(self, hidden, e):
        return self.m.mtp[-1].confidence_head.proj(torch.cat([hidden, e], dim=-1)).squeeze(-1)

    @torch.no_grad()
    def draft(self, taps, p_idx, first_tokens, pick=None):
        """The inference step, for target positions p_idx [P] in parallel: the taps of positions
        0..max(p) [b, s, n_taps·d], t_{p+1} [b, P]. The Markov bias is applied sequentially from the
        drafted ids (greedy unless pick(logits) is given). Returns ids [b, P, B+1] ([t_{p+1},
        drafts...]), logits [b, P, B, V] (bias included) and confidences [b, P, B] (raw scalars)."""
        B = self.block_size
        logits, hidden = self.block(self.main_x(taps), p_idx, first_tokens)
        ids = [first_tokens]
        es = []
        for i in range(B):
            bias, e = self.markov(ids[-1])
            logits[:, :, i] = logits[:, :, i] + bias
            es.append(e)
            ids.append(pick(logits[:, :, i]) if pick else logits[:, :, i].argmax(dim=-1))
        conf = self.confidence(hidden, torch.stack(es, dim=2))
        return torch.stack(ids, dim=-1), logits, conf

    def train_forward(self, taps, ids, detach_taps=True):
        """Teacher-forced training form: every position p = 0..s-2 drafts its block in parallel
        (input [t_{p+1}, noise...]); slot i predicts t_{p+2+i}, its Markov bias comes from the true
        t_{p+1+i}. taps detached by default (DSpark trains with no gradient into the backbone).
        Returns {'loss': CE over valid slots, 'confidence_loss': BCE of the confidence, read as a
        logit of "slot i's argmax is right", 'logits' [b,P,B,V], 'confidence' [b,P,B]}.
        The confidence target is an assumption of this port: the tech report says the head predicts
        the per-slot conditional acceptance, and this is its greedy teacher-forced reading."""
        B, s = self.block_size, ids.shape[1]
        if s < 2:
            raise ValueError("need at least two tokens")
        if detach_taps:
            taps = taps.detach()
        p_idx = torch.arange(s - 1)
        logits, hidden = self.block(self.main_x(taps), p_idx, ids[:, 1:])
        slot = torch.arange(B)
        prev_pos = p_idx.view(-1, 1) + 1 + slot                 # [P, B] token the bias conditions on
        tgt_pos = prev_pos + 1
        prev = ids[:, prev_pos.clamp(max=s - 1)]
        tgt = ids[:, tgt_pos.clamp(max=s - 1)]
        valid = (tgt_pos < s).unsqueeze(0).expand_as(tgt)
        bias, e = self.markov(prev)
        logits = logits + bias
        ce = F.cross_entropy(logits[valid], tgt[valid]) if valid.any() else logits.sum() * 0
        conf = self.confidence(hidden, e)
        with torch.no_grad():
            hit = (logits.argmax(dim=-1) == tgt).to(conf.dtype)
        bce = F.binary_cross_entropy_with_logits(conf[valid], hit[valid]) if valid.any() else conf.sum() * 0
        return {"loss": ce, "confidence_loss": bce, "logits": logits, "confidence": conf}
