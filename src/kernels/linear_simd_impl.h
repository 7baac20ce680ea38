// The ISA-independent part of the fast linear layers, included by simd_avx2.cpp and simd_avx512.cpp
// inside their target region and namespace. The including file defines:
//  * `V`: the vector type F with W fp32 lanes and its operations, kGemvRows and MI (below);
//  * quantize_row: act_quant of one row, as quant.cpp computes it;
//  * decoders `Fp8Dec`, `Fp4Dec`, `Bf16Dec`: given pointers to one K block (32 k) of a tile of 2W weight
//    rows, call sink.w(j, v0, v1) for j = 0..31 in order, where the lanes of v0 and v1 are the weights
//    (row, k = 32b+j) of the tile's rows in the order Dec::lane_row gives; Dec::store writes a
//    tile's outputs from vectors in that order.
//
// Lanes are output rows, so every output keeps the reference's sequential chain over k (see
// linear_internal.h). Weights packed at load time (packed_weights.h) are already laid that way; from
// the row-major layout the transposition happens while decoding, on bytes, where it is cheapest. Two
// vectors per k give two independent chains, so one chain's FMA latency hides behind the other's.
// Two paths share the decoders:
//  * m <= V::kGemvRows (decode steps, small expert batches: GEMV): each decoded vector feeds the
//    FMAs of every activation row at once, nothing is stored;
//  * larger m (GEMM): a panel of 2W rows × KC blocks is decoded once into a buffer and reused by
//    every activation row, MI rows at a time, with 2·MI independent accumulator chains in registers.
// Rows are split over the thread pool in whole tiles; a row's result does not depend on its tile.
//
// This header has no include guard on purpose: each ISA file includes it once, in its own namespace.

// ---- kinds ----------------------------------------------------------------------------------------

constexpr int64_t kKc = 8;  // K blocks per GEMM panel: 2W rows × 256 k decoded = 32 KiB (AVX-512)

// The weight-side specifics of each layer kind, on top of its decoder.
struct Fp8Kind {
  using Dec = Fp8Dec;
  using PDec = Fp8PackedDec;
  using Matrix = Fp8Matrix;
  static constexpr bool kScaled = true;    // per-block partial sums scaled by a_s·w_s
  static constexpr bool kRounded = false;  // products exact: an FMA is the same as mul + add
  static constexpr bool kBf16Out = true;
  static constexpr float kPrescale = Fp8Dec::kActivationPrescale;
  static int64_t row_bytes(const Matrix& w) { return w.k; }
  static const uint8_t* row(const Matrix& w, int64_t r) { return w.w + r * w.k; }
  // Weight scales of a tile as fp32 lanes: [kb][2][W]. A tile's 2W <= 32 rows start at a multiple of
  // 2W, so they lie in one 32×32 scale tile and every lane gets the same.
  static void tile_scales(const Matrix& w, int64_t row0, int, float* out) {
    const int64_t kb = w.k / kQBlock;
    const uint8_t* s = w.scale + (row0 / kQBlock) * kb;
    const float* e8m0 = e8m0_table();
    for (int64_t b = 0; b < kb; ++b) {
      const V::F v = V::set1(e8m0[s[b]]);
      V::store(out + (2 * b) * V::W, v);
      V::store(out + (2 * b + 1) * V::W, v);
    }
  }
  static void packed_scales(const Matrix& w, int64_t tile, float* out) { tile_scales(w, tile * 2 * V::W, 0, out); }
};

