// The op harness: every op of the backend (kernels/backend.h) × every backend this machine runs
// (tests/ops_util.h: each kernel level at 1 and 3 threads) × the shapes of the tiny preset and of the
// released model, on fresh random inputs, against the op's scalar reference (kernels/reference.h),
// each within its declared tolerance — zero for every op today: they promise the reference's bits
// (a NaN's payload aside). A new backend is listed in backend_levels() and is tested here.
//
// Released shapes keep their widths (K, heads, dims); matrices keep at most kRows output rows, which
// covers partial tiles, scale tiles and the thread split without reading gigabytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "io/config.h"
#include "kernels/backend.h"
#include "kernels/kv_rows.h"
#include "kernels/reference.h"
#include "model/moe.h"
#include "model/synthetic_checkpoint.h"
#include "numeric/formats.h"
#include "numeric/quant.h"
#include "numeric/row_codecs.h"
#include "ops_util.h"
#include "test_util.h"

namespace {

using namespace dsv41;
using namespace dsv41::test;

constexpr int64_t kRows = 200;  // output rows kept of a released matrix

struct Geometry {
  std::string name;
  ModelConfig c;
};
const std::vector<Geometry>& geometries() {
  static const std::vector<Geometry> g = {{"tiny", synthetic_config("tiny")},
                                          {"released", load_config(released_config())}};
  return g;
}

// One op on one input: what it computes on a backend, or (null) by the scalar reference.
struct OpCase {
  std::string what;
  std::function<std::vector<float>(const Backend*)> run;
  // Set for an op whose contract at some level is a bound rather than bits: "" when `got` keeps it.
  std::function<std::string(const Backend&, const std::vector<float>& got, const std::vector<float>& want)> agree = {};
};

// Every case on every backend against the reference: bit-identical when tolerance is 0 (NaNs equal
// whatever their payload), else within `tolerance` absolute.
void expect_agreement(const std::vector<OpCase>& cases, float tolerance = 0.0f) {
  ASSERT_FALSE(cases.empty());
  for (const OpCase& op : cases) {
    const std::vector<float> want = op.run(nullptr);
    for (const auto& be : op_backends()) {
      const std::vector<float> got = op.run(be.get());
      if (op.agree) {
        EXPECT_EQ(op.agree(*be, got, want), "") << op.what << " on " << label(*be);
        continue;
      }
      if (tolerance == 0.0f) {
        EXPECT_EQ(first_difference(got, want, true), "") << op.what << " on " << label(*be);
        continue;
      }
      ASSERT_EQ(got.size(), want.size()) << op.what;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_LE(std::fabs(got[i] - want[i]), tolerance) << op.what << " on " << label(*be) << " at " << i;
      }
    }
  }
}

std::string named(const Geometry& g, const std::string& what) { return g.name + " " + what; }

template <class T>
std::vector<float> as_floats(const std::vector<T>& v) {
  return std::vector<float>(v.begin(), v.end());
}

// ---- linear layers --------------------------------------------------------------------------------

struct MatrixShape {
  std::string name;
  int64_t n, k;
};

// The model's matrices of each kind in geometry c (n clipped to kRows).
std::vector<MatrixShape> fp8_matrices(const ModelConfig& c) {
  const int64_t hd = c.n_heads * c.head_dim;
  return {{"wq_a", c.q_lora_rank, c.dim},
          {"wq_b", hd, c.q_lora_rank},
          {"wkv", c.head_dim, c.dim},
          {"wo_b", c.dim, c.o_groups * c.o_lora_rank},
          {"shared w1", c.moe_inter_dim, c.dim},
          {"shared w2", c.dim, c.moe_inter_dim},
          {"indexer wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank},
          {"engram wkv", (c.hc_mult + 1) * c.dim, c.engram_hash_columns() * c.engram_head_dim}};
}
std::vector<MatrixShape> fp4_matrices(const ModelConfig& c) {
  return {{"expert w1", c.moe_inter_dim, c.dim}, {"expert w2", c.dim, c.moe_inter_dim}};
}
std::vector<MatrixShape> bf16_matrices(const ModelConfig& c) {  // linear_bf16 (bf16 in, bf16 out)
  return {{"wo_a group", c.o_lora_rank, c.n_heads * c.head_dim / c.o_groups},
          {"compressor wkv (ratio 1)", c.head_dim, c.dim},
          {"indexer wk", c.index_head_dim, c.head_dim},
          {"indexer weights_proj", c.index_n_heads, c.dim}};
}
std::vector<MatrixShape> f32_matrices(const ModelConfig& c) {  // linear_f32 (fp32 in and out)
  return {{"router", c.n_routed_experts, c.dim},
          {"head", c.vocab_size, c.dim},
          {"compressor wkv/wgate (ratio > 1)", c.head_dim, c.dim},
          {"markov head", c.vocab_size, c.dspark_markov_rank},
          {"confidence", 1, c.dim + c.dspark_markov_rank}};
}

const int64_t kLinearRows[] = {1, 4, 11};  // a decode step, a small expert batch, a prefill chunk

TEST(Ops, LinearFp8) {
  std::mt19937 rng(101);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    for (const MatrixShape& s : fp8_matrices(g.c)) {
      for (const int64_t m : kLinearRows) {
        const int64_t n = std::min(s.n, kRows), k = s.k;
        auto x = std::make_shared<std::vector<float>>(random_activations(rng, m, k));
        auto w = std::make_shared<std::vector<uint8_t>>(random_e4m3(rng, static_cast<size_t>(n * k)));
        auto sc =
            std::make_shared<std::vector<uint8_t>>(random_scales(rng, static_cast<size_t>(((n + 31) / 32) * (k / 32))));
        cases.push_back({named(g, s.name + " m=" + std::to_string(m)), [=](const Backend* be) {
                           const Fp8Matrix mat{w->data(), sc->data(), n, k};
                           std::vector<float> y(static_cast<size_t>(m * n));
                           if (!be) {
                             reference::linear_fp8(x->data(), m, mat, y.data());
                           } else {
                             std::unique_ptr<PackedWeights> keep;
                             be->linear_fp8(x->data(), m, packed_for(*be, mat, keep), y.data());
                           }
                           return y;
                         },
                         [=](const Backend& be, const std::vector<float>& got, const std::vector<float>& want) {
                           const Fp8Matrix mat{w->data(), sc->data(), n, k};
                           return linear_disagreement(be, got, want, x->data(), m, mat);
                         }});
      }
    }
  }
  expect_agreement(cases);
}

