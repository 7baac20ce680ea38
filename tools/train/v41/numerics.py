"""The reference's number formats and roundings, as differentiable torch ops (model-spec §2.2, §3.1).

Every rounding here is a straight-through estimator: the forward pass returns the rounded value
exactly, the backward pass is the identity (so the same code runs the exact reference numerics and
quantization-aware training). torch 1.13 has no float8 dtypes, so e4m3 / e2m1 rounding is written
with frexp/ldexp arithmetic and the decoders are lookup tables.

All activations are carried as fp32 tensors; "cast to bf16" means round-to-nearest-even to a bf16
value held in fp32 (`bf16()`), which is what the reference's bf16 tensors hold.
"""
from dataclasses import dataclass

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
# The kernels multiply by the reciprocal as an fp32 constant (model-spec §3.1).
FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)


@dataclass
class Numerics:
    """What the forward pass simulates. Shared by every module of one model (mutable at run time).

    exact: every rounding of the reference (bf16 casts, FP8 activation QDQ before FP8/FP4 linears,
        FP8 window KV, FP4 compressed KV and index q/k, bf16 index scores, bf16 attention
        probabilities, ...), each as a straight-through estimator. False: plain fp32 math (no
        rounding at all) — the fastest float training mode.
    exact_order: also follow the reference's order of fp32 operations, which only moves ulps but
        decides which side of a bf16 / e4m3 rounding a value lands on: FP8/FP4 GEMMs accumulated
        per 32-wide K block in K order, every other sensitive fp32 GEMM as one sequential chain per
        output (independent of the machine's BLAS), torch's own cascade order for the means of
        squares and the Engram dot (with the goldens' 8 vector lanes), and attention's online
        softmax walked in 64-entry chunks of the reference's index lists. With it the port
        reproduces the goldens bit for bit. Only meaningful with exact=True; it costs time (Python
        loops over K), so training and QAT set it False.
    fake_quant_weights: quantize-dequantize the weights to their checkpoint format on every use
        (FP8 e4m3 with 32x32 E8M0 tiles, routed experts E2M1 with per-32 E8M0, Engram tables FP8
        with per-32 row scales, BF16 tensors rounded to bf16), STE. Off when the weights were
        loaded from a checkpoint (they are already exact; the QDQ is idempotent on them).
    """

    exact: bool = True
    exact_order: bool = True
    fake_quant_weights: bool = False


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q):
        return q

    @staticmethod
    def backward(ctx, g):
        return g, None


def ste(x, q):
    """Forward: q (exactly). Backward: identity into x. q must not require grad."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return q
    return _StraightThrough.apply(x, q.detach())


# ---- scalar formats, as fp32 value-to-value roundings (no gradient; wrap with ste) --------------

def _pow2(e):
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


def round_bf16_raw(x):
    return x.to(torch.bfloat16).to(torch.float32)


def round_e4m3_raw(x):
    """OCP e4m3fn, round to nearest even, saturating at +-448 (CUDA satfinite)."""
    a = x.abs().clamp(max=FP8_MAX)
    _, e = torch.frexp(a)                      # a = m·2^e, m in [0.5, 1)
    quantum = _pow2(torch.clamp(e - 1, min=-6) - 3)  # 3 mantissa bits; subnormal step 2^-9
    return torch.copysign(torch.round(a / quantum) * quantum, x)


def round_e2m1_raw(x):
    """E2M1 (values 0, .5, 1, 1.5, 2, 3, 4, 6), round to nearest even, saturating at +-6.
    torch.round is half-to-even on the quantum grid, which gives exactly the format's ties:
    0.75->1, 1.75->2, 3.5->4 up; 0.25, 1.25, 2.5, 5 down."""
    a = x.abs().clamp(max=FP4_MAX)
    _, e = torch.frexp(a)
    quantum = _pow2(torch.clamp(e - 1, min=0) - 1)  # 1 mantissa bit; subnormal step 0.5
    return torch.copysign(torch.round(a / quantum) * quantum, x)


def pow2_ceil(amax, max_inv):
    """2^ceil(log2(amax · max_inv)) by the kernel's exponent-bit rule (exponent field, plus one if
    the mantissa is nonzero), for a normal fp32 product."""
    p = amax * max_inv
    m, e = torch.frexp(p)
    return torch.where(m == 0.5, _pow2(e - 1), _pow2(e))


def bf16(x, on=True):
    if not on:
        return x
    return ste(x, round_bf16_raw(x.detach()))


# ---- the reference's activation quantizers (inplace QDQ forms) -----------------------------------

def _fp8_act_qdq_raw(x, block=32):
    xg = x.unflatten(-1, (-1, block))
    amax = xg.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    s = pow2_ceil(amax, FP8_MAX_INV)
    q = round_e4m3_raw(xg / s)
    return round_bf16_raw((q * s).flatten(-2))


def act_qdq_fp8(x, on=True):
    """act_quant(x, 32, 'ue8m0', inplace=True): FP8 e4m3 per 32 along the last dim, power-of-two
    scales, dequantized back to bf16."""
    if not on:
        return x
    return ste(x, _fp8_act_qdq_raw(x.detach()))


def _fp4_qdq_e8m0_raw(x, block=32):
    xg = x.unflatten(-1, (-1, block))
    amax = xg.abs().amax(dim=-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = pow2_ceil(amax, FP4_MAX_INV)
    v = (xg / s).clamp(-FP4_MAX, FP4_MAX)
    return round_bf16_raw((round_e2m1_raw(v) * s).flatten(-2))


def fp4_qdq_e8m0(x, on=True):
    """fp4_act_quant(x, 32, inplace, E8M0): the indexer's q and keys."""
    if not on:
        return x
    return ste(x, _fp4_qdq_e8m0_raw(x.detach()))