struct Fp4Kind {
  using Dec = Fp4Dec;
  using PDec = Fp4PackedDec;
  using Matrix = Fp4Matrix;
  static constexpr bool kScaled = true;
  static constexpr bool kRounded = false;
  static constexpr bool kBf16Out = true;
  static constexpr float kPrescale = 1.0f;
  static int64_t row_bytes(const Matrix& w) { return w.k / 2; }
  static const uint8_t* row(const Matrix& w, int64_t r) { return w.w + r * (w.k / 2); }
  static void tile_scales(const Matrix& w, int64_t row0, int count, float* out) {
    const int64_t kb = w.k / kQBlock;
    const float* e8m0 = e8m0_table();
    for (int v = 0; v < 2; ++v) {
      for (int l = 0; l < V::W; ++l) {
        const int r = Dec::lane_row(v, l);
        const uint8_t* s = w.scale + (row0 + r) * kb;
        for (int64_t b = 0; b < kb; ++b) out[(2 * b + v) * V::W + l] = r < count ? e8m0[s[b]] : 1.0f;
      }
    }
  }
  // Packed scales are already [kb][2][W] in lane order: a straight conversion.
  static void packed_scales(const Matrix& w, int64_t tile, float* out) {
    const uint8_t* s = w.packed.scales + tile * w.packed.scale_tile_bytes;
    for (int64_t i = 0; i < w.packed.scale_tile_bytes; i += V::W) V::store(out + i, V::e8m0(s + i));
  }
};

// Bf16Kind<false>: linear_bf16; Bf16Kind<true>: linear_f32; Bf16Kind<false, false>: linear_f32 on
// activations that are all bf16 values (exact products, as linear_bf16's, and fp32 out).
template <bool Rounded, bool Bf16Out = !Rounded>
struct Bf16Kind {
  using Dec = Bf16Dec;
  using PDec = Bf16PackedDec;
  using Matrix = Bf16Matrix;
  static constexpr bool kScaled = false;
  // linear_bf16 takes bf16 activations, so its products are exact and an FMA is mul + add; linear_f32
  // takes any fp32, its products round: mul, then add.
  static constexpr bool kRounded = Rounded;
  static constexpr bool kBf16Out = Bf16Out;
  static constexpr float kPrescale = 1.0f;
  static int64_t row_bytes(const Matrix& w) { return w.k * 2; }
  static const uint8_t* row(const Matrix& w, int64_t r) { return reinterpret_cast<const uint8_t*>(w.w + r * w.k); }
  static void tile_scales(const Matrix&, int64_t, int, float*) {}
  static void packed_scales(const Matrix&, int64_t, float*) {}
};

// ---- tiles ----------------------------------------------------------------------------------------

constexpr int kTileRows = 2 * V::W;

// Pointers to the 2W rows of a tile at K block b; rows past the matrix read zeros, and a last partial
// block (bf16 only: K need not be a multiple of 32) reads zero-padded copies.
template <class Kind>
struct Tile {
  const uint8_t* rows[kTileRows];
  int count = 0;  // real rows
  int64_t row_bytes = 0;

  Tile(const typename Kind::Matrix& w, int64_t row0, int64_t n, Scratch& s) : row_bytes(Kind::row_bytes(w)) {
    count = static_cast<int>(std::clamp<int64_t>(n - row0, 0, kTileRows));
    const uint8_t* zeros =
        s.zeroed<uint8_t>(ScratchSlot::LinearZeros, static_cast<size_t>(row_bytes + Kind::Dec::kBlockBytes));
    for (int r = 0; r < kTileRows; ++r) rows[r] = r < count ? Kind::row(w, row0 + r) : zeros;
  }
  // Block pointers for block b: direct, or (partial last block) padded copies in `tail`.
  void block(int64_t b, const uint8_t* out[kTileRows], Scratch& s) const {
    const int64_t off = b * Kind::Dec::kBlockBytes;
    const int64_t want = Kind::Dec::kBlockBytes;
    if (off + want <= row_bytes) {
      for (int r = 0; r < kTileRows; ++r) out[r] = rows[r] + off;
      return;
    }
    uint8_t* t = s.get<uint8_t>(ScratchSlot::LinearTail, static_cast<size_t>(kTileRows * want));
    std::fill(t, t + kTileRows * want, uint8_t{0});
    for (int r = 0; r < kTileRows; ++r) {
      std::copy(rows[r] + off, rows[r] + row_bytes, t + r * want);
      out[r] = t + r * want;
    }
  }
};