TEST(Ops, LinearFp4) {
  std::mt19937 rng(102);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    for (const MatrixShape& s : fp4_matrices(g.c)) {
      for (const int64_t m : kLinearRows) {
        const int64_t n = std::min(s.n, kRows), k = s.k;
        auto x = std::make_shared<std::vector<float>>(random_activations(rng, m, k));
        auto w = std::make_shared<std::vector<uint8_t>>(random_bytes(rng, static_cast<size_t>(n * k / 2)));
        auto sc = std::make_shared<std::vector<uint8_t>>(random_scales(rng, static_cast<size_t>(n * (k / 32))));
        cases.push_back({named(g, s.name + " m=" + std::to_string(m)), [=](const Backend* be) {
                           const Fp4Matrix mat{w->data(), sc->data(), n, k};
                           std::vector<float> y(static_cast<size_t>(m * n));
                           if (!be) {
                             reference::linear_fp4(x->data(), m, mat, y.data());
                           } else {
                             std::unique_ptr<PackedWeights> keep;
                             be->linear_fp4(x->data(), m, packed_for(*be, mat, keep), y.data());
                           }
                           return y;
                         },
                         [=](const Backend& be, const std::vector<float>& got, const std::vector<float>& want) {
                           const Fp4Matrix mat{w->data(), sc->data(), n, k};
                           return linear_disagreement(be, got, want, x->data(), m, mat);
                         }});
      }
    }
  }
  expect_agreement(cases);
}

// linear_bf16 takes bf16 activations; linear_f32 any fp32 (its products round).
void bf16_weight_cases(std::vector<OpCase>& cases, std::mt19937& rng, bool f32) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (const Geometry& g : geometries()) {
    for (const MatrixShape& s : f32 ? f32_matrices(g.c) : bf16_matrices(g.c)) {
      for (const int64_t m : kLinearRows) {
        const int64_t n = std::min(s.n, kRows), k = s.k;
        auto x = std::make_shared<std::vector<float>>(random_activations(rng, m, k));
        if (f32) {
          for (auto& v : *x) v = dist(rng);
        }
        auto w = std::make_shared<std::vector<uint16_t>>(random_bf16_bits(rng, static_cast<size_t>(n * k)));
        cases.push_back({named(g, s.name + " m=" + std::to_string(m)), [=](const Backend* be) {
                           const Bf16Matrix mat{w->data(), n, k};
                           std::vector<float> y(static_cast<size_t>(m * n));
                           if (!be) {
                             f32 ? reference::linear_f32(x->data(), m, mat, y.data())
                                 : reference::linear_bf16(x->data(), m, mat, y.data());
                           } else {
                             std::unique_ptr<PackedWeights> keep;
                             const Bf16Matrix p = packed_for(*be, mat, keep);
                             f32 ? be->linear_f32(x->data(), m, p, y.data())
                                 : be->linear_bf16(x->data(), m, p, y.data());
                           }
                           return y;
                         },
                         [=](const Backend& be, const std::vector<float>& got, const std::vector<float>& want) {
                           // linear_f32 keeps its bits at every level; linear_bf16 has amx_bf16's bound
                           if (f32) return first_difference(got, want, true);
                           return linear_disagreement(be, got, want, x->data(), m, Bf16Matrix{w->data(), n, k});
                         }});
      }
    }
  }
}

TEST(Ops, LinearBf16) {
  std::mt19937 rng(103);
  std::vector<OpCase> cases;
  bf16_weight_cases(cases, rng, false);
  expect_agreement(cases);
}

TEST(Ops, LinearF32) {
  std::mt19937 rng(104);
  std::vector<OpCase> cases;
  bf16_weight_cases(cases, rng, true);
  expect_agreement(cases);
}

// ---- norms, rotary, packed rows ---------------------------------------------------------------------

TEST(Ops, RmsNorm) {
  std::mt19937 rng(105);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    const ModelConfig& c = g.c;
    for (const int64_t n : {c.dim, c.q_lora_rank, c.head_dim, c.index_head_dim}) {
      for (const bool round : {true, false}) {
        const int64_t rows = 6;
        auto x = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(rows * n), 3.0f));
        auto w = std::make_shared<std::vector<uint16_t>>(random_bf16_bits(rng, static_cast<size_t>(n), 1.0f));
        const float eps = static_cast<float>(c.norm_eps);
        cases.push_back({named(g, "n=" + std::to_string(n) + (round ? " bf16" : " fp32")), [=](const Backend* be) {
                           std::vector<float> y(x->size());
                           be ? be->rms_norm(x->data(), rows, n, w->data(), eps, y.data(), round)
                              : reference::rms_norm(x->data(), rows, n, w->data(), eps, y.data(), round);
                           return y;
                         }});
      }
    }
  }
  expect_agreement(cases);
}