def _fp4_qdq_e4m3_raw(x, block=16):
    xg = x.unflatten(-1, (-1, block))
    amax = xg.abs().amax(dim=-1, keepdim=True).clamp_min(6 * 2.0 ** -9)
    s = round_e4m3_raw(amax / FP4_MAX)
    v = (xg / s).clamp(-FP4_MAX, FP4_MAX)
    return round_bf16_raw((round_e2m1_raw(v) * s).flatten(-2))


def fp4_qdq_e4m3(x, on=True):
    """fp4_act_quant(x, 16, inplace, E4M3 scales): the compressed main KV rows."""
    if not on:
        return x
    return ste(x, _fp4_qdq_e4m3_raw(x.detach()))


# ---- weight fake quantization (the checkpoint's formats; same rules as the C++ writer) ----------

def _fq_fp8_tiles_raw(w, rows=32, cols=32):
    """FP8 e4m3 with one power-of-two scale per rows×cols tile: s = pow2ceil(amax/448)."""
    n, k = w.shape
    pn, pk = (-n) % rows, (-k) % cols
    wp = torch.nn.functional.pad(w, (0, pk, 0, pn))
    t = wp.reshape((n + pn) // rows, rows, (k + pk) // cols, cols)
    amax = t.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30)
    s = pow2_ceil(amax, FP8_MAX_INV)
    q = round_e4m3_raw(t / s) * s
    return q.reshape(n + pn, k + pk)[:n, :k]


def _fq_fp4_rows_raw(w, block=32):
    """MXFP4: E2M1 with one power-of-two scale per 32 along each row: s = pow2ceil(amax/6)."""
    g = w.unflatten(-1, (-1, block))
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    s = pow2_ceil(amax, FP4_MAX_INV)
    return (round_e2m1_raw((g / s).clamp(-FP4_MAX, FP4_MAX)) * s).flatten(-2)


def fake_quant(w, storage):
    """The value the checkpoint format `storage` would hold for w, STE.
    storage: 'fp8' (32×32 tiles), 'fp4' (E2M1 per 32), 'engram' (FP8, 1×32 row tiles), 'bf16', 'f32'."""
    if storage == "f32":
        return w
    with torch.no_grad():
        if storage == "fp8":
            q = _fq_fp8_tiles_raw(w.detach())
        elif storage == "engram":
            q = _fq_fp8_tiles_raw(w.detach(), rows=1, cols=32)
        elif storage == "fp4":
            q = _fq_fp4_rows_raw(w.detach())
        elif storage == "bf16":
            q = round_bf16_raw(w.detach())
        else:
            raise ValueError(storage)
    return ste(w, q)