inline int64_t k_blocks(int64_t k) { return (k + kQBlock - 1) / kQBlock; }

// ---- m == 1 -------------------------------------------------------------------------------------

// M activation rows against one tile: 2·M chains of partial sums and 2·M accumulators in registers.
template <class Kind, int M>
struct GemvSink {
  using F = V::F;
  const float* a[M];   // activation rows (prescaled for the quantized kinds)
  const float* as[M];  // their per-block scales
  const float* ws;     // the tile's weight scales [kb][2][W]
  int64_t k = 0;
  F acc[M][2], part[M][2];
  int64_t kj = 0;  // first k of the current block
  int64_t jn = kQBlock;

  GemvSink(const float* x, const float* xs, int64_t k_, const float* ws_) : ws(ws_), k(k_) {
    for (int i = 0; i < M; ++i) {
      a[i] = x + i * k;
      as[i] = xs != nullptr ? xs + i * k_blocks(k) : nullptr;
      acc[i][0] = acc[i][1] = V::zero();
    }
  }
  void begin(int64_t b) {
    kj = b * kQBlock;
    for (int i = 0; i < M; ++i) part[i][0] = part[i][1] = V::zero();
    jn = std::min<int64_t>(kQBlock, k - kj);
  }
  void w(int j, F v0, F v1) {
    if constexpr (!Kind::kScaled) {
      if (j >= jn) return;
    }
    for (int i = 0; i < M; ++i) {
      const F av = V::set1(a[i][kj + j]);
      if constexpr (Kind::kScaled) {
        part[i][0] = V::fma(av, v0, part[i][0]);
        part[i][1] = V::fma(av, v1, part[i][1]);
      } else if constexpr (Kind::kRounded) {
        acc[i][0] = V::add(acc[i][0], V::mul(av, v0));
        acc[i][1] = V::add(acc[i][1], V::mul(av, v1));
      } else {
        acc[i][0] = V::fma(av, v0, acc[i][0]);
        acc[i][1] = V::fma(av, v1, acc[i][1]);
      }
    }
  }
  void end(int64_t b) {
    if constexpr (Kind::kScaled) {
      const F s0 = V::load(ws + (2 * b) * V::W), s1 = V::load(ws + (2 * b + 1) * V::W);
      for (int i = 0; i < M; ++i) {
        const F as_b = V::set1(as[i][b]);
        acc[i][0] = V::add(acc[i][0], V::mul(V::mul(part[i][0], as_b), s0));
        acc[i][1] = V::add(acc[i][1], V::mul(V::mul(part[i][1], as_b), s1));
      }
    }
  }
};

template <class Kind>
inline V::F finish(V::F acc) {
  if constexpr (Kind::kBf16Out) {
    return V::round_bf16(acc);
  } else {
    return acc;
  }
}

// Scalar fallback for a tile holding NaN weight codes (FP8 0x7F/0xFF), which the SIMD decoding does
// not represent: the reference computation with the same prescaled activations.
template <class Kind>
void tile_scalar(const QuantizedActivations& a, const typename Kind::Matrix& w, float* y, int64_t row0, int count) {
  if constexpr (std::is_same_v<Kind, Fp8Kind>) {
    static const std::array<float, 256> table = [] {
      std::array<float, 256> t{};
      for (int c = 0; c < 256; ++c) t[c] = e4m3_table()[c] / Kind::kPrescale;  // exact; NaN stays NaN
      return t;
    }();
    const int64_t kb = w.k / kQBlock;
    for (int64_t i = 0; i < a.m; ++i) {
      for (int r = 0; r < count; ++r) {
        const int64_t n = row0 + r;
        y[i * w.n + n] = round_bf16(fp8_dot_scalar(a.row(i), a.row_scales(i), w.w + n * w.k,
                                                   w.scale + (n / kQBlock) * kb, w.k, table.data()));
      }
    }
  } else {
    (void)a, (void)w, (void)y, (void)row0, (void)count;
  }
}