TEST(Ops, Rope) {
  std::mt19937 rng(106);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    const ModelConfig& c = g.c;
    auto window =
        std::make_shared<RopeTable>(c.rope_head_dim, 0, c.rope_theta, c.rope_factor, c.beta_fast, c.beta_slow);
    auto compressed = std::make_shared<RopeTable>(c.rope_head_dim, c.original_seq_len, c.compress_rope_theta,
                                                  c.rope_factor, c.beta_fast, c.beta_slow);
    for (const auto& table : {window, compressed}) {
      for (const int64_t first : {int64_t{0}, int64_t{37}, c.max_seq_len - 4}) {
        for (const bool inverse : {false, true}) {
          // three tokens' heads: rope lanes at the end of each head
          const int64_t rows = 3 * c.n_heads, width = c.head_dim;
          auto x = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(rows * width)));
          const std::string what = (table == window ? "window" : "compressed") + std::string(" from ") +
                                   std::to_string(first) + (inverse ? " inverse" : "");
          cases.push_back({named(g, what), [=](const Backend* be) {
                             std::vector<float> y = *x;
                             const RotaryRows r{y.data() + width - c.rope_head_dim, rows, width, c.n_heads, first, 1};
                             be ? be->rope(*table, r, inverse) : reference::rope(*table, r, inverse);
                             return y;
                           }});
        }
      }
    }
  }
  expect_agreement(cases);
}

TEST(Ops, PackKvRows) {
  std::mt19937 rng(107);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    for (const auto& [format, dim, name] :
         {std::tuple{KvFormat::Window, g.c.head_dim, "window"}, std::tuple{KvFormat::MainKv, g.c.head_dim, "main kv"},
          std::tuple{KvFormat::IndexKey, g.c.index_head_dim, "index keys"}}) {
      const int64_t rows = 5;
      auto x = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(rows * dim), 2.0f));
      std::fill_n(x->begin() + dim, dim, 0.0f);  // an all-zero row: the scale floors
      const int64_t bytes = format == KvFormat::Window   ? window_row_bytes(dim)
                            : format == KvFormat::MainKv ? main_kv_bytes(dim)
                                                         : index_key_bytes(dim);
      cases.push_back({named(g, name), [=, f = format, d = dim](const Backend* be) {
                         std::vector<uint8_t> out(static_cast<size_t>(rows * bytes), 0xAA);
                         std::vector<uint8_t*> rows_out;
                         for (int64_t r = 0; r < rows; ++r) rows_out.push_back(&out[r * bytes]);
                         be ? be->pack_kv_rows(f, x->data(), rows, d, rows_out.data())
                            : reference::pack_kv_rows(f, x->data(), rows, d, rows_out.data());
                         return as_floats(out);
                       }});
    }
  }
  expect_agreement(cases);
}

// The table decoder the attention kernels read rows with gives the codecs' values on every code.
TEST(Ops, FastRowDecodeEqualsTheCodecs) {
  for (const auto& [format, dim] :
       {std::pair{KvFormat::Window, int64_t{512}}, std::pair{KvFormat::MainKv, int64_t{512}},
        std::pair{KvFormat::IndexKey, int64_t{128}}}) {
    const int64_t bytes = format == KvFormat::Window   ? window_row_bytes(dim)
                          : format == KvFormat::MainKv ? main_kv_bytes(dim)
                                                       : index_key_bytes(dim);
    for (int shift = 0; shift < 256; shift += 37) {
      std::vector<uint8_t> row(static_cast<size_t>(bytes));
      for (int64_t i = 0; i < bytes; ++i) row[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 7 + shift);
      std::vector<float> want(static_cast<size_t>(dim)), got(want.size());
      decode_kv_row(format, row.data(), dim, want.data());
      decode_kv_row_fast(format, row.data(), dim, got.data());
      EXPECT_EQ(first_difference(got, want, true), "") << static_cast<int>(format) << " shift " << shift;
    }
  }
}

// ---- compressed attention ---------------------------------------------------------------------------

TEST(Ops, CompressorPool) {
  std::mt19937 rng(108);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    std::set<int> ratios(g.c.compress_ratios.begin(), g.c.compress_ratios.end());
    for (const int ratio : ratios) {
      if (ratio < 2) continue;  // ratio 1 does not pool
      const int64_t D = g.c.head_dim;
      auto kv = std::make_shared<std::vector<float>>(static_cast<size_t>(ratio * D));
      auto score = std::make_shared<std::vector<float>>(kv->size());
      for (auto& v : *kv) v = dist(rng);
      for (auto& v : *score) v = dist(rng);
      (*score)[0] = -std::numeric_limits<float>::infinity();  // an empty slot of a group still filling
      cases.push_back({named(g, "ratio " + std::to_string(ratio)), [=](const Backend* be) {
                         std::vector<float> out(static_cast<size_t>(D));
                         be ? be->compressor_pool(kv->data(), score->data(), ratio, D, out.data())
                            : reference::compressor_pool(kv->data(), score->data(), ratio, D, out.data());
                         return out;
                       }});
    }
  }
  expect_agreement(cases);
}