# ---- linear layers --------------------------------------------------------------------------

def seq_matmul(a, b):
    """a [..., M, K] @ b [..., K, N] with every output a sequential fp32 chain over k (products
    rounded, no fused multiply-add): the order of a plain BLAS dot and of the C++ engine's
    reference kernels. The goldens' BLAS order is unknowable; an optimised BLAS (blocked, FMA)
    moves more roundings than this chain does, and the result must not depend on which BLAS the
    machine has, so exact_order runs every sensitive fp32 GEMM this way."""
    K = a.shape[-1]
    acc = a[..., :, 0:1] * b[..., 0:1, :]
    for k in range(1, K):
        acc = acc + a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return acc


def plain_linear(x, w, num: Numerics = None):
    """x·Wᵀ in fp32: a sequential chain per output under exact_order, else BLAS."""
    if num is not None and num.exact and num.exact_order:
        lead = x.shape[:-1]
        return seq_matmul(x.reshape(-1, x.shape[-1]), w.t()).reshape(*lead, w.shape[0])
    return torch.nn.functional.linear(x, w)


def plain_einsum(eq, a, b, num: Numerics = None):
    """torch.einsum for two operands; under exact_order the contraction is a sequential chain."""
    if not (num is not None and num.exact and num.exact_order):
        return torch.einsum(eq, a, b)
    if "..." in eq:  # only `a` may carry the ellipsis (the leading dims)
        extra = "UVWXYZ"[: a.dim() - (len(eq.split(",")[0]) - 3)]
        eq = eq.replace("...", extra)
    ins, out = eq.split("->")
    ia, ib = ins.split(",")
    contract = [c for c in ia if c in ib and c not in out]
    assert len(contract) == 1, eq
    c = contract[0]
    # move the contraction to the last dim of a, broadcast both over the output's letters
    letters = out + c
    def lift(t, idx):
        perm_src = [idx.index(ch) for ch in letters if ch in idx]
        t = t.permute(perm_src)
        have = [ch for ch in letters if ch in idx]
        shape = []
        j = 0
        for ch in letters:
            if ch in have:
                shape.append(t.shape[j]); j += 1
            else:
                shape.append(1)
        return t.reshape(shape)
    A, B = lift(a, ia), lift(b, ib)
    acc = A[..., 0] * B[..., 0]
    for k in range(1, A.shape[-1]):
        acc = acc + A[..., k] * B[..., k]
    return acc


def linear_quantized(x, w, num: Numerics):
    """An FP8 or FP4 weight's linear (model-spec §3.1): the activation FP8-QDQ'd per 32, the GEMM
    accumulated per 32-wide K block in fp32 in K order, the output cast to bf16. With dequantized
    weights the per-block power-of-two scales commute exactly with the block sums, so
    Σ_k (x_k·W_kᵀ) equals the reference's Σ_k (A_k·B_kᵀ)·a_s·b_s."""
    if not num.exact:
        return torch.nn.functional.linear(x, w)
    xq = act_qdq_fp8(x)
    if num.exact_order:
        k = x.shape[-1]
        kb = k // 32
        lead = xq.shape[:-1]
        a = xq.reshape(-1, kb, 32).transpose(0, 1)          # [kb, M, 32]
        b = w.reshape(w.shape[0], kb, 32).permute(1, 2, 0)  # [kb, 32, N]
        partial = seq_matmul(a, b)                          # [kb, M, N], each block a chain
        acc = partial[0]
        for j in range(1, kb):
            acc = acc + partial[j]
        y = acc.reshape(*lead, w.shape[0])
    else:
        y = torch.nn.functional.linear(xq, w)
    return bf16(y)


def linear_bf16(x, w, num: Numerics):
    """F.linear in bf16: fp32 accumulation, one rounding of the output."""
    return bf16(plain_linear(x, w, num), num.exact)


def linear_f32(x, w, num: Numerics = None):
    return plain_linear(x, w, num)


def _ceil_log2(x):
    return 1 if x <= 2 else (x - 1).bit_length()


