#include "text/bpe_trainer.h"

#include <cctype>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>

#include "text/byte_level.h"

namespace dsv41 {

std::vector<std::string> bpe_training_pieces(std::string_view text) {
  auto kind = [](unsigned char c) {
    if (std::isalpha(c) || c >= 0x80) return 1;
    if (std::isdigit(c)) return 2;
    if (c == ' ') return 3;
    if (c == '\n') return 4;
    return 5;
  };
  std::vector<std::string> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t start = i;
    if (text[i] == ' ' && i + 1 < text.size() && kind(static_cast<unsigned char>(text[i + 1])) != 3) ++i;
    int k = kind(static_cast<unsigned char>(text[i]));
    while (i < text.size() && kind(static_cast<unsigned char>(text[i])) == k && (k != 4 || i == start)) ++i;
    if (i == start) ++i;
    out.emplace_back(text.substr(start, i - start));
  }
  return out;
}

namespace {

struct Piece {
  std::vector<int32_t> symbols;
  int64_t count = 0;
};

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

class MergeLearner {
 public:
  explicit MergeLearner(std::string_view text) {
    std::unordered_map<std::string, int64_t> counts;
    for (std::string& p : bpe_training_pieces(text)) ++counts[std::move(p)];
    for (const auto& [text_of_piece, count] : counts) {
      Piece piece{{}, count};
      for (char c : text_of_piece) piece.symbols.push_back(symbol(bytes_to_token_text(std::string(1, c))));
      pieces_.push_back(std::move(piece));
    }
    for (size_t w = 0; w < pieces_.size(); ++w) add_pairs(w, +1);
  }

  bool next(std::pair<std::string, std::string>& merge) {
    const uint64_t* best = nullptr;
    int64_t best_count = 0;
    for (const auto& [key, count] : pair_counts_) {
      if (best == nullptr || count > best_count || (count == best_count && texts_less(key, *best))) {
        best = &key;
        best_count = count;
      }
    }
    if (best == nullptr) return false;
    const uint64_t key = *best;
    const int32_t a = static_cast<int32_t>(key >> 32), b = static_cast<int32_t>(key & 0xffffffffu);
    merge = {texts_[a], texts_[b]};
    const int32_t merged = symbol(texts_[a] + texts_[b]);
    std::vector<size_t> touched;
    {
      std::unordered_set<size_t> seen;
      for (size_t w : where_[key]) if (seen.insert(w).second) touched.push_back(w);
    }
    for (size_t w : touched) {
      add_pairs(w, -1);
      std::vector<int32_t>& s = pieces_[w].symbols;
      std::vector<int32_t> out;
      out.reserve(s.size());
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          out.push_back(merged);
          ++i;
        } else {
          out.push_back(s[i]);
        }
      }
      s = std::move(out);
      add_pairs(w, +1);
    }
    pair_counts_.erase(key);
    where_.erase(key);
    return true;
  }

 private:
  int32_t symbol(const std::string& text) {
    auto [it, inserted] = ids_.emplace(text, static_cast<int32_t>(texts_.size()));
    if (inserted) texts_.push_back(text);
    return it->second;
  }
  bool texts_less(uint64_t x, uint64_t y) const {
    const std::string& xa = texts_[x >> 32];
    const std::string& ya = texts_[y >> 32];
    if (xa != ya) return xa < ya;
    return texts_[x & 0xffffffffu] < texts_[y & 0xffffffffu];
  }
  void add_pairs(size_t w, int sign) {
    const Piece& p = pieces_[w];
    for (size_t i = 0; i + 1 < p.symbols.size(); ++i) {
      const uint64_t key = pair_key(p.symbols[i], p.symbols[i + 1]);
      if (sign > 0) {
        pair_counts_[key] += p.count;
        where_[key].push_back(w);  // stale entries are harmless: a merge re-scans the piece
      } else if ((pair_counts_[key] -= p.count) == 0) {
        pair_counts_.erase(key);  // keeps the scan for the best pair over live pairs only
      }
    }
  }

  std::vector<Piece> pieces_;
  std::vector<std::string> texts_;
  std::unordered_map<std::string, int32_t> ids_;
  std::unordered_map<uint64_t, int64_t> pair_counts_;
  std::unordered_map<uint64_t, std::vector<size_t>> where_;
};

}  // namespace

std::vector<std::pair<std::string, std::string>> learn_bpe_merges(std::string_view text, size_t max_merges) {
  MergeLearner learner(text);
  std::vector<std::pair<std::string, std::string>> merges;
  std::pair<std::string, std::string> merge;
  while (merges.size() < max_merges && learner.next(merge)) merges.push_back(merge);
  return merges;
}

}  // namespace dsv41