TEST(Ops, QuantizeIndexQueries) {
  std::mt19937 rng(109);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    const int64_t count = 3, nh = g.c.index_n_heads, K = g.c.index_head_dim;
    auto q = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(count * nh * K)));
    auto w = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(count * nh)));
    const float head_scale =
        static_cast<float>(1.0 / std::sqrt(static_cast<double>(K)) / std::sqrt(static_cast<double>(nh)));
    cases.push_back({named(g, "queries"), [=](const Backend* be) {
                       std::vector<float> qq = *q, ww = *w;
                       be ? be->quantize_index_queries(qq.data(), ww.data(), count, nh, K, head_scale)
                          : reference::quantize_index_queries(qq.data(), ww.data(), count, nh, K, head_scale);
                       qq.insert(qq.end(), ww.begin(), ww.end());
                       return qq;
                     }});
  }
  expect_agreement(cases);
}

// Packed index keys, scattered in memory as paged rows are.
struct Keys {
  std::vector<std::vector<uint8_t>> rows;
  std::vector<const uint8_t*> ptr;
};
std::shared_ptr<Keys> random_index_keys(std::mt19937& rng, int64_t n, int64_t K) {
  auto k = std::make_shared<Keys>();
  std::uniform_int_distribution<int> scale(115, 132);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<uint8_t> row = random_bytes(rng, static_cast<size_t>(index_key_bytes(K)));
    for (int64_t b = 0; b < K / 32; ++b) row[static_cast<size_t>(K / 2 + b)] = static_cast<uint8_t>(scale(rng));
    k->rows.push_back(std::move(row));
  }
  for (const auto& r : k->rows) k->ptr.push_back(r.data());
  return k;
}

// Queries as the indexer makes them (FP4 QDQ'd) and bf16 head weights; query i sees visible[i] keys.
struct Queries {
  std::vector<float> q, w;
  std::vector<int64_t> visible;
};
std::shared_ptr<Queries> random_index_queries(std::mt19937& rng, int64_t nq, int64_t nh, int64_t K, int64_t n_keys) {
  auto q = std::make_shared<Queries>();
  q->q = random_bf16_values(rng, static_cast<size_t>(nq * nh * K));
  fp4_qdq_e8m0(q->q.data(), q->q.size());
  q->w = random_bf16_values(rng, static_cast<size_t>(nq * nh), 0.3f);
  std::uniform_int_distribution<int64_t> seen(1, n_keys);
  for (int64_t i = 0; i < nq; ++i) q->visible.push_back(i == nq - 1 ? n_keys : seen(rng));
  return q;
}

TEST(Ops, IndexScores) {
  std::mt19937 rng(110);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    const int64_t nh = g.c.index_n_heads, K = g.c.index_head_dim;
    for (const auto& [nq, n_keys] : {std::pair<int64_t, int64_t>{1, 7}, {1, 1000}, {9, 300}}) {
      auto keys = random_index_keys(rng, n_keys, K);
      auto q = random_index_queries(rng, nq, nh, K, n_keys);
      cases.push_back({named(g, std::to_string(nq) + " queries × " + std::to_string(n_keys) + " keys"),
                       [=, nq = nq, n_keys = n_keys](const Backend* be) {
                         std::vector<float> s(static_cast<size_t>(nq * n_keys));
                         be ? be->index_scores(q->q.data(), q->w.data(), nq, nh, K, keys->ptr.data(), n_keys,
                                               q->visible.data(), s.data())
                            : reference::index_scores(q->q.data(), q->w.data(), nq, nh, K, keys->ptr.data(), n_keys,
                                                      q->visible.data(), s.data());
                         return s;
                       }});
    }
  }
  expect_agreement(cases);
}

TEST(Ops, IndexScoresInPool) {
  std::mt19937 rng(111);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    const int64_t nh = g.c.index_n_heads, K = g.c.index_head_dim, bs = g.c.candidate_block_size;
    for (const auto& [nq, n_keys] : {std::pair<int64_t, int64_t>{1, 3 * bs + 1}, {1, 2000}, {5, 700}}) {
      auto keys = random_index_keys(rng, n_keys, K);
      auto q = random_index_queries(rng, nq, nh, K, n_keys);
      auto pools = std::make_shared<std::vector<std::vector<int32_t>>>(static_cast<size_t>(nq));
      const int64_t blocks = (n_keys + bs - 1) / bs;
      for (auto& pool : *pools) {  // the candidate source's pool: up to topk_blocks blocks, ascending
        std::vector<int32_t> all(static_cast<size_t>(blocks));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        pool.assign(all.begin(), all.begin() + std::min<int64_t>(blocks, g.c.candidate_topk_blocks));
        std::sort(pool.begin(), pool.end());
      }
      cases.push_back({named(g, std::to_string(nq) + " queries × " + std::to_string(n_keys) + " keys"),
                       [=, nq = nq, n_keys = n_keys](const Backend* be) {
                         std::vector<float> s(static_cast<size_t>(nq * n_keys));
                         be ? be->index_scores_in_pool(q->q.data(), q->w.data(), nq, nh, K, keys->ptr.data(), n_keys,
                                                       q->visible.data(), pools->data(), bs, s.data())
                            : reference::index_scores_in_pool(q->q.data(), q->w.data(), nq, nh, K, keys->ptr.data(),
                                                              n_keys, q->visible.data(), pools->data(), bs, s.data());
                         return s;
                       }});
    }
  }
  expect_agreement(cases);
}