def _multi_row_sum(size, load):
    """ATen's multi_row_sum (4 rows, 4 levels) over `size` steps; load(i) -> [..., 4, W]."""
    power = max(4, _ceil_log2(size) // 4)
    step, mask = 1 << power, (1 << power) - 1
    acc = [None] * 4
    i = 0

    def add(a, v):
        return v if a is None else a + v

    while i + step <= size:
        for _ in range(step):
            acc[0] = add(acc[0], load(i))
            i += 1
        for j in range(1, 4):
            if acc[j - 1] is not None:
                acc[j] = add(acc[j], acc[j - 1])
            acc[j - 1] = None
            if (i & (mask << (j * power))) != 0:
                break
    while i < size:
        acc[0] = add(acc[0], load(i))
        i += 1
    for j in range(1, 4):
        if acc[j] is not None:
            acc[0] = add(acc[0], acc[j])
    return acc[0]


def _row_sum(items):
    """ATen's row_sum: items [..., count, W] interleaved 4 ways, leftovers into row 0, then
    row 0 += row 1, += row 2, += row 3. Returns [..., W]."""
    count = items.shape[-2]
    steps = count // 4
    rows = None
    if steps > 0:
        grid = items[..., : steps * 4, :].unflatten(-2, (steps, 4))
        rows = _multi_row_sum(steps, lambda i: grid[..., i, :, :])
    r0 = rows[..., 0, :] if rows is not None else torch.zeros_like(items[..., 0, :])
    for v in range(steps * 4, count):
        r0 = r0 + items[..., v, :]
    if rows is not None:
        for k in range(1, 4):
            r0 = r0 + rows[..., k, :]
    return r0


# The vector width of the torch build that made the goldens: 8 fp32 lanes (AVX2 kernels). Measured
# on tiny-dense, block 0 teacher-forced: every sum in this order with 8 lanes reproduces the golden
# stream bit for bit at all 152 positions; with 16 (AVX-512) three positions differ. (oneDNN was capped at AVX512_CORE_BF16, ATen's own kernels ran AVX2.)
GOLDEN_SUM_LANES = 8


def cascade_sum(v, lanes=None):
    """Σ over the last dim in the order of torch's CPU sum (ATen cascade_sum, contiguous inner
    reduction: vectors of `lanes` fp32, a 4-way interleave, a 4-level cascade, the lanes added
    last; see src/kernels/cascade_sum.h), whatever this machine's vector width is."""
    lanes = lanes or GOLDEN_SUM_LANES
    n = v.shape[-1]
    if n < lanes:
        r = _row_sum(v.unsqueeze(-1))[..., 0]
        return r
    vec = n // lanes
    lane_sums = _row_sum(v[..., : vec * lanes].unflatten(-1, (vec, lanes)))
    total = torch.zeros_like(v[..., 0])
    for i in range(vec * lanes, n):
        total = total + v[..., i]
    for l in range(lanes):
        total = total + lane_sums[..., l]
    return total


def mean_sq(x, num: Numerics):
    """x.square().mean(-1, keepdim=True), in the reference's summation order when exact_order."""
    if num.exact and num.exact_order:
        return (cascade_sum(x.square()) / x.shape[-1]).unsqueeze(-1)
    return x.square().mean(-1, keepdim=True)


def rms_norm(x, w, eps, num: Numerics):
    """fp32 RMSNorm with the weight multiply in fp32 and one rounding to bf16."""
    var = mean_sq(x, num)
    return bf16(w * (x * torch.rsqrt(var + eps)), num.exact)


# ---- decoders of the stored formats -----------------------------------------------------------

def e4m3_table():
    """The 256 e4m3fn code values (0x7F/0xFF are NaN)."""
    c = torch.arange(256, dtype=torch.int64)
    sign = torch.where(c >= 128, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = (c & 7).to(torch.float64)
    val = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).to(torch.float64)))
    val = (sign * val).to(torch.float32)
    val[(c & 0x7F) == 0x7F] = float("nan")
    return val


E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def e8m0_values(codes_u8):
    """UE8M0 codes -> 2^(code-127) (0xFF = NaN)."""
    e = codes_u8.to(torch.int32) - 127
    v = torch.ldexp(torch.ones(e.shape, dtype=torch.float32), e)
    return torch.where(codes_u8 == 255, torch.tensor(float("nan")), v)
