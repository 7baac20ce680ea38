#include "model/engram.h"

#include "numeric/formats.h"
#include "util/error.h"

namespace dsv41 {

void check_engram_token_map(const ModelConfig& c, const EngramTokenMap& map) {
  if (c.engram_layer_ids.empty()) return;
  // Every multiplier is derived from the compressed vocabulary's size, so a tokenizer that does not
  // produce the size the checkpoint was trained with would silently rehash every table.
  if (map.size != c.engram_compressed_vocab_size) {
    fail("tokenizer.json", "gives an Engram compressed vocabulary of " + std::to_string(map.size) +
                               " ids, the config says engram_compressed_vocab_size = " +
                               std::to_string(c.engram_compressed_vocab_size));
  }
  if (static_cast<int64_t>(map.compressed.size()) < c.vocab_size) {
    fail("tokenizer.json", "covers fewer ids than vocab_size");
  }
}

EngramHasher::EngramHasher(const ModelConfig& c, EngramTokenMap map)
    : max_ngram_(c.engram_max_ngram_size), heads_(c.engram_n_heads), columns_(c.engram_hash_columns()),
      map_(std::move(map)) {
  if (c.engram_layer_ids.empty()) return;
  check_engram_token_map(c, map_);
  pad_ = map_.compressed[static_cast<size_t>(c.engram_pad_id)];
  layout_ = engram_layout(c.engram_layer_ids, max_ngram_, c.engram_vocab_size, heads_, c.engram_compressed_vocab_size);
}

std::vector<int64_t> EngramHasher::compress(const std::vector<int32_t>& tokens) const {
  std::vector<int64_t> out(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || static_cast<size_t>(tokens[i]) >= map_.compressed.size()) {
      fail("tokens", "id " + std::to_string(tokens[i]) + " is outside the vocabulary");
    }
    out[i] = map_.compressed[static_cast<size_t>(tokens[i])];
  }
  return out;
}

std::vector<int64_t> EngramHasher::row_ids(int slot, const std::vector<int64_t>& recent,
                                           const std::vector<int64_t>& compressed) const {
  const EngramLayerConstants& L = layout_[static_cast<size_t>(slot)];
  const int64_t n = static_cast<int64_t>(compressed.size()), before = static_cast<int64_t>(recent.size());
  std::vector<int64_t> out(static_cast<size_t>(n * columns_));
  std::vector<int64_t> prod(static_cast<size_t>(max_ngram_));
  for (int64_t i = 0; i < n; ++i) {
    // cumulative: once history runs out or a DEAD (image) position is reached, every further shift
    // is padding
    bool blocked = false;
    for (int sh = 0; sh < max_ngram_; ++sh) {
      const int64_t at = i - sh;  // index into the call; negative reaches into `recent`
      blocked = blocked || (at < 0 && before + at < 0);
      const int64_t id = blocked ? pad_ : at >= 0 ? compressed[at] : recent[before + at];
      blocked = blocked || id == kEngramDead;
      prod[sh] = (blocked ? pad_ : id) * L.multipliers[sh];
    }
    int64_t rolling = prod[0];
    for (int g = 1; g < max_ngram_; ++g) {  // the (g+1)-gram: XOR in one more look-back
      rolling ^= prod[g];
      for (int h = 0; h < heads_; ++h) {
        const int col = (g - 1) * heads_ + h;
        int64_t m = rolling % L.primes[col];
        if (m < 0) m += L.primes[col];  // Python's modulo: never negative
        out[i * columns_ + col] = m + L.offsets[col];
      }
    }
  }
  return out;
}

void engram_forward(const Backend& be, const ModelConfig& c, const EngramWeights& w, const uint8_t* codes,
                    const uint8_t* scales, int64_t s, const uint8_t* span, float* X) {
  const int64_t d = c.dim, hc = c.hc_mult, hd = c.engram_head_dim, cols = c.engram_hash_columns();
  // the gathered rows dequantized to bf16, one key per copy and the value from them, then the gate
  std::vector<float> rows(static_cast<size_t>(s * cols * hd));
  be.engram_rows(codes, scales, s * cols, hd, rows.data());
  std::vector<float> kv(static_cast<size_t>(s * (hc + 1) * d));
  be.linear_fp8(rows.data(), s, w.wkv, kv.data());
  std::vector<float> before;  // the span positions' stream, which their gate of 0 keeps
  if (span != nullptr) {
    for (int64_t i = 0; i < s; ++i)
      if (span[i] != 0) before.insert(before.end(), X + i * hc * d, X + (i + 1) * hc * d);
  }
  be.engram_gate(X, s, hc, d, kv.data(), w.qk.data(), static_cast<float>(c.norm_eps));
  if (span == nullptr) return;
  // h + 0·value, rounded: h itself, except that -0 can become +0, as in the reference
  const float* kept = before.data();
  for (int64_t i = 0; i < s; ++i) {
    if (span[i] == 0) continue;
    const float* value = &kv[static_cast<size_t>((i * (hc + 1) + hc) * d)];
    for (int64_t cp = 0; cp < hc; ++cp, kept += d) {
      float* h = X + (i * hc + cp) * d;
      for (int64_t j = 0; j < d; ++j) h[j] = round_bf16(kept[j] + 0.0f * value[j]);
    }
  }
}

}  // namespace dsv41