TEST(Ops, TopkAndCandidateBlocks) {
  std::mt19937 rng(112);
  std::uniform_int_distribution<int> level(-20, 20);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    for (const int64_t n : {int64_t{5}, int64_t{300}, int64_t{4000}}) {
      auto s = std::make_shared<std::vector<float>>(static_cast<size_t>(n));
      for (auto& v : *s) v = static_cast<float>(level(rng)) / 4.0f;  // many ties
      (*s)[0] = -std::numeric_limits<float>::infinity();
      const int64_t k = std::min<int64_t>(g.c.index_topk, n), visible = n - 1;
      const int64_t blocks = g.c.candidate_topk_blocks, bs = g.c.candidate_block_size;
      cases.push_back({named(g, "top-k of " + std::to_string(n)), [=](const Backend* be) {
                         return as_floats(be ? be->topk_ascending(s->data(), n, k, TopkTies::LowerIndexFirst)
                                             : reference::topk_ascending(s->data(), n, k));
                       }});
      cases.push_back({named(g, "candidate blocks of " + std::to_string(n)), [=](const Backend* be) {
                         return as_floats(be ? be->select_candidate_blocks(s->data(), n, visible, blocks, bs, TopkTies::LowerIndexFirst)
                                             : reference::select_candidate_blocks(s->data(), n, visible, blocks, bs));
                       }});
      // the later half not visible yet (-inf): fewer reachable blocks than asked for
      auto half = std::make_shared<std::vector<float>>(*s);
      std::fill(half->begin() + n / 2, half->end(), -std::numeric_limits<float>::infinity());
      cases.push_back({named(g, "candidate blocks of " + std::to_string(n) + ", half visible"), [=](const Backend* be) {
                         return as_floats(be ? be->select_candidate_blocks(half->data(), n, n / 2, blocks, bs, TopkTies::LowerIndexFirst)
                                             : reference::select_candidate_blocks(half->data(), n, n / 2, blocks, bs));
                       }});
    }
  }
  expect_agreement(cases);
}

TEST(Ops, SparseAttention) {
  std::mt19937 rng(113);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    const int64_t H = g.c.n_heads, D = g.c.head_dim, W = g.c.window_size;
    for (const int64_t selected : {int64_t{0}, std::min<int64_t>(g.c.index_topk, 512)}) {
      // window rows quantized from bf16 values, compressed rows too, a few empty slots
      auto store = std::make_shared<std::vector<std::vector<uint8_t>>>();
      auto window = std::make_shared<std::vector<const uint8_t*>>();
      auto compressed = std::make_shared<std::vector<const uint8_t*>>();
      for (int64_t j = 0; j < W + selected; ++j) {
        const bool w = j < W;
        const std::vector<float> v = random_bf16_values(rng, static_cast<size_t>(D));
        store->emplace_back(static_cast<size_t>(w ? window_row_bytes(D) : main_kv_bytes(D)));
        w ? pack_window_row(v.data(), D, store->back().data()) : pack_main_kv_row(v.data(), D, store->back().data());
      }
      for (int64_t j = 0; j < W + selected; ++j) {
        const uint8_t* row = unit(rng) < 0.1f ? nullptr : (*store)[static_cast<size_t>(j)].data();
        (j < W ? *window : *compressed).push_back(row);
      }
      auto q = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(H * D), 0.3f));
      auto sink = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(H)));
      const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
      cases.push_back({named(g, std::to_string(W) + " window + " + std::to_string(selected) + " selected rows"),
                       [store, window, compressed, q, sink, H, D, scale](const Backend* be) {  // store: the rows
                         const KvRows rows{window->data(), static_cast<int64_t>(window->size()), compressed->data(),
                                           static_cast<int64_t>(compressed->size())};
                         std::vector<float> out(q->size());
                         be ? be->sparse_attention(q->data(), H, D, rows, sink->data(), scale, out.data())
                            : reference::sparse_attention(q->data(), H, D, rows, sink->data(), scale, out.data());
                         return out;
                       }});
    }
  }
  expect_agreement(cases);
}

// ---- mHC ----------------------------------------------------------------------------------------------

struct HcInputs {
  HcShape s;
  int64_t count = 0;
  std::vector<float> X, y, fn, scale, base, pre, post, comb;
};
std::shared_ptr<HcInputs> random_hc(std::mt19937& rng, const ModelConfig& c, int64_t count) {
  auto in = std::make_shared<HcInputs>();
  in->s = {c.hc_mult, c.dim, static_cast<float>(c.norm_eps), c.hc_sinkhorn_iters, static_cast<float>(c.hc_eps)};
  in->count = count;
  const int64_t hc = c.hc_mult, n = in->s.width(), mix = in->s.mix_count();
  std::normal_distribution<float> dist(0.0f, 1.0f);
  in->X = random_bf16_values(rng, static_cast<size_t>(count * n));
  in->y = random_bf16_values(rng, static_cast<size_t>(count * c.dim), 0.1f);
  in->fn.resize(static_cast<size_t>(mix * n));
  for (auto& v : in->fn) v = dist(rng) * 0.02f;
  in->scale = {0.5f, 0.7f, 1.3f};
  in->base.resize(static_cast<size_t>(mix));
  for (auto& v : in->base) v = dist(rng) * 0.1f;
  in->pre.resize(static_cast<size_t>(count * hc));
  in->post.resize(in->pre.size());
  in->comb.resize(static_cast<size_t>(count * hc * hc));
  std::vector<float> mixes(static_cast<size_t>(mix));
  for (int64_t t = 0; t < count; ++t) {  // the previous sublayer's coefficients from a real Sinkhorn
    for (auto& v : mixes) v = dist(rng);
    reference::hc_split_sinkhorn(mixes.data(), in->scale.data(), in->base.data(), static_cast<int>(hc), 20, 1e-6f,
                                 &in->pre[t * hc], &in->post[t * hc], &in->comb[t * hc * hc]);
  }
  return in;
}

