"""Engram (model-spec §3.6): the compressed token map, the hash constants, the n-gram hash ids and
the gated injection into the 4-copy residual stream.
"""
import json
import re
import unicodedata

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .numerics import bf16, cascade_sum, fake_quant, linear_quantized, mean_sq

# ---- the compressed token map (engram.py's build_compressed_token_map) -----------------------

def _bytes_to_unicode():
    """GPT-2 / tokenizers ByteLevel alphabet: byte -> char."""
    printable = [b for b in range(256) if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table, nxt = {}, 256
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(nxt)
            nxt += 1
    return table


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}

# Rust's char::is_whitespace (Unicode White_Space), which tokenizers' Strip uses. Python's
# str.strip() would also strip U+001C..U+001F, which Rust does not.
_WHITE_SPACE = set(chr(c) for c in list(range(0x09, 0x0E)) + [0x20, 0x85, 0xA0, 0x1680] +
                   list(range(0x2000, 0x200B)) + [0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
_SENTINEL = "\ue000"
_BLANKS = re.compile(r"[ \t\r\n]+")


def _byte_level_decode(token):
    """tokenizers' ByteLevel decoder on one token: alphabet chars become their bytes (a char outside
    the alphabet passes through as its own UTF-8); the bytes are then read as UTF-8 with U+FFFD
    replacement (Rust's from_utf8_lossy)."""
    out = bytearray()
    for ch in token:
        b = _BYTE_OF_CHAR.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out).decode("utf-8", errors="replace")


def engram_normalize(text):
    """NFKC -> NFD -> StripAccents -> Lowercase -> [ \\t\\r\\n]+ to ' ' -> lone space to a sentinel ->
    Strip -> sentinel back to ' ' (the tokenizers normalizer Sequence of engram.py).

    Deviation, by necessity: Python's unicodedata has its own Unicode version, which differs from
    the tables of the Rust tokenizers crate for a few hundred late-added code points (as utf8proc's
    does in the C++ port); none occurs in these tokenizers. StripAccents removes every General
    Category M (Mn, Mc, Me), as unicode-normalization's is_combining_mark does. Lowercase is per
    character (Rust char::to_lowercase), so Python's final-sigma rule of str.lower() is avoided."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if not unicodedata.category(ch).startswith("M"))
    s = "".join(ch.lower() for ch in s)
    s = _BLANKS.sub(" ", s)
    if s == " ":
        s = _SENTINEL
    b, e = 0, len(s)
    while b < e and s[b] in _WHITE_SPACE:
        b += 1
    while e > b and s[e - 1] in _WHITE_SPACE:
        e -= 1
    return s[b:e].replace(_SENTINEL, " ")


def engram_token_map(tokenizer_json_path, vocab_size):
    """LongTensor [vocab_size]: token id -> compressed id. Each id is decoded alone (model vocab
    through the ByteLevel decoder, added tokens verbatim, an absent id as ""); a decode containing
    U+FFFD is keyed by its raw token string, anything else by its normalized text (or the text when
    that normalizes to nothing). New keys take consecutive ids; the compressed vocabulary's size is
    engram_token_map_size(map) (it must equal engram_compressed_vocab_size)."""
    with open(tokenizer_json_path, encoding="utf-8") as f:
        tok = json.load(f)
    token = [""] * vocab_size
    kind = [0] * vocab_size  # 0 absent, 1 model vocab, 2 added token
    for text, i in tok["model"]["vocab"].items():
        if 0 <= i < vocab_size:
            token[i], kind[i] = text, 1
    for added in tok.get("added_tokens") or []:
        i = added["id"]
        if 0 <= i < vocab_size:  # added tokens win over a model token with the same id, as in HF
            token[i], kind[i] = added["content"], 2
    keys, out = {}, []
    for i in range(vocab_size):
        text = _byte_level_decode(token[i]) if kind[i] == 1 else token[i]
        if "\ufffd" in text:
            key = token[i]
        else:
            key = engram_normalize(text) or text
        out.append(keys.setdefault(key, len(keys)))
    return torch.tensor(out, dtype=torch.int64)


def engram_token_map_size(token_map):
    return int(token_map.max().item()) + 1 if token_map.numel() else 0


# ---- hash constants (EngramLayout, compute_hash_multipliers) ---------------------------------

def _is_prime(n):
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_constants(cfg):
    """primes [L, n-1, heads], offsets [L, (n-1)·heads] (exclusive prefix sums), multipliers [L, n]."""
    layers = list(cfg.get("engram_layer_ids") or [])
    n, heads, V = cfg["engram_max_ngram_size"], cfg["engram_n_heads"], cfg["engram_vocab_size"]
    seen, primes = set(), []
    for _ in layers:
        per = []
        for _ in range(n - 1):  # every n-gram order restarts the search at engram_vocab_size - 1
            cur, sizes = V - 1, []
            for _ in range(heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per.append(sizes)
        primes.append(per)
    flat = [[p for per in layer for p in per] for layer in primes]
    offsets = [np.cumsum([0] + sizes[:-1]).tolist() for sizes in flat]
    vocab = cfg["engram_compressed_vocab_size"]
    bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
    mult = []
    for layer in layers:
        g = np.random.default_rng(10007 * layer)
        mult.append((g.integers(low=0, high=bound, size=(n,), dtype=np.int64) * 2 + 1).tolist())
    return (torch.tensor(primes, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64),
            torch.tensor(mult, dtype=torch.int64), [sum(f) for f in flat])


def engram_hash_ids(ids, token_map, pad_id, primes, offsets, multipliers):
    """ids [b, s] -> global table rows [b, s, n_engram_layers, (n-1)·heads] for a prefill at 0.
    Look-back stops at the sequence start (cumulatively: every further shift is padding)."""
    comp = token_map[ids]
    b, s = ids.shape
    n = multipliers.shape[1]
    pad = token_map[pad_id]
    toks = []
    for sh in range(n):
        src = torch.full_like(comp, int(pad))
        if sh < s:
            src[:, sh:] = comp[:, : s - sh]
        toks.append(src)  # positions < sh are blocked, and blocking is cumulative over shifts
    toks = torch.stack(toks, dim=-1)                               # [b, s, n]
    prod = toks.unsqueeze(2) * multipliers                          # [b, s, L, n]
    rolling, hashes = prod[..., 0], []
    for i in range(1, n):
        rolling = torch.bitwise_xor(rolling, prod[..., i])
        hashes.append(torch.remainder(rolling.unsqueeze(-1), primes[:, i - 1]))  # python-style mod
    return torch.cat(hashes, dim=-1) + offsets


# ---- the module --------------------------------------------------------------------------------

class EngramTable(nn.Module):
    """engram.embed: the FP8 table (dequantized), rows looked up and cast to bf16."""

    def __init__(self, rows, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim))


class QLinearEngram(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, k))


class Engram(nn.Module):
    """X[b,s,hc,d] <- X + gate_c · value, with one key per copy and a shared value from the hashed
    n-gram rows (model-spec §3.6 "Module at layer L")."""

    def __init__(self, cfg, slot, num):
        super().__init__()
        self.num = num
        self.slot = slot
        self.dim, self.hc = cfg["dim"], cfg["hc_mult"]
        self.eps = cfg["norm_eps"]
        cols = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
        self.embed = EngramTable(cfg["engram_num_embeddings"][slot], cfg["engram_head_dim"])
        self.wkv = QLinearEngram(cols * cfg["engram_head_dim"], self.dim * (self.hc + 1))
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim))

    def forward(self, X, rows):
        num = self.num
        fq = num.fake_quant_weights
        table = fake_quant(self.embed.weight, "engram") if fq else self.embed.weight
        # F.embedding, not table[rows]: indexing's backward accumulates rows in a thread-dependent
        # order (index_put_), the embedding backward does not, and training must repeat bit for bit.
        e = bf16(F.embedding(rows, table), num.exact).flatten(-2)     # [b, s, cols·head_dim]
        wkv = fake_quant(self.wkv.weight, "fp8") if fq else self.wkv.weight
        kv = linear_quantized(e, wkv, num)
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.unflatten(-1, (self.hc, self.dim))
        qw = fake_quant(self.q_weight, "bf16") if fq else self.q_weight
        kw = fake_quant(self.k_weight, "bf16") if fq else self.k_weight
        weight = qw * kw                                              # only the product is used
        eps = self.eps
        # normalised per copy over dim; the rsqrt product is formed first, then applied
        rstd = torch.rsqrt(mean_sq(X, num)[..., 0] + eps) * torch.rsqrt(mean_sq(key, num)[..., 0] + eps)
        prod = X * weight * key
        dot = cascade_sum(prod) if (num.exact and num.exact_order) else prod.sum(-1)
        dot = dot * rstd * self.dim ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return bf16(X + gate.unsqueeze(-1) * value.unsqueeze(-2), num.exact)