// Rows [r0, r1) of y[0..M, :] = x · Wᵀ for a few activation rows (decode steps, small expert
// batches): the weights stream once and feed every row from registers; r0 is a multiple of 2W.
template <class Kind, int M>
void gemv_rows(const float* x, const float* xs, const QuantizedActivations* qa, const typename Kind::Matrix& w,
               float* y, int64_t r0, int64_t r1, Scratch& s) {
  const int64_t kb = k_blocks(w.k);
  float* ws = s.get<float>(ScratchSlot::LinearScales, static_cast<size_t>(std::max<int64_t>(kb, 1) * kTileRows));
  const uint8_t* blk[kTileRows];
  for (int64_t row0 = r0; row0 < r1; row0 += kTileRows) {
    const Tile<Kind> tile(w, row0, r1, s);
    Kind::tile_scales(w, row0, tile.count, ws);
    GemvSink<Kind, M> sink(x, xs, w.k, ws);
    bool nan = false;
    for (int64_t b = 0; b < kb; ++b) {
      tile.block(b, blk, s);
      Kind::Dec::step(blk, b, sink, nan);
    }
    if (nan) {
      tile_scalar<Kind>(*qa, w, y, row0, tile.count);
      continue;
    }
    for (int i = 0; i < M; ++i) {
      Kind::Dec::store(y + i * w.n + row0, finish<Kind>(sink.acc[i][0]), finish<Kind>(sink.acc[i][1]), tile.count);
    }
  }
}

// ---- m > 1 --------------------------------------------------------------------------------------

struct PackSink {
  float* panel;  // [kKc][32][2][W]
  int64_t c0 = 0;
  float* base = nullptr;
  void begin(int64_t b) { base = panel + (b - c0) * kQBlock * kTileRows; }
  void w(int j, V::F v0, V::F v1) {
    V::store(base + (2 * j) * V::W, v0);
    V::store(base + (2 * j + 1) * V::W, v1);
  }
  void end(int64_t) {}
};

// MI activation rows × one tile (two vectors) over the panel's blocks [c0, c1), accumulators in
// `acc_buf` ([m][2][W]).
template <class Kind, int MI>
void micro(const float* x, const float* xs, int64_t i0, int64_t k, const float* panel, const float* ws,
           int64_t c0, int64_t c1, float* acc_buf) {
  using F = V::F;
  const int64_t kb = k_blocks(k);
  F acc[MI][2];
  for (int ii = 0; ii < MI; ++ii) {
    acc[ii][0] = V::load(acc_buf + (i0 + ii) * 2 * V::W);
    acc[ii][1] = V::load(acc_buf + (i0 + ii) * 2 * V::W + V::W);
  }
  const float* xr[MI];
  for (int ii = 0; ii < MI; ++ii) xr[ii] = x + (i0 + ii) * k;
  for (int64_t b = c0; b < c1; ++b) {
    const float* p0 = panel + (b - c0) * kQBlock * kTileRows;
    const float* p1 = p0 + V::W;
    const int64_t kj = b * kQBlock;
    if constexpr (Kind::kScaled) {
      F part[MI][2];
      for (int ii = 0; ii < MI; ++ii) part[ii][0] = part[ii][1] = V::zero();
      for (int j = 0; j < kQBlock; ++j) {
        const F w0 = V::load(p0 + j * kTileRows), w1 = V::load(p1 + j * kTileRows);
        for (int ii = 0; ii < MI; ++ii) {
          const F av = V::set1(xr[ii][kj + j]);
          part[ii][0] = V::fma(av, w0, part[ii][0]);
          part[ii][1] = V::fma(av, w1, part[ii][1]);
        }
      }
      const F s0 = V::load(ws + (2 * b) * V::W), s1 = V::load(ws + (2 * b + 1) * V::W);
      for (int ii = 0; ii < MI; ++ii) {
        const F as = V::set1(xs[(i0 + ii) * kb + b]);
        acc[ii][0] = V::add(acc[ii][0], V::mul(V::mul(part[ii][0], as), s0));
        acc[ii][1] = V::add(acc[ii][1], V::mul(V::mul(part[ii][1], as), s1));
      }
    } else {
      const int64_t jn = std::min<int64_t>(kQBlock, k - kj);
      for (int64_t j = 0; j < jn; ++j) {
        const F w0 = V::load(p0 + j * kTileRows), w1 = V::load(p1 + j * kTileRows);
        for (int ii = 0; ii < MI; ++ii) {
          const F av = V::set1(xr[ii][kj + j]);
          if constexpr (Kind::kRounded) {
            acc[ii][0] = V::add(acc[ii][0], V::mul(av, w0));
            acc[ii][1] = V::add(acc[ii][1], V::mul(av, w1));
          } else {
            acc[ii][0] = V::fma(av, w0, acc[ii][0]);
            acc[ii][1] = V::fma(av, w1, acc[ii][1]);
          }
        }
      }
    }
  }
  for (int ii = 0; ii < MI; ++ii) {
    V::store(acc_buf + (i0 + ii) * 2 * V::W, acc[ii][0]);
    V::store(acc_buf + (i0 + ii) * 2 * V::W + V::W, acc[ii][1]);
  }
}

