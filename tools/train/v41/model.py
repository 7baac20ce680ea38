"""DeepSeek-V4.1 (model-spec §3) as a differentiable torch module, for training small models.

V41(cfg) builds every tensor of the checkpoint under its checkpoint name (state_dict keys ==
checkpoint names minus the `.scale` siblings), so

    model = V41(load_config(d)); model.load_state_dict(load_weights(d), strict=True)

loads a release-layout checkpoint, and save_float_checkpoint(path, model.state_dict()) exports one.
forward(ids) is a single prefill at position 0 over all positions, every layer on every token
("exact mode", model-spec §4): logits [b, s, vocab] fp32.

Numerics (numerics.Numerics): V41(cfg) simulates the reference bit for bit (exact_numerics=True,
exact_order=True: slow, for checking); for training use V41(cfg, exact_numerics=False) (plain
fp32) or quantization-aware V41(cfg, exact_numerics=True, exact_order=False,
fake_quant_weights=True). Every rounding is a straight-through estimator.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .dspark import DSpark
from .engram import Engram, engram_constants, engram_hash_ids
from .layers import RMSNorm, weight
from .mhc import hc_mixes, hc_post, hc_pre
from .moe import MoE
from .numerics import Numerics, bf16


def layer_roles(cfg):
    """Static per-layer flags (model-spec §3.4), backbone layers then the DSpark blocks."""
    n, m = cfg["n_layers"], cfg.get("n_mtp_layers", 0) if cfg.get("dspark_block_size", 0) else 0
    kv, ix = set(cfg.get("kv_source_layers", [])), set(cfg.get("index_source_layers", []))
    cand = cfg.get("candidate_source_layer", -1)
    roles = []
    for l in range(n + m):
        backbone = l < n
        r = {"layer": l, "dspark": not backbone, "ratio": cfg["compress_ratios"][l],
             "kv_source": backbone and l in kv, "index_source": backbone and l in ix,
             "candidate_source": backbone and l == cand,
             "candidate_user": backbone and l in ix and 0 <= cand < l}
        roles.append(r)
    return roles


class Block(nn.Module):
    """One layer: mHC around attention and MoE, the V4.1 single-pass handoff (model-spec §3.2)."""

    def __init__(self, cfg, role, num: Numerics, engram_slot=None):
        super().__init__()
        d, hc = cfg["dim"], cfg["hc_mult"]
        mix = (2 + hc) * hc
        self.hc, self.cfg, self.num = hc, cfg, num
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, hc * d))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, hc * d))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.zeros(3))
        self.hc_ffn_scale = nn.Parameter(torch.zeros(3))
        self.attn_norm = RMSNorm(d, cfg["norm_eps"], num)
        self.ffn_norm = RMSNorm(d, cfg["norm_eps"], num)
        self.attn = Attention(cfg, role["layer"], role, num)
        if role["dspark"]:
            E = cfg.get("dspark_n_routed_experts") or cfg["n_routed_experts"]
            k = cfg.get("dspark_n_activated_experts") or cfg["n_activated_experts"]
        else:
            E, k = cfg["n_routed_experts"], cfg["n_activated_experts"]
        self.ffn = MoE(cfg, E, k, num)
        if engram_slot is not None:
            self.engram = Engram(cfg, engram_slot, num)

    def mixes(self, X, which):
        c = self.cfg
        fn, scale, base = (getattr(self, f"hc_{which}_{p}") for p in ("fn", "scale", "base"))
        return hc_mixes(X, fn, scale, base, c["norm_eps"], self.hc, c["hc_sinkhorn_iters"], c["hc_eps"], self.num)

    def forward(self, X, pre_in, attend, route_capture=None):
        """X [.., hc, d]; pre_in [.., hc] (the previous sublayer's pre); attend(u) -> attention out.
        Returns the new stream and this block's FFN pre (for the next block or the head)."""
        a_pre, a_post, a_comb = self.mixes(X, "attn")
        u = self.attn_norm(hc_pre(X, pre_in, self.num))
        X1 = hc_post(attend(u), X, a_post, a_comb, self.num)
        f_pre, f_post, f_comb = self.mixes(X1, "ffn")
        v = self.ffn_norm(hc_pre(X1, a_pre, self.num))  # the FFN input uses the attention's pre
        X2 = hc_post(self.ffn(v, route_capture), X1, f_post, f_comb, self.num)
        return X2, f_pre


class Embedding(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab, dim))