TEST(Ops, Mhc) {
  std::mt19937 rng(114);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    for (const int64_t count : {int64_t{1}, int64_t{5}}) {
      auto in = random_hc(rng, g.c, count);
      const int64_t hc = in->s.hc, d = in->s.dim;
      const std::string t = " tokens=" + std::to_string(count);
      const auto coefficients = [in, hc](std::vector<float>& out) {
        out.resize(static_cast<size_t>(in->count * (2 * hc + hc * hc)));
        float* p = out.data();
        return HcCoefficientsOut{p, p + in->count * hc, p + 2 * in->count * hc};
      };
      cases.push_back({named(g, "mixes" + t), [=](const Backend* be) {
                         std::vector<float> out;
                         const HcMixWeights w{in->fn.data(), in->scale.data(), in->base.data()};
                         be ? be->mhc_mixes(in->s, in->X.data(), count, w, coefficients(out))
                            : reference::mhc_mixes(in->s, in->X.data(), count, w, coefficients(out));
                         return out;
                       }});
      cases.push_back({named(g, "collapse" + t), [=](const Backend* be) {
                         std::vector<float> u(static_cast<size_t>(count * d));
                         be ? be->mhc_collapse(in->s, in->X.data(), in->pre.data(), count, u.data())
                            : reference::mhc_collapse(in->s, in->X.data(), in->pre.data(), count, u.data());
                         return u;
                       }});
      cases.push_back({named(g, "expand" + t), [=](const Backend* be) {
                         std::vector<float> X = in->X;
                         be ? be->mhc_expand(in->s, X.data(), in->y.data(), in->post.data(), in->comb.data(), count)
                            : reference::mhc_expand(in->s, X.data(), in->y.data(), in->post.data(), in->comb.data(),
                                                    count);
                         return X;
                       }});
      cases.push_back({named(g, "step" + t), [=](const Backend* be) {
                         std::vector<float> X = in->X, out, u(static_cast<size_t>(count * d));
                         const HcMixWeights w{in->fn.data(), in->scale.data(), in->base.data()};
                         const HcCoefficients prev{in->pre.data(), in->post.data(), in->comb.data()};
                         const HcCoefficientsOut o = coefficients(out);
                         be ? be->mhc_step(in->s, X.data(), in->y.data(), prev, w, count, o, u.data())
                            : reference::mhc_step(in->s, X.data(), in->y.data(), prev, w, count, o, u.data());
                         X.insert(X.end(), out.begin(), out.end());
                         X.insert(X.end(), u.begin(), u.end());
                         return X;
                       }});
    }
  }
  expect_agreement(cases);
}

// ---- MoE ----------------------------------------------------------------------------------------------

TEST(Ops, MoeRouteAndDispatch) {
  std::mt19937 rng(115);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    for (const ScoreFunction f : {ScoreFunction::SqrtSoftplus, ScoreFunction::Sigmoid, ScoreFunction::Softmax}) {
      RouterParams p = router_params(g.c, 0);
      p.score = f;
      const int64_t tokens = 7;
      auto logits = std::make_shared<std::vector<float>>(static_cast<size_t>(tokens * p.experts));
      for (auto& v : *logits) v = dist(rng);
      (*logits)[3] = 25.0f;  // past softplus's switch to the identity
      auto bias = std::make_shared<std::vector<float>>(static_cast<size_t>(p.experts));
      for (auto& v : *bias) v = dist(rng) * 0.05f;
      cases.push_back(
          {named(g, "route, score function " + std::to_string(static_cast<int>(f))), [=](const Backend* be) {
             std::vector<int32_t> experts(static_cast<size_t>(tokens * p.k));
             std::vector<float> weights(experts.size());
             be ? be->moe_route(logits->data(), tokens, p, bias->data(), experts.data(), weights.data())
                : reference::moe_route(logits->data(), tokens, p, bias->data(), experts.data(), weights.data());
             // then the dispatch of that routing, as the model runs them
             const MoeDispatch d = be ? be->moe_dispatch(experts.data(), weights.data(), tokens, p.k, p.experts)
                                      : reference::moe_dispatch(experts.data(), weights.data(), tokens, p.k, p.experts);
             std::vector<float> out = as_floats(experts);
             out.insert(out.end(), weights.begin(), weights.end());
             out.insert(out.end(), d.offsets.begin(), d.offsets.end());
             out.insert(out.end(), d.token.begin(), d.token.end());
             out.insert(out.end(), d.weight.begin(), d.weight.end());
             return out;
           }});
    }
  }
  expect_agreement(cases);
}