template <class Kind, int MI>
void micro_rows(const float* x, const float* xs, int64_t m, int64_t k, const float* panel, const float* ws,
                int64_t c0, int64_t c1, float* acc_buf) {
  int64_t i0 = 0;
  for (; i0 + MI <= m; i0 += MI) micro<Kind, MI>(x, xs, i0, k, panel, ws, c0, c1, acc_buf);
  if constexpr (MI > 1) {
    if (i0 < m) {
      const float* xs_rest = xs != nullptr ? xs + i0 * k_blocks(k) : nullptr;
      micro_rows<Kind, MI - 1>(x + i0 * k, xs_rest, m - i0, k, panel, ws, c0, c1, acc_buf + i0 * 2 * V::W);
    }
  }
}

// Rows [r0, r1) of y[m, n]; r0 is a multiple of 2W.
template <class Kind>
void gemm_rows(const float* x, const float* xs, const QuantizedActivations* qa, int64_t m,
               const typename Kind::Matrix& w, float* y, int64_t r0, int64_t r1, Scratch& s) {
  const int64_t kb = k_blocks(w.k);
  float* ws = s.get<float>(ScratchSlot::LinearScales, static_cast<size_t>(std::max<int64_t>(kb, 1) * kTileRows));
  float* panel = s.get<float>(ScratchSlot::LinearPanel, static_cast<size_t>(kKc * kQBlock * kTileRows));
  float* acc = s.get<float>(ScratchSlot::LinearAcc, static_cast<size_t>(m * kTileRows));
  const uint8_t* blk[kTileRows];
  for (int64_t row0 = r0; row0 < r1; row0 += kTileRows) {
    const Tile<Kind> tile(w, row0, r1, s);
    Kind::tile_scales(w, row0, tile.count, ws);
    std::fill(acc, acc + m * kTileRows, 0.0f);
    bool nan = false;
    for (int64_t c0 = 0; c0 < kb; c0 += kKc) {
      const int64_t c1 = std::min(kb, c0 + kKc);
      PackSink sink{panel, c0};
      for (int64_t b = c0; b < c1; ++b) {
        tile.block(b, blk, s);
        Kind::Dec::step(blk, b, sink, nan);
      }
      micro_rows<Kind, V::MI>(x, xs, m, w.k, panel, ws, c0, c1, acc);
    }
    if (nan) {
      tile_scalar<Kind>(*qa, w, y, row0, tile.count);
      continue;
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* a = acc + i * kTileRows;
      Kind::Dec::store(y + i * w.n + row0, finish<Kind>(V::load(a)), finish<Kind>(V::load(a + V::W)), tile.count);
    }
  }
}

// ---- packed weights (packed_weights.h) ------------------------------------------------------------
// The same two paths over tiles packed at load time: block b of tile t starts at
// tiles + t·tile_bytes + b·kBlockBytes·2W and Kind::PDec decodes it without a transpose. FP8 tiles
// holding a NaN code were flagged when packing and take the scalar path.

