#!/usr/bin/env python3
"""Expected packed state rows for tests/row_codecs_test.cpp, from model-spec §3.1 and §6.1.

An independent check of the bytes derived by hand in the test's comments: the quantizers written
from the spec in NumPy (fp32 where the reference computes in fp32, exact float64 elsewhere):
  main KV    E2M1 codes + one E4M3 scale per 16:  s = e4m3_RNE(max(amax, 6*2^-9) / 6)
  index key  E2M1 codes + one E8M0 scale per 32:  s = pow2ceil(fp32(max(amax, 6*2^-126) * fp32(1/6)))
  window     E4M3 codes + one E8M0 scale per 32:  s = pow2ceil(fp32(max(amax, 1e-4) * fp32(1/448)))
E2M1 codes are of clamp(x / s, ±6) (fp32 division), nearest with ties to the even code; E4M3 codes
of x / s, nearest-even, saturated at 448. Nibbles: the even element in the low nibble. Layout: all
codes, then all scales.
Run: /usr/bin/python3 tests/tools/row_codecs_expected.py
"""
import math

import numpy as np

f32 = np.float32
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_code(v):
    a = abs(float(v))
    best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c % 2))  # nearest, ties to the even code
    return (8 if math.copysign(1.0, float(v)) < 0 else 0) | best


def e4m3_code(v):
    """OCP e4m3fn, nearest-even, satfinite. The value is exact in float64."""
    v = float(v)
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    e = max(math.floor(math.log2(a)), -6) if a > 0 else -6
    step = 2.0 ** (e - 3)
    q = round(a / step)  # Python rounds half to even; a / step is exact
    code = q if e == -6 else (e + 7) * 8 + (q - 8)  # q == 16 carries into the next binade
    return sign | code


def e4m3_value(code):
    e, m = (code >> 3) & 0xF, code & 7
    mag = m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
    return -mag if code & 0x80 else mag


def pow2ceil(p):
    p = f32(p)
    m, e = math.frexp(float(p))  # p = m * 2^e, m in [0.5, 1)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0 ** e


def e8m0_code(s):
    return int(math.log2(s)) + 127


def nibbles(codes):
    return [(codes[i] & 0xF) | ((codes[i + 1] & 0xF) << 4) for i in range(0, len(codes), 2)]


def main_kv(x):
    codes, scales = [], []
    for b in range(0, len(x), 16):
        blk = np.asarray(x[b:b + 16], dtype=np.float32)
        amax = max(float(np.max(np.abs(blk))), 6 * 2.0 ** -9)
        sc = e4m3_code(f32(f32(amax) / f32(6)))  # fp32 quotient, then e4m3 rounding
        s = f32(e4m3_value(sc))
        codes += [e2m1_code(np.clip(v / s, f32(-6), f32(6))) for v in blk]
        scales.append(sc)
    return nibbles(codes) + scales


def index_key(x):
    codes, scales = [], []
    for b in range(0, len(x), 32):
        blk = np.asarray(x[b:b + 32], dtype=np.float32)
        amax = f32(max(float(np.max(np.abs(blk))), 6 * 2.0 ** -126))
        s = f32(pow2ceil(amax * f32(1.0 / 6.0)))
        codes += [e2m1_code(np.clip(v / s, f32(-6), f32(6))) for v in blk]
        scales.append(e8m0_code(float(s)))
    return nibbles(codes) + scales


def window(x):
    codes, scales = [], []
    for b in range(0, len(x), 32):
        blk = np.asarray(x[b:b + 32], dtype=np.float32)
        amax = f32(max(float(np.max(np.abs(blk))), float(f32(1e-4))))
        s = f32(pow2ceil(amax * f32(1.0 / 448.0)))
        codes += [e4m3_code(v / s) for v in blk]
        scales.append(e8m0_code(float(s)))
    return codes + scales


def pad(values, n):
    return values + [0.0] * (n - len(values))


# The rows of RowFormats.*HandComputed (the same literals as the test).
MAIN_KV = (pad([3.0, -3.0, 0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5, -0.0, 0.0, -1.0, 0.3, -2.2, 1.0, 0.5,
                7.0, -0.5, 2.0, 4.0], 32) + pad([2.0 ** -10, -3 * 2.0 ** -9], 16))
INDEX_KEY = (pad([5.0, -0.75, 3.5, 0.25, 1.6, -2.6], 32) + pad([-12.0, 1.0, 7.0, 0.4], 32) + pad([-0.0], 32))
WINDOW = (pad([448.0, -1.0, 1.0625, 1.1875, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6, 300.0, -0.0], 32) +
          pad([0.3, -0.1, 1e-5], 32) + pad([-3e-5], 32))


def show(name, row):
    print(f"// {name}: {len(row)} bytes")
    for i in range(0, len(row), 16):
        print("    " + ", ".join(f"0x{b:02x}" for b in row[i:i + 16]) + ",")


show("main KV, 48 lanes", main_kv(MAIN_KV))
show("index key, 96 lanes", index_key(INDEX_KEY))
show("window, 96 lanes", window(WINDOW))