TEST(Ops, SwigluGatherAndCombine) {
  std::mt19937 rng(116);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    const int64_t m = 6, n = g.c.moe_inter_dim, d = g.c.dim;
    const float limit = static_cast<float>(g.c.swiglu_limit);
    auto gate = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(m * n), 6.0f));
    auto up = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(m * n), 6.0f));
    auto row_w = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(m), 0.5f));
    for (const bool weighted : {false, true}) {
      for (const float lim : {limit, 0.0f}) {  // the config's clamp, and none
        cases.push_back({named(g, std::string("swiglu") + (weighted ? " weighted" : "") + (lim > 0 ? " clamped" : "")),
                         [=](const Backend* be) {
                           std::vector<float> h = *gate;
                           const float* w = weighted ? row_w->data() : nullptr;
                           be ? be->swiglu(h.data(), up->data(), m, n, lim, w)
                              : reference::swiglu(h.data(), up->data(), m, n, lim, w);
                           return h;
                         }});
      }
    }
    // every special value the clamp and exp must keep (NaN, infinities, both zeros, the limit
    // itself, exp's underflow and overflow), in rows of 37: vector lanes and a scalar tail
    {
      const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
      const float special[] = {nan, inf, -inf, 0.0f, -0.0f, limit, -limit, 200.0f, -200.0f, 104.5f, -104.5f, 88.0f};
      auto sg = std::make_shared<std::vector<float>>(random_bf16_values(rng, 3 * 37, 20.0f));
      auto su = std::make_shared<std::vector<float>>(random_bf16_values(rng, 3 * 37, 20.0f));
      for (size_t i = 0; i < sg->size(); i += 3) {
        (*sg)[i] = special[(i / 3) % std::size(special)];
        (*su)[(i + 1) % su->size()] = special[(i / 3 + 5) % std::size(special)];
      }
      for (const float lim : {limit, 0.0f}) {
        cases.push_back({named(g, std::string("swiglu special") + (lim > 0 ? " clamped" : "")),
                         [=](const Backend* be) {
                           std::vector<float> h = *sg;
                           be ? be->swiglu(h.data(), su->data(), 3, 37, lim, row_w->data())
                              : reference::swiglu(h.data(), su->data(), 3, 37, lim, row_w->data());
                           return h;
                         }});
      }
    }
    // a dispatch of 5 tokens over 4 experts (one of them unused), its rows gathered and combined
    auto x = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(5 * d)));
    auto dispatch = std::make_shared<MoeDispatch>();
    dispatch->offsets = {0, 3, 3, 5, 8};
    dispatch->token = {0, 2, 4, 1, 2, 0, 3, 4};
    dispatch->weight = {0.5f, 0.25f, 1.0f, 0.75f, 0.5f, 0.125f, 1.0f, 0.25f};
    auto routed = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(8 * d)));
    auto shared = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(5 * d)));
    cases.push_back({named(g, "gather"), [=](const Backend* be) {
                       std::vector<float> out(static_cast<size_t>(8 * d));
                       be ? be->gather_rows(x->data(), d, dispatch->token.data(), 8, out.data())
                          : reference::gather_rows(x->data(), d, dispatch->token.data(), 8, out.data());
                       return out;
                     }});
    cases.push_back({named(g, "combine"), [=](const Backend* be) {
                       std::vector<float> out(static_cast<size_t>(5 * d));
                       be ? be->moe_combine(*dispatch, routed->data(), shared->data(), 5, d, out.data())
                          : reference::moe_combine(*dispatch, routed->data(), shared->data(), 5, d, out.data());
                       return out;
                     }});
  }
  expect_agreement(cases);
}

// The composed expert op: its reference is the reference ops in the order the backend's default
// composes them (w1 and w3, swiglu, w2).
template <class Matrix>
std::vector<float> reference_expert(const ExpertMatrices<Matrix>& w, const float* x, int64_t m, const float* row_w,
                                    float limit) {
  const int64_t inter = w.w1.n, d = w.w2.n;
  std::vector<float> g(static_cast<size_t>(m * inter)), u(g.size()), y(static_cast<size_t>(m * d));
  if constexpr (std::is_same_v<Matrix, Fp4Matrix>) {
    reference::linear_fp4(x, m, w.w1, g.data());
    reference::linear_fp4(x, m, w.w3, u.data());
    reference::swiglu(g.data(), u.data(), m, inter, limit, row_w);
    reference::linear_fp4(g.data(), m, w.w2, y.data());
  } else {
    reference::linear_fp8(x, m, w.w1, g.data());
    reference::linear_fp8(x, m, w.w3, u.data());
    reference::swiglu(g.data(), u.data(), m, inter, limit, row_w);
    reference::linear_fp8(g.data(), m, w.w2, y.data());
  }
  return y;
}

TEST(Ops, ExpertFfn) {
  std::mt19937 rng(117);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    // the tiny model's experts whole; the released one's narrowed to 192 intermediate rows (w2's K
    // must stay whole blocks of 32)
    const int64_t d = g.c.dim, inter = std::min<int64_t>(g.c.moe_inter_dim, 192), m = 3;
    const float limit = static_cast<float>(g.c.swiglu_limit);
    auto x = std::make_shared<std::vector<float>>(random_activations(rng, m, d));
    auto row_w = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(m), 0.5f));
    auto bytes = std::make_shared<std::vector<std::vector<uint8_t>>>();
    for (int i = 0; i < 3; ++i) {  // routed FP4: w1, w3 [inter, d], w2 [d, inter]
      const int64_t n = i == 1 ? d : inter, k = i == 1 ? inter : d;
      bytes->push_back(random_bytes(rng, static_cast<size_t>(n * k / 2)));
      bytes->push_back(random_scales(rng, static_cast<size_t>(n * (k / 32))));
    }
    for (int i = 0; i < 3; ++i) {  // shared FP8
      const int64_t n = i == 1 ? d : inter, k = i == 1 ? inter : d;
      bytes->push_back(random_e4m3(rng, static_cast<size_t>(n * k)));
      bytes->push_back(random_scales(rng, static_cast<size_t>(((n + 31) / 32) * (k / 32))));
    }
    const auto fp4 = [=](int i) {
      const int64_t n = i == 1 ? d : inter, k = i == 1 ? inter : d;
      return Fp4Matrix{(*bytes)[static_cast<size_t>(2 * i)].data(), (*bytes)[static_cast<size_t>(2 * i + 1)].data(), n,
                       k};
    };
    const auto fp8 = [=](int i) {
      const int64_t n = i == 1 ? d : inter, k = i == 1 ? inter : d;
      return Fp8Matrix{(*bytes)[static_cast<size_t>(6 + 2 * i)].data(), (*bytes)[static_cast<size_t>(7 + 2 * i)].data(),
                       n, k};
    };
    cases.push_back({named(g, "routed (FP4, weighted)"), [=](const Backend* be) {
                       ExpertMatrices<Fp4Matrix> e{fp4(0), fp4(1), fp4(2)};
                       if (!be) return reference_expert(e, x->data(), m, row_w->data(), limit);
                       std::unique_ptr<PackedWeights> k1, k2, k3;
                       e = {packed_for(*be, e.w1, k1), packed_for(*be, e.w2, k2), packed_for(*be, e.w3, k3)};
                       std::vector<float> y(static_cast<size_t>(m * d));
                       be->expert_ffn(e, x->data(), m, row_w->data(), limit, y.data());
                       return y;
                     }});
    cases.push_back({named(g, "shared (FP8)"), [=](const Backend* be) {
                       ExpertMatrices<Fp8Matrix> e{fp8(0), fp8(1), fp8(2)};
                       if (!be) return reference_expert(e, x->data(), m, nullptr, limit);
                       std::unique_ptr<PackedWeights> k1, k2, k3;
                       e = {packed_for(*be, e.w1, k1), packed_for(*be, e.w2, k2), packed_for(*be, e.w3, k3)};
                       std::vector<float> y(static_cast<size_t>(m * d));
                       be->expert_ffn(e, x->data(), m, nullptr, limit, y.data());
                       return y;
                     }});
  }
  expect_agreement(cases);
}