class V41(nn.Module):
    def __init__(self, cfg, exact_numerics=True, exact_order=None, fake_quant_weights=False, token_map=None):
        super().__init__()
        self.cfg = cfg
        self.num = Numerics(exact=exact_numerics,
                            exact_order=exact_numerics if exact_order is None else exact_order,
                            fake_quant_weights=fake_quant_weights)
        d, V, hc = cfg["dim"], cfg["vocab_size"], cfg["hc_mult"]
        self.hc = hc
        self.roles = layer_roles(cfg)
        n = cfg["n_layers"]
        eng = list(cfg.get("engram_layer_ids") or [])
        self.embed = Embedding(V, d)
        self.layers = nn.ModuleList([
            Block(cfg, self.roles[l], self.num, eng.index(l) if l in eng else None) for l in range(n)])
        self.norm = RMSNorm(d, cfg["norm_eps"], self.num)
        self.head = Embedding(V, d)  # [vocab, dim]; bf16 on disk, fp32 in the model
        self.mtp = nn.ModuleList([Block(cfg, self.roles[l], self.num) for l in range(n, len(self.roles))])
        if len(self.mtp):
            DSpark.add_stage_tensors(self, cfg)
        self.dspark = DSpark(self)
        self.engram_slots = eng
        if eng:
            primes, offsets, mult, rows = engram_constants(cfg)
            for l, want, got in zip(eng, cfg["engram_num_embeddings"], rows):
                if want != got:
                    raise ValueError(f"engram layer {l}: primes sum to {got} rows, config says {want}")
            self.register_buffer("engram_primes", primes, persistent=False)
            self.register_buffer("engram_offsets", offsets, persistent=False)
            self.register_buffer("engram_multipliers", mult, persistent=False)
        self.register_buffer("engram_token_map", torch.zeros(0, dtype=torch.int64), persistent=False)
        if token_map is not None:
            self.set_token_map(token_map)

    # -- initialisation (for training from scratch) --
    @torch.no_grad()
    def init_weights(self, seed=0, std=0.02):
        """A from-scratch initialisation: linears N(0, 1/fan_in) (output projections scaled down by
        sqrt(2·layers)), embeddings and tables N(0, std), norms 1, mHC near identity (small fn,
        comb biased to the identity, pre/post neutral), sinks and biases 0. Not DeepSeek's recipe
        (unpublished); a plain, stable default."""
        g = torch.Generator().manual_seed(seed)
        depth = max(1, len(self.layers))
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif leaf in ("attn_sink", "bias", "bias_vl"):
                p.zero_()
            elif leaf.endswith("_fn"):
                p.normal_(0.0, 1e-3, generator=g)
            elif leaf.endswith("_scale"):
                p.fill_(1.0)
            elif leaf.endswith("_base"):
                hc = self.hc
                p.zero_()
                comb = p[2 * hc:].view(hc, hc)
                comb += torch.eye(hc) * 4.0  # Sinkhorn of this is close to the identity
            elif name in ("embed.weight", "head.weight") or "markov_head" in name or name.endswith("engram.embed.weight"):
                p.normal_(0.0, std, generator=g)
            elif leaf in ("q_weight", "k_weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                fan_in = p.shape[1]
                scale = fan_in ** -0.5
                if any(name.endswith(x) for x in ("wo_b.weight", "w2.weight")):
                    scale /= (2 * depth) ** 0.5
                p.normal_(0.0, scale, generator=g)
            else:
                p.normal_(0.0, std, generator=g)
        return self

    # -- configuration --
    def set_numerics(self, exact=None, exact_order=None, fake_quant_weights=None):
        if exact is not None:
            self.num.exact = exact
        if exact_order is not None:
            self.num.exact_order = exact_order
        if fake_quant_weights is not None:
            self.num.fake_quant_weights = fake_quant_weights

    def set_token_map(self, token_map):
        """The Engram compressed token map (engram.engram_token_map), [vocab] int64."""
        tm = torch.as_tensor(token_map, dtype=torch.int64)
        size = int(tm.max().item()) + 1
        want = self.cfg.get("engram_compressed_vocab_size", size)
        if self.engram_slots and size != want:
            raise ValueError(f"token map has {size} compressed ids, config says {want}")
        self.engram_token_map = tm

    def weight_formats(self):
        """{state_dict name: storage format} ('fp8', 'fp4', 'engram', 'bf16', 'f32'): what the C++
        side quantizes each exported tensor to."""
        out = {}
        for mname, mod in self.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                name = f"{mname}.{pname}" if mname else pname
                fmt = getattr(mod, "storage", None)
                if fmt is None:
                    if ".hc_" in name or name.endswith("attn_sink") or name.endswith("gate.bias") \
                            or name.endswith("bias_vl"):
                        fmt = "f32"
                    elif name.endswith("engram.embed.weight"):
                        fmt = "engram"
                    else:
                        fmt = "bf16"
                out[name] = fmt
        return out

    # -- the forward pass --
    def embed_tokens(self, ids):
        w = weight(self.embed.weight, "bf16", self.num)
        h = F.embedding(ids, w)
        return h.unsqueeze(-2).expand(*h.shape[:-1], self.hc, h.shape[-1])

    def head_logits(self, X, pre, norm):
        y = hc_pre(X, pre, self.num)
        return F.linear(norm(y), weight(self.head.weight, "bf16", self.num)), y

    def forward(self, ids, streams=False, taps=False, index=False, aux_loss=False, routes=False, teacher=None):
        """ids [b, s] int64. Returns logits [b, s, vocab] fp32, or, when any option is set, a dict
        with 'logits' and:
          streams: 'streams' [n_layers, b, s, hc, d], the 4-copy stream after every block;
          taps: 'taps' [b, s, n_taps·d], DSpark's main_hidden (mean over copies of the input
                streams of dspark_target_layer_ids, in that order, bf16);
          index: 'index' {layer: {'scores' [b,s,n] as fed to top-k, 'selected' [b,s,k] ascending
                 with -1, and at the candidate source 'candidates' [b,s,n] bool}};
          aux_loss: 'indexer_loss' {layer: scalar} (see Attention._aux_target);
          routes: 'routes' [n_layers, b, s, k] chosen experts.
        teacher: optional {'streams': [n_layers, s, hc, d] or [n_layers, b, s, hc, d], 'selections':
          {layer: [s, k]}, 'pools': {layer: [s, n]}} replacing the stream after each block and the
          selections / pool used downstream by another implementation's (for isolating blocks)."""
        b, s = ids.shape
        ctx = {"teacher": teacher}
        if index:
            ctx["index"] = {}
        if aux_loss:
            ctx["aux"] = {}
        rows = None
        if self.engram_slots:
            if self.engram_token_map.numel() == 0:
                raise ValueError("the Engram token map is not set (set_token_map)")
            rows = engram_hash_ids(ids, self.engram_token_map, self.cfg["engram_pad_id"], self.engram_primes,
                                   self.engram_offsets, self.engram_multipliers)
        X = self.embed_tokens(ids)
        pre = torch.zeros(b, s, self.hc)
        pre[..., 0] = 1.0  # the identity collapse
        targets = list(self.cfg.get("dspark_target_layer_ids") or [])
        tap_list, stream_list, route_list = [], [], []
        shared = {"compress_kv": None, "index_k": None, "topk": None, "candidates": None}
        for l, block in enumerate(self.layers):
            if hasattr(block, "engram"):
                X = block.engram(X, rows[:, :, self.engram_slots.index(l)])
            if l in targets:
                tap_list.append((l, bf16(X.mean(dim=-2), self.num.exact)))
            X, pre = block(X, pre, lambda u, blk=block: blk.attn(u, shared, ctx), route_list if routes else None)
            if streams:
                stream_list.append(X)
            if teacher is not None and teacher.get("streams") is not None:
                t = teacher["streams"][l]
                X = (t if t.dim() == 4 else t.squeeze(0)).expand_as(X).to(X.dtype)
        logits, _ = self.head_logits(X, pre, self.norm)
        if not (streams or taps or index or aux_loss or routes):
            return logits
        out = {"logits": logits}
        if streams:
            out["streams"] = torch.stack(stream_list)
        if taps:
            tap_list.sort(key=lambda t: targets.index(t[0]))
            out["taps"] = torch.cat([t for _, t in tap_list], dim=-1)
        if index:
            out["index"] = ctx["index"]
        if aux_loss:
            out["indexer_loss"] = ctx["aux"]
        if routes:
            out["routes"] = torch.stack([r.view(b, s, -1) for r in route_list])
        return out
