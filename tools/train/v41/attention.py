"""CSA2 attention for a prefill at position 0 (model-spec §3.3, §3.4), dense and vectorised.

The reference walks per-query index lists: the window list (rows max(0,i-W+1).., -1 padded at the
end to width min(s, W)), then the selected compressed rows ascending (list offset = that width).
Here every query scores its W window rows (a banded view, slot w = row i-W+1+w) and every
compressed row (one matrix, masked to its selection); each kept entry's position in the
reference's list is tracked (`list_pos`) so that exact numerics can walk the 64-entry chunks of
that list as the kernel does (bf16 probabilities relative to the running max, chunk sums in list
order).

Shared runtime ("last writer wins", as the reference's process-global slots): a KV source
publishes its compressed KV (and, when it emitted rows, its index keys); an index source publishes
its top-k; the candidate source publishes the pool. Later layers read whatever was published last.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear, RMSNorm, apply_rope, rope_cos_sin, rope_frequencies, weight
from .numerics import (Numerics, act_qdq_fp8, bf16, cascade_sum, fp4_qdq_e4m3, fp4_qdq_e8m0, plain_einsum,
                       seq_matmul)

CHUNK = 64  # sparse_attn's block of indices (K41:328)
MAX_FLOOR = -1e30  # the kernel's finite initial running max


def attend(logits, list_pos, list_width, sink, num: Numerics, pv):
    """Attention over listed entries. logits [..., n] (fp32, already ·scale, -inf where not listed),
    list_pos [..., n] each entry's index in the reference's list (None unless exact_order),
    list_width the list's full width (its -1 slots included), sink broadcastable to
    logits[..., 0]; pv(P) -> P·V for weights P shaped like logits. Returns the output before its
    final bf16 rounding.

    exact + exact_order: the kernel's online softmax chunk by chunk of 64 list entries, in list
    order: running max floored at -1e30, p = exp(l - max) with bf16(p) into P·V, the chunk's fp32
    sum (in torch's summation order over the chunk laid out in list order) into the denominator,
    both rescaled by exp(old max - new max); then the unscaled sink joins the denominator.
    exact alone: the same roundings relative to the final max in one pass. Not exact: a plain
    softmax with the sink as one more logit."""
    if not num.exact:
        m = torch.maximum(logits.amax(dim=-1), sink).detach()
        p = torch.exp(logits - m.unsqueeze(-1))
        return pv(p) / (p.sum(dim=-1) + torch.exp(sink - m)).unsqueeze(-1)
    if not num.exact_order or list_pos is None:
        m = logits.amax(dim=-1).clamp_min(MAX_FLOOR).detach()
        p = torch.exp(logits - m.unsqueeze(-1))
        return pv(bf16(p)) / (p.sum(dim=-1) + torch.exp(sink - m)).unsqueeze(-1)
    listed = torch.isfinite(logits)
    lp = torch.where(listed, list_pos.expand_as(logits), torch.full_like(logits, list_width, dtype=torch.int64))
    cid = torch.div(lp, CHUNK, rounding_mode="floor")
    run = torch.full(logits.shape[:-1], MAX_FLOOR)
    total, acc = None, None
    for c in range((list_width + CHUNK - 1) // CHUNK):
        in_c = cid == c
        lc = logits.masked_fill(~in_c, float("-inf"))
        new = torch.maximum(run, lc.amax(dim=-1)).detach()
        rescale = torch.exp(run - new)
        p = torch.exp(lc - new.unsqueeze(-1))
        # the chunk's probabilities in list order (its -1 slots zero), summed as torch sums them
        lo, hi = c * CHUNK, min(list_width, (c + 1) * CHUNK)
        slot = torch.where(in_c, lp - lo, torch.full_like(lp, hi - lo))
        row = torch.zeros(logits.shape[:-1] + (hi - lo + 1,)).scatter(-1, slot, p)[..., : hi - lo]
        csum = cascade_sum(row)
        part = pv(bf16(p))
        total = csum if total is None else total * rescale + csum
        acc = part if acc is None else acc * rescale.unsqueeze(-1) + part
        run = new
    total = total + torch.exp(sink - run)
    return acc / total.unsqueeze(-1)


def topk_ascending_mask(scores, k, visible):
    """The reference's `topk(k, sorted=False).indices.sort()`, then -1 for idx >= compress_len.
    scores [..., s, n], visible [s] -> (mask [..., s, n] bool, selected [..., s, k] int, -1 = none).
    Ties (equal bf16 scores are common) are broken by torch.topk itself, as in the reference: on
    the goldens this reproduces the reference's selections exactly (a stable lower-index-first
    order, the C++ engine's serving default, differs from it at 5-57 queries per layer of tiny-sparse;
    the engine's TopkTies::Torch reproduces torch's choice)."""
    sel = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    ok = sel < visible.view(-1, 1)
    mask = torch.zeros(scores.shape, dtype=torch.bool).scatter(-1, sel, ok)
    return mask, torch.where(ok, sel, torch.full_like(sel, -1))


def select_candidate_blocks(scores, visible, topk_blocks, block_size):
    """Level one (model-spec §3.3 step 4): block score = max over its positions (-inf padded), the
    block of the newest visible position pinned to +inf, the top blocks with a score > -inf kept
    (torch.topk's own tie-breaking, as the reference). Returns the pool as a per-position mask."""
    n = scores.shape[-1]
    pad = (-n) % block_size
    blocks = F.pad(scores, (0, pad), value=float("-inf")).unflatten(-1, (-1, block_size)).amax(dim=-1)
    nb = blocks.shape[-1]
    last = torch.div(visible - 1, block_size, rounding_mode="floor").view(-1, 1)
    blocks = blocks.masked_fill(torch.arange(nb) == last, float("inf"))
    top = blocks.topk(min(topk_blocks, nb), dim=-1)
    keep = torch.zeros(blocks.shape, dtype=torch.bool).scatter(-1, top.indices, top.values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[..., :n]


class Compressor(nn.Module):
    def __init__(self, cfg, ratio, num):
        super().__init__()
        d, D = cfg["dim"], cfg["head_dim"]
        self.ratio, self.num = ratio, num
        # ratio 1 stays a bf16 projection; above 1 the weights are promoted to fp32 (model-spec §2.2)
        self.wkv = Linear(d, D, "bf16", "bf16" if ratio == 1 else "f32", num)
        if ratio > 1:
            self.wgate = Linear(d, D, "bf16", "f32", num)
        self.norm = RMSNorm(D, cfg["norm_eps"], num)

    def forward(self, x):
        """x [b, s, d] -> latents [b, s // ratio, D] (normed, before RoPE); a trailing partial group
        is dropped (the reference parks it in kv_state for decode)."""
        r = self.ratio
        if r == 1:
            return self.norm(self.wkv(x))
        s = x.shape[1]
        cut = s - s % r
        kv = self.wkv(x[:, :cut]).unflatten(1, (-1, r))
        score = self.wgate(x[:, :cut]).unflatten(1, (-1, r))
        latent = (kv * score.softmax(dim=2)).sum(dim=2)
        return self.norm(bf16(latent, self.num.exact))


class Indexer(nn.Module):
    def __init__(self, cfg, layer_id, owns_keys, num):
        super().__init__()
        self.nh, self.K = cfg["index_n_heads"], cfg["index_head_dim"]
        self.wq_b = Linear(cfg["q_lora_rank"], self.nh * self.K, "fp8", "q", num)
        self.weights_proj = Linear(cfg["dim"], self.nh, "bf16", "bf16", num)
        if owns_keys:
            self.wk = Linear(cfg["head_dim"], self.K, "bf16", "bf16", num)
            self.k_norm = RMSNorm(self.K, cfg["norm_eps"], num)
        self.owns_keys = owns_keys
        self.num = num

    def keys(self, latent, cs, rd):
        """Index keys from the un-rotated latents: k_norm(wk(latent)), RoPE at the group's first
        position, FP4 (E8M0 per 32)."""
        k = self.k_norm(self.wk(latent))
        k = apply_rope(k, cs, rd, self.num)
        return fp4_qdq_e8m0(k, self.num.exact)

    def scores(self, x, qr, keys, cs, rd):
        """score[b, i, t] = Σ_h relu(q_I[h]·k_t)·w[h], in bf16 as the reference (unmasked)."""
        num = self.num
        q = self.wq_b(qr).unflatten(-1, (self.nh, self.K))
        q = apply_rope(q, cs.heads(), rd, num)
        q = fp4_qdq_e8m0(q, num.exact)
        w = bf16(self.weights_proj(x) * (self.K ** -0.5 * self.nh ** -0.5), num.exact)
        sc = bf16(plain_einsum("bshd,btd->bsht", q, keys, num), num.exact)
        sc = bf16(torch.relu(sc) * w.unsqueeze(-1), num.exact)
        return bf16(sc.sum(dim=2), num.exact)


class Attention(nn.Module):
    def __init__(self, cfg, layer_id, role, num: Numerics):
        super().__init__()
        d, H, D = cfg["dim"], cfg["n_heads"], cfg["head_dim"]
        self.cfg, self.layer_id, self.role, self.num = cfg, layer_id, role, num
        self.H, self.D, self.rd = H, D, cfg["rope_head_dim"]
        self.G, self.R = cfg["o_groups"], cfg["o_lora_rank"]
        self.W = cfg["window_size"]
        self.ratio = role["ratio"]
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.wq_a = Linear(d, cfg["q_lora_rank"], "fp8", "q", num)
        self.q_norm = RMSNorm(cfg["q_lora_rank"], cfg["norm_eps"], num)
        self.wq_b = Linear(cfg["q_lora_rank"], H * D, "fp8", "q", num)
        self.wkv = Linear(d, D, "fp8", "q", num)
        self.kv_norm = RMSNorm(D, cfg["norm_eps"], num)
        # wo_a is FP8 on disk, but the model runs it in bf16 (convert.py dequantizes it)
        self.wo_a = Linear(H * D // self.G, self.G * self.R, "fp8", "bf16", num)
        self.wo_b = Linear(self.G * self.R, d, "fp8", "q", num)
        if role["kv_source"]:
            self.compressor = Compressor(cfg, self.ratio, num)
        if role["index_source"]:
            self.indexer = Indexer(cfg, layer_id, role["kv_source"], num)
        if self.ratio > 0:
            freqs = rope_frequencies(self.rd, cfg["compress_rope_theta"], cfg.get("original_seq_len", 0),
                                     cfg.get("rope_factor", 1), cfg.get("beta_fast", 32), cfg.get("beta_slow", 1))
        else:  # pure sliding-window layers: base theta, no YaRN
            freqs = rope_frequencies(self.rd, cfg["rope_theta"])
        self.register_buffer("freqs", freqs, persistent=False)

    # -- pieces reused by DSpark --
    def queries(self, x, cs):
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.H, self.D))
        q = apply_rope(q, cs.heads(), self.rd, self.num)
        return qr, q

    def window_kv(self, x, cs):
        kv = self.kv_norm(self.wkv(x))
        kv = apply_rope(kv, cs, self.rd, self.num)
        return act_qdq_fp8(kv, self.num.exact)  # FP8 over all lanes, RoPE tail included

    def output(self, o, cs):
        """o [.., H, D]: inverse RoPE, grouped wo_a (block-diagonal, bf16), wo_b."""
        num = self.num
        o = apply_rope(o, cs.heads(), self.rd, num, inverse=True)
        o = o.flatten(-2).unflatten(-1, (self.G, -1))
        wo_a = self.wo_a.w().view(self.G, self.R, -1)
        o = bf16(plain_einsum("...gd,grd->...gr", o, wo_a, num), num.exact)
        return self.wo_b(o.flatten(-2))

    def forward(self, x, shared, ctx):
        """x [b, s, d] (the attention input after attn_norm) -> [b, s, d]."""
        num, rd = self.num, self.rd
        b, s, _ = x.shape
        pos = torch.arange(s)
        cs = rope_cos_sin(self.freqs, pos)                 # [s, rd/2]
        qr, q = self.queries(x, cs)
        kv = self.window_kv(x, cs)
        # the window part, banded: query i sees rows i-W+1..i (slot w = row i-W+1+w)
        W = self.W
        kv_win = F.pad(kv, (0, 0, W - 1, 0)).unfold(1, W, 1).transpose(-1, -2)   # [b, s, W, D]
        i = torch.arange(s).view(-1, 1)
        j = i - W + 1 + torch.arange(W)
        valid_w = (j >= 0).expand(b, s, W)
        pos_w = (j - (i - W + 1).clamp_min(0)).expand(b, s, W)  # the reference's list index: j - start
        width = min(s, W)
        seq = num.exact and num.exact_order
        band = (j.clamp_min(0)).view(1, 1, s, W).expand(b, self.H, s, W)
        if seq:
            logit_parts = [plain_einsum("bshd,bswd->bhsw", q, kv_win, num)]
        else:
            # one GEMM per (batch, head) over every key, then the band gathered out of it: a batched
            # GEMM of one query against its W rows runs as s tiny GEMMs, many times slower
            logit_parts = [torch.einsum("bshd,btd->bhst", q, kv).gather(-1, band)]
        valid_parts, pos_parts = [valid_w], [pos_w]
        ckv_used = None
        aux_rows = None
        k_sel = 0
        if self.ratio > 0:
            r = self.ratio
            n_c = s // r
            latent = None
            if self.role["kv_source"]:
                if n_c > 0:
                    latent = self.compressor(x)
                    ccs = rope_cos_sin(self.freqs, torch.arange(n_c) * r)  # group j at position j·r
                    if self.role["index_source"]:
                        # index keys come from the pre-RoPE latent; indexer inputs are detached
                        # (the indexer is trained by its own loss: _aux_target). A KV source
                        # without an indexer publishes no keys (the reference's keys live in the
                        # Indexer module), so the last published ones stay.
                        shared["index_k"] = self.indexer.keys(latent.detach(), ccs, rd)
                    ckv = apply_rope(latent, ccs, rd, num)
                    shared["compress_kv"] = fp4_qdq_e4m3(ckv, num.exact)
                else:
                    shared["compress_kv"] = x.new_zeros(b, 0, self.D)
            if self.role["index_source"]:
                self._select(x, qr, cs, n_c, shared, ctx)
            ckv = shared["compress_kv"]
            if ckv is not None and ckv.shape[1] > 0 and n_c > 0:
                sel = shared["topk"]                                       # [b, s, n_c] bool
                k_sel = shared["topk_width"]
                ckv_used = ckv[:, :n_c]
                logit_parts.append(plain_einsum("bshd,bnd->bhsn", q, ckv_used, num))
                valid_parts.append(sel)
                pos_parts.append(width + torch.cumsum(sel.to(torch.int64), dim=-1) - 1)
                if ctx.get("aux") is not None and self.role["index_source"]:
                    aux_rows = ckv_used
        valid_all = torch.cat(valid_parts, dim=-1).unsqueeze(1)            # [b, 1, s, W + n_c]
        pos_all = torch.cat(pos_parts, dim=-1).unsqueeze(1)
        logits = torch.cat(logit_parts, dim=-1)
        logits = torch.where(valid_all, logits, torch.tensor(float("-inf"))) * self.D ** -0.5
        sink = weight(self.attn_sink, "f32", num).view(1, -1, 1)
        list_width = width + (k_sel if self.ratio > 0 else 0)

        def pv(P):
            """P [b, H, s, W + n_c] · the listed rows. Under exact_order one sequential fp32 chain per
            output over the window slots then the compressed rows: the reference's list order."""
            if seq:
                vw = kv_win.unsqueeze(1)                                   # [b, 1, s, W, D]
                acc = P[..., 0:1] * vw[..., 0, :]
                for w in range(1, W):
                    acc = acc + P[..., w:w + 1] * vw[..., w, :]
                if ckv_used is not None:
                    vc = ckv_used.unsqueeze(1)                             # [b, 1, n_c, D]
                    for c in range(ckv_used.shape[1]):
                        acc = acc + P[..., W + c:W + c + 1] * vc[:, :, c:c + 1, :]
                return acc
            # the band's probabilities scattered back to key positions (masked slots hold 0)
            dense = torch.zeros(b, self.H, s, s, dtype=P.dtype).scatter_add(-1, band, P[..., :W])
            out = torch.matmul(dense, kv.unsqueeze(1))
            if ckv_used is not None:
                out = out + torch.matmul(P[..., W:], ckv_used.unsqueeze(1))
            return out

        o = attend(logits, pos_all if num.exact_order else None, list_width, sink, num, pv)
        o = bf16(o, num.exact).transpose(1, 2)                             # [b, s, H, D]
        if aux_rows is not None:
            self._aux_target(q, aux_rows, shared, ctx)
        return self.output(o, cs)

    def _select(self, x, qr, cs, n_c, shared, ctx):
        """Run this index source's indexer; publish its top-k (and the pool at the candidate source)."""
        b, s, _ = x.shape
        cfg, r = self.cfg, self.ratio
        if n_c == 0:
            shared["topk"] = torch.zeros(b, s, 0, dtype=torch.bool)
            shared["topk_width"] = 0
            return
        visible = torch.div(torch.arange(1, s + 1), r, rounding_mode="floor")
        keys = shared["index_k"][:, :n_c]
        raw = self.indexer.scores(x.detach(), qr.detach(), keys, cs, self.rd)     # [b, s, n_c]
        hidden = torch.arange(n_c).unsqueeze(0) >= visible.unsqueeze(1)
        sc = raw.masked_fill(hidden, float("-inf"))
        cap = {} if ctx.get("index") is not None else None
        with torch.no_grad():
            if self.role["candidate_source"]:
                pool = select_candidate_blocks(sc.detach(), visible, cfg["candidate_topk_blocks"],
                                               cfg["candidate_block_size"])
                if cap is not None:
                    cap["candidates"] = pool
                teacher = (ctx.get("teacher") or {}).get("pools", {}).get(self.layer_id)
                shared["candidates"] = teacher.expand(b, s, n_c).bool() if teacher is not None else pool
        if self.role["candidate_user"]:
            sc = sc.masked_fill(~shared["candidates"], float("-inf"))
        k = min(cfg["index_topk"], n_c)
        with torch.no_grad():
            mask, selected = topk_ascending_mask(sc.detach(), k, visible)
            teacher = (ctx.get("teacher") or {}).get("selections", {}).get(self.layer_id)
            if teacher is not None:  # another implementation's choices replace ours downstream
                t = teacher.expand(b, s, k).long()
                t = torch.where(t >= 0, t, torch.full_like(t, n_c))  # -1 -> a dropped extra column
                mask = torch.zeros(b, s, n_c + 1, dtype=torch.bool).scatter(-1, t, True)[..., :n_c]
        shared["topk"] = mask
        shared["topk_width"] = k  # the selected list's width, its -1 slots included
        if cap is not None:
            cap.update(scores=sc.detach(), selected=selected)
            ctx["index"][self.layer_id] = cap
        if ctx.get("aux") is not None:
            ctx["aux_pending"] = (self.layer_id, sc, visible)

    def _aux_target(self, q, rows, shared, ctx):
        """The indexer's training signal (DeepSeek's lightning-indexer objective, as in V3.2):
        KL(target || softmax(index scores)) over the compressed positions the indexer may pick
        (visible, and inside the pool for a candidate user), where the target is the main
        attention's probability mass over those same positions — this layer's queries scored
        densely against every such compressed row, softmax per head, summed over heads and
        L1-normalised — detached, so the loss trains only the indexer (its inputs are detached too)."""
        pend = ctx.pop("aux_pending", None)
        if pend is None or pend[0] != self.layer_id:
            return
        _, sc, visible = pend
        with torch.no_grad():
            lg = torch.einsum("bshd,bnd->bhsn", q, rows) * self.D ** -0.5
            allowed = torch.isfinite(sc).unsqueeze(1)
            lg = lg.masked_fill(~allowed, float("-inf"))
            has = allowed.any(dim=-1, keepdim=True)
            att = torch.where(has, torch.softmax(lg.masked_fill(~has, 0.0), dim=-1), torch.zeros_like(lg))
            target = att.sum(dim=1)
            target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            rows_ok = has.squeeze(1).squeeze(-1)                        # [b, s]
        logp = torch.log_softmax(sc.masked_fill(~torch.isfinite(sc), -1e30), dim=-1)
        kl = (target * (torch.log(target.clamp_min(1e-30)) - logp)).sum(dim=-1)
        kl = torch.where(rows_ok, kl, torch.zeros_like(kl))
        ctx["aux"][self.layer_id] = kl.sum() / rows_ok.sum().clamp_min(1)