// ---- embedding, Engram, the stream ----------------------------------------------------------------

TEST(Ops, EmbedEngramAndStream) {
  std::mt19937 rng(118);
  std::vector<OpCase> cases;
  for (const Geometry& g : geometries()) {
    const ModelConfig& c = g.c;
    const int64_t d = c.dim, hc = c.hc_mult, rows = 500;  // a 500-row slice of the embedding table
    auto table = std::make_shared<std::vector<uint16_t>>(random_bf16_bits(rng, static_cast<size_t>(rows * d)));
    auto tokens = std::make_shared<std::vector<int32_t>>(std::vector<int32_t>{0, 499, 7, 7, 250});
    cases.push_back({named(g, "embed"), [=](const Backend* be) {
                       std::vector<float> X(static_cast<size_t>(5 * hc * d));
                       be ? be->embed(table->data(), d, tokens->data(), 5, hc, X.data())
                          : reference::embed(table->data(), d, tokens->data(), 5, hc, X.data());
                       return X;
                     }});
    // a decode step's and a prefill chunk's Engram rows
    const int64_t hd = c.engram_head_dim, cols = c.engram_hash_columns();
    for (const int64_t tokens_n : {int64_t{1}, int64_t{64}}) {
      const int64_t n = tokens_n * cols;
      auto codes = std::make_shared<std::vector<uint8_t>>(random_bytes(rng, static_cast<size_t>(n * hd)));
      auto scales =
          std::make_shared<std::vector<uint8_t>>(random_scales(rng, static_cast<size_t>(n * hd / 32), 100, 150));
      cases.push_back({named(g, "engram rows of " + std::to_string(tokens_n) + " tokens"), [=](const Backend* be) {
                         std::vector<float> out(static_cast<size_t>(n * hd));
                         be ? be->engram_rows(codes->data(), scales->data(), n, hd, out.data())
                            : reference::engram_rows(codes->data(), scales->data(), n, hd, out.data());
                         return out;
                       }});
    }
    const int64_t s = 3;
    auto X = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(s * hc * d)));
    auto kv = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(s * (hc + 1) * d)));
    auto qk = std::make_shared<std::vector<float>>(random_bf16_values(rng, static_cast<size_t>(hc * d), 0.05f));
    const float eps = static_cast<float>(c.norm_eps);
    cases.push_back({named(g, "engram gate"), [=](const Backend* be) {
                       std::vector<float> x = *X;
                       be ? be->engram_gate(x.data(), s, hc, d, kv->data(), qk->data(), eps)
                          : reference::engram_gate(x.data(), s, hc, d, kv->data(), qk->data(), eps);
                       return x;
                     }});
    const int64_t taps = std::max<int64_t>(1, static_cast<int64_t>(c.dspark_target_layer_ids.size()));
    cases.push_back({named(g, "stream mean"), [=](const Backend* be) {
                       std::vector<float> out(static_cast<size_t>(s * taps * d), 0.0f);
                       be ? be->stream_mean(X->data(), s, hc, d, out.data() + d * (taps - 1), taps * d)
                          : reference::stream_mean(X->data(), s, hc, d, out.data() + d * (taps - 1), taps * d);
                       return out;
                     }});
    cases.push_back({named(g, "add"), [=](const Backend* be) {
                       std::vector<float> y(kv->begin(), kv->begin() + d);
                       be ? be->add(y.data(), X->data(), d) : reference::add(y.data(), X->data(), d);
                       return y;
                     }});
  }
  expect_agreement(cases);
}

// The harness sees every level the build lists that the machine runs, each at two thread counts.
TEST(Ops, HarnessCoversEveryAvailableLevel) {
  std::set<Isa> seen;
  for (const auto& be : op_backends()) seen.insert(be->level());
  for (const Isa l : available_backend_levels()) EXPECT_TRUE(seen.count(l)) << isa_name(l);
  EXPECT_EQ(op_backends().size(), 2 * available_backend_levels().size());
}

}  // namespace