template <class Kind>
inline const uint8_t* packed_block(const typename Kind::Matrix& w, int64_t tile, int64_t b) {
  return w.packed.tiles + tile * w.packed.tile_bytes + b * Kind::PDec::kBlockBytes * kTileRows;
}

template <class Kind>
inline bool packed_nan(const typename Kind::Matrix& w, int64_t tile) {
  return w.packed.nan_tiles != nullptr && w.packed.nan_tiles[tile] != 0;
}

// One core's stream of weights is bound by how many cache misses it keeps in flight, not by the
// memory: the hardware prefetcher alone reached ~4.7 GB/s per core on the development machine. Asking
// for the lines kPrefetchBytes ahead (in the same tile, or the next tile's first lines when the
// current one ends: tiles lie one after another) keeps more of them in flight.
constexpr int64_t kPrefetchBytes = 4096;

template <class Kind>
inline void prefetch_ahead(const typename Kind::Matrix& w, int64_t tile, int64_t b) {
  constexpr int64_t kBlock = Kind::PDec::kBlockBytes * kTileRows;
  const uint8_t* p = packed_block<Kind>(w, tile, b) + kPrefetchBytes;
  for (int64_t off = 0; off < kBlock; off += 64) __builtin_prefetch(p + off, 0, 3);
}

template <class Kind, int M>
void gemv_packed(const float* x, const float* xs, const QuantizedActivations* qa, const typename Kind::Matrix& w,
                 float* y, int64_t r0, int64_t r1, Scratch& s) {
  const int64_t kb = k_blocks(w.k);
  float* ws = s.get<float>(ScratchSlot::LinearScales, static_cast<size_t>(std::max<int64_t>(kb, 1) * kTileRows));
  for (int64_t row0 = r0; row0 < r1; row0 += kTileRows) {
    const int64_t tile = row0 / kTileRows;
    const int count = static_cast<int>(std::min<int64_t>(kTileRows, r1 - row0));
    if (packed_nan<Kind>(w, tile)) {
      tile_scalar<Kind>(*qa, w, y, row0, count);
      continue;
    }
    Kind::packed_scales(w, tile, ws);
    GemvSink<Kind, M> sink(x, xs, w.k, ws);
    for (int64_t b = 0; b < kb; ++b) {
      prefetch_ahead<Kind>(w, tile, b);
      Kind::PDec::step(packed_block<Kind>(w, tile, b), b, sink);
    }
    for (int i = 0; i < M; ++i) {
      Kind::PDec::store(y + i * w.n + row0, finish<Kind>(sink.acc[i][0]), finish<Kind>(sink.acc[i][1]), count);
    }
  }
}

template <class Kind>
void gemm_packed(const float* x, const float* xs, const QuantizedActivations* qa, int64_t m,
                 const typename Kind::Matrix& w, float* y, int64_t r0, int64_t r1, Scratch& s) {
  const int64_t kb = k_blocks(w.k);
  float* ws = s.get<float>(ScratchSlot::LinearScales, static_cast<size_t>(std::max<int64_t>(kb, 1) * kTileRows));
  float* panel = s.get<float>(ScratchSlot::LinearPanel, static_cast<size_t>(kKc * kQBlock * kTileRows));
  float* acc = s.get<float>(ScratchSlot::LinearAcc, static_cast<size_t>(m * kTileRows));
  for (int64_t row0 = r0; row0 < r1; row0 += kTileRows) {
    const int64_t tile = row0 / kTileRows;
    const int count = static_cast<int>(std::min<int64_t>(kTileRows, r1 - row0));
    if (packed_nan<Kind>(w, tile)) {
      tile_scalar<Kind>(*qa, w, y, row0, count);
      continue;
    }
    Kind::packed_scales(w, tile, ws);
    std::fill(acc, acc + m * kTileRows, 0.0f);
    for (int64_t c0 = 0; c0 < kb; c0 += kKc) {
      const int64_t c1 = std::min(kb, c0 + kKc);
      PackSink sink{panel, c0};
      for (int64_t b = c0; b < c1; ++b) Kind::PDec::step(packed_block<Kind>(w, tile, b), b, sink);
      micro_rows<Kind, V::MI>(x, xs, m, w.k, panel, ws, c0, c1, acc);
    }
    for (int64_t i = 0; i < m; ++i) {
      const float* a = acc + i * kTileRows;
      Kind::PDec::store(y + i * w.n + row0, finish<Kind>(V::load(a)), finish<Kind>(V::load(a + V::W)), count);
    }
  }
}

// ---- entry points ---------------------------------------------------------------------------------

// act_quant of every row (quantize_row, defined by the ISA file), rows split over exec's workers when
// `parallel`.
inline QuantizedActivations quantize_rows(const Exec* ex, const float* x, int64_t m, int64_t k, float prescale,
                                          bool parallel) {
  QuantizedActivations q;
  q.m = m;
  q.k = k;
  q.values.resize(static_cast<size_t>(m * k));
  q.scales.resize(static_cast<size_t>(m * (k / kQBlock)));
  const auto rows = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      quantize_row(x + i * k, k, prescale, q.values.data() + i * k, q.scales.data() + i * (k / kQBlock));
    }
  };
  if (ex != nullptr && parallel && m > 1) {
    ex->parallel_for(m, 1, [&](int64_t i0, int64_t i1, Scratch&) { rows(i0, i1); });
  } else {
    rows(0, m);
  }
  return q;
}

// Whether every value is a bf16 value (its low 16 bits zero): then a product with a bf16 weight is
// exact in fp32, and an FMA gives the bits of a multiply and an add.
inline bool all_bf16_values(const float* x, int64_t count) {
  uint32_t low = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    low |= bits & 0xFFFFu;
  }
  return low == 0;
}

// Work below this many weight elements runs on the calling thread: a wake-up would cost more.
constexpr int64_t kParallelMin = int64_t{1} << 16;

template <class Kind>
void run_linear(const Exec& ex, const float* x, int64_t m, const typename Kind::Matrix& w, float* y) {
  if (m <= 0 || w.n <= 0) return;
  assert((!Kind::kScaled || w.k % kQBlock == 0) && "act_quant needs K in whole blocks of 32");
  const bool parallel = w.n * w.k >= kParallelMin;
  QuantizedActivations qa;
  const float* xv = x;
  const float* xs = nullptr;
  if constexpr (Kind::kScaled) {
    qa = quantize_rows(&ex, x, m, w.k, Kind::kPrescale, parallel);
    xv = qa.values.data();
    xs = qa.scales.data();
  }
  const QuantizedActivations* qp = &qa;
  const auto split = [&](auto body) { ex.run(parallel, w.n, kTileRows, body); };
  // the weights packed at load time for this level's tiles, or the checkpoint's row-major layout
  const bool packed = w.packed.tile_rows == kTileRows;
  const auto gemv = [&](auto rows) {
    constexpr int M = decltype(rows)::value;
    split([&](int64_t r0, int64_t r1, Scratch& s) {
      packed ? gemv_packed<Kind, M>(xv, xs, qp, w, y, r0, r1, s) : gemv_rows<Kind, M>(xv, xs, qp, w, y, r0, r1, s);
    });
  };
  switch (m <= V::kGemvRows ? m : 0) {
    case 1:
      return gemv(std::integral_constant<int, 1>{});
    case 2:
      return gemv(std::integral_constant<int, 2>{});
    case 3:
      return gemv(std::integral_constant<int, 3>{});
    case 4:
      return gemv(std::integral_constant<int, 4>{});
    default:
      return split([&](int64_t r0, int64_t r1, Scratch& s) {
        packed ? gemm_packed<Kind>(xv, xs, qp, m, w, y, r0, r1, s) : gemm_rows<Kind>(xv, xs, qp, m, w, y, r0, r1, s);
      });
  }
}
