// The forward pass on the generated tiny model: chunking, decode, tail mode, role coverage, and the
// pieces not covered by the kernel tests (candidate blocks, Engram hashes) against slow formulations.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <map>
#include <set>
#include <thread>

#include "kernels/reference.h"
#include "model/attention.h"
#include "model/engram.h"
#include "model/model.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

const Model& tiny() { return test::tiny_model(); }

// Every stored row of a paged state class, concatenated.
std::vector<int32_t> random_ids(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return ids;
}

// Runs `ids` in calls of `chunk` tokens; returns the last logits and every call's selections per
// (layer, absolute query position) as sets of valid rows.
struct ChunkedRun {
  std::vector<float> logits;
  std::map<std::pair<int, int64_t>, std::set<int32_t>> selected;
};

ChunkedRun run_chunked(const std::vector<int32_t>& ids, int64_t chunk) {
  const Model& m = tiny();
  SequenceState st = m.new_sequence(test::pools_for(m));
  ForwardOptions opt;
  opt.capture_index = true;
  ChunkedRun out;
  for (size_t done = 0; done < ids.size();) {
    const size_t take = std::min<size_t>(static_cast<size_t>(chunk), ids.size() - done);
    const int64_t start = st.length();
    ForwardResult r = m.forward(st, {ids.begin() + done, ids.begin() + done + take}, opt);
    for (size_t layer = 0; layer < r.index.size(); ++layer) {
      const IndexCapture& cap = r.index[layer];
      if (cap.k == 0) continue;
      for (size_t i = 0; i < take; ++i) {
        std::set<int32_t> s;
        for (int64_t j = 0; j < cap.k; ++j)
          if (cap.selected[i * cap.k + j] >= 0) s.insert(cap.selected[i * cap.k + j]);
        if (!s.empty()) out.selected[{static_cast<int>(layer), start + static_cast<int64_t>(i)}] = s;
      }
    }
    done += take;
    out.logits = r.logits;
  }
  return out;
}

// Chunked prefill must equal one-shot prefill. On the tiny model every attention list (16 window rows +
// at most 8 selected rows) fits one 64-entry softmax chunk, so the only layout difference between the
// prefill and decode list orders (where the -1 padding sits) cannot change a single rounding: the
// results must be bitwise equal.
TEST(ModelChunking, ChunkSizesGiveIdenticalLogitsAndSelections) {
  const std::vector<int32_t> ids = random_ids(150, 1, 1024);
  ChunkedRun whole = run_chunked(ids, 150);
  for (int64_t chunk : {1, 7, 64}) {
    ChunkedRun part = run_chunked(ids, chunk);
    EXPECT_EQ(part.logits, whole.logits) << "chunk " << chunk;
    EXPECT_EQ(part.selected, whole.selected) << "chunk " << chunk;
  }
  EXPECT_GT(whole.selected.size(), 150u * 3);  // every index source selected for most queries
}

TEST(ModelChunking, DecodeAfterPrefillEqualsLongerPrefill) {
  const Model& m = tiny();
  const std::vector<int32_t> ids = random_ids(90, 2, 1024);
  for (size_t n : {5, 16, 17, 40, 89}) {
    SequenceState a = m.new_sequence(test::pools_for(m)), b = m.new_sequence(test::pools_for(m));
    m.forward(a, {ids.begin(), ids.begin() + static_cast<long>(n)}, {});
    ForwardResult step = m.forward(a, {ids[n]}, {});
    ForwardResult full = m.forward(b, {ids.begin(), ids.begin() + static_cast<long>(n) + 1}, {});
    EXPECT_EQ(step.logits, full.logits) << "n = " << n;
  }
}

// In tail mode the late layers see only the prompt's last `window` rows; a prompt that fits in the
// window loses nothing, so it must equal the exact path bit for bit, and a longer one must not. On
// the 120-token prompt the measured deviation of the last prompt row is a relative L2 of 0.227, and
// it fades as decoding refills the late layers' windows: over that row and 32 teacher-forced steps
// 0.090, with 29 of 33 argmaxes equal (docs/agreement.md has the same on a longer run). The bars sit a
// little above. A tail mode that lost the early context looks like a run whose first 104 tokens
// differ: measured 1.04 on the last row and 0.88 with 1 of 33 argmaxes, which the bars must reject.
TEST(ModelTailMode, ShortPromptsAreExactLongOnesApproximate) {
  const Model& m = tiny();
  const int64_t W = m.config().window_size, V = m.config().vocab_size;
  SessionOptions exact, tail;
  tail.prefill_mode = PrefillMode::Tail;
  const std::vector<int32_t> ids = random_ids(120, 3, 1024);
  {
    Session a(m, test::pools_for(m), exact), b(m, test::pools_for(m), tail);
    std::vector<int32_t> p(ids.begin(), ids.begin() + W);
    EXPECT_EQ(a.prefill(p), b.prefill(p));
    EXPECT_EQ(a.decode(ids[W]), b.decode(ids[W]));
  }
  constexpr double kMaxLastRowRelL2 = 0.27, kMaxRelL2 = 0.11;
  constexpr int kMinSameTop1 = 26;
  const std::vector<int32_t> teacher = random_ids(32, 77, 1024);
  std::vector<int32_t> other = random_ids(104, 555, 1024);
  other.insert(other.end(), ids.begin() + 104, ids.end());
  const auto run = [&](const std::vector<int32_t>& prompt, SessionOptions opt, bool check_state) {
    Session s(m, test::pools_for(m), opt);
    std::vector<float> rows = s.prefill(prompt);
    if (check_state) {
      // the global state is exact: the KV sources' rows equal an exact prefill's
      Session e(m, test::pools_for(m), exact);
      e.prefill(prompt);
      EXPECT_EQ(first_difference(s.state(), e.state(), StateScope::GlobalRows), "");
    }
    for (int32_t t : teacher) {
      std::vector<float> l = s.decode(t);
      rows.insert(rows.end(), l.begin(), l.end());
    }
    return rows;
  };
  const std::vector<float> la = run(ids, exact, false), lb = run(ids, tail, true), lo = run(other, exact, false);
  const auto last_row = [&](const std::vector<float>& v) { return std::vector<float>(v.begin(), v.begin() + V); };
  EXPECT_NE(last_row(la), last_row(lb));
  const test::Deviation last = test::deviation(last_row(lb), last_row(la), V), all = test::deviation(lb, la, V);
  const test::Deviation wrong_last = test::deviation(last_row(lo), last_row(la), V), wrong = test::deviation(lo, la, V);
  std::printf("[tail] last prompt row: relative L2 %.3f (other early context %.3f); with 32 decode steps %.3f, "
              "top-1 %d of %d (other early context %.3f, %d of %d)\n",
              last.rel_l2, wrong_last.rel_l2, all.rel_l2, all.same_top1, all.rows, wrong.rel_l2, wrong.same_top1,
              wrong.rows);
  EXPECT_LT(last.rel_l2, kMaxLastRowRelL2);
  EXPECT_LT(all.rel_l2, kMaxRelL2);
  EXPECT_GE(all.same_top1, kMinSameTop1);
  EXPECT_GT(wrong_last.rel_l2, kMaxLastRowRelL2);
  EXPECT_GT(wrong.rel_l2, kMaxRelL2);
  EXPECT_LT(wrong.same_top1, kMinSameTop1);
}

// The tiny model holds every role; running it prefill and decode, every reader finds what it reads
// already written in that call (the forward pass checks each read and throws otherwise).
TEST(ModelRoles, EveryRoleRunsAndNothingIsReadBeforeItIsWritten) {
  const Model& m = tiny();
  std::set<AttnRole> seen;
  bool engram = false, cand_src = false, cand_user = false;
  for (const LayerRole& r : m.roles()) {
    if (r.dspark) continue;
    seen.insert(r.role);
    engram = engram || r.engram;
    cand_src = cand_src || r.candidate_source;
    cand_user = cand_user || r.candidate_user;
  }
  EXPECT_EQ(seen.size(), 4u);
  EXPECT_TRUE(engram && cand_src && cand_user);
  SequenceState st = m.new_sequence(test::pools_for(m));
  const std::vector<int32_t> ids = random_ids(70, 4, 1024);
  EXPECT_NO_THROW(m.forward(st, ids, {}));
  for (int i = 0; i < 5; ++i) EXPECT_NO_THROW(m.forward(st, {ids[i]}, {}));
}

TEST(ModelRoles, ReadingUnpublishedStateFails) {
  const Model& m = tiny();
  const ModelConfig& c = m.config();
  // a Reuse layer run on its own, before its source published a top-k in this call
  int reuse = -1;
  for (const LayerRole& r : m.roles()) if (r.role == AttnRole::Reuse && reuse < 0) reuse = r.layer;
  ASSERT_GE(reuse, 0);
  SequenceState st = m.new_sequence(test::pools_for(m));
  ForwardContext ctx;
  ctx.count = 4;
  ctx.topk.resize(m.roles().size());
  ctx.topk_written.assign(m.roles().size(), false);
  std::vector<float> x(static_cast<size_t>(4 * c.dim), 0.01f);
  RopeTable rope(c.rope_head_dim, c.original_seq_len, c.compress_rope_theta, c.rope_factor, c.beta_fast, c.beta_slow);
  const LayerRole& role = m.roles()[reuse];
  const AttentionWeights& w = m.weights().layers[reuse].attn;
  AttentionProjection p = project_attention(m.backend(), c, role, w, x.data(), ctx.count, false);
  std::vector<float> o(static_cast<size_t>(4 * c.n_heads * c.head_dim));
  try {
    attention_core(m.backend(), c, role, w, rope, sequence_rows(c, p, 0), ctx, st, o.data());
    FAIL() << "a Reuse layer read a top-k nobody published";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("read before"), std::string::npos) << e.what();
  }
}

TEST(ModelErrors, BadTokensAndContextOverflowAreRefused) {
  const Model& m = tiny();
  SequenceState st = m.new_sequence(test::pools_for(m));
  EXPECT_THROW(m.forward(st, {5, 1024}, {}), Error);
  EXPECT_THROW(m.forward(st, {-1}, {}), Error);
  EXPECT_THROW(m.forward(st, {}, {}), Error);
  EXPECT_EQ(st.length(), 0);  // a refused call leaves the state untouched
  std::vector<int32_t> too_long(static_cast<size_t>(m.config().max_seq_len + 1), 3);
  EXPECT_THROW(m.forward(st, too_long, {}), Error);
}

// A FIFO, a folder or a device where the loader expects a file (the config, the tokenizer, the shard
// index, a shard) is refused with an error naming the file, at once: opening a FIFO for reading would
// otherwise wait for a writer forever. A helper opens the FIFO for writing after a few seconds, so a
// loader that does wait fails this test instead of hanging it.
TEST(ModelErrors, AFifoFolderOrDeviceInPlaceOfAModelFileIsRefusedNotWaitedOn) {
  namespace fs = std::filesystem;
  std::string shard;
  for (const auto& e : fs::directory_iterator(test::tiny_model_dir())) {
    if (e.path().extension() == ".safetensors") shard = e.path().filename().string();
  }
  ASSERT_FALSE(shard.empty());
  struct Case {
    std::string file, kind;
  };
  const std::vector<Case> cases = {{"config.json", "FIFO"},
                                   {"tokenizer.json", "FIFO"},
                                   {"model.safetensors.index.json", "FIFO"},
                                   {shard, "FIFO"},
                                   {"config.json", "directory"},
                                   {shard, "directory"},
                                   {"tokenizer.json", "character device"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file + " as a " + c.kind);
    test::TempDir dir;
    fs::copy(test::tiny_model_dir(), dir.path(), fs::copy_options::recursive);
    const std::string path = dir / c.file;
    fs::remove(path);
    if (c.kind == "FIFO") {
      ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
    }
    if (c.kind == "directory") fs::create_directory(path);
    if (c.kind == "character device") fs::create_symlink("/dev/null", path);
    std::atomic<bool> done{false}, released{false};
    std::thread writer([&] {
      const auto start = std::chrono::steady_clock::now();
      while (!done) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (c.kind != "FIFO" || std::chrono::steady_clock::now() - start < std::chrono::seconds(5)) continue;
        const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);  // succeeds only while a reader waits
        if (fd >= 0) {
          released = true;
          ::close(fd);
        }
      }
    });
    std::string message;
    try {
      load_model(dir.path());
    } catch (const Error& e) {
      message = e.what();
    }
    done = true;
    writer.join();
    EXPECT_FALSE(released) << "the loader waited on the FIFO until a writer came";
    EXPECT_NE(message.find(path + ": is a " + c.kind + ", not a regular file"), std::string::npos) << message;
  }
}

// The opaque state's public face: its length, the pages of its global rows (and clear errors for a
// layer or block it has none of), and the comparison the tests use, which does find differences.
TEST(SequenceStateApi, LengthPagesAndDifferences) {
  const Model& m = tiny();
  StatePools& pools = test::pools_for(m);
  SequenceState a = m.new_sequence(pools), b = m.new_sequence(pools);
  EXPECT_EQ(first_difference(a, b), "");
  const std::vector<int32_t> prompt = random_ids(static_cast<int>(2 * kTokensPerPage), 5, 1024);
  m.forward(a, prompt, {});
  EXPECT_EQ(a.length(), 2 * kTokensPerPage);
  EXPECT_EQ(first_difference(a, b), "length 128 against 0");
  m.forward(b, std::vector<int32_t>(prompt.begin(), prompt.end() - 1), {});
  m.forward(b, {prompt.back() == 7 ? 8 : 7}, {});  // the same length, another last token
  EXPECT_NE(first_difference(a, b), "");
  SequenceState c = m.new_sequence(pools);
  m.forward(c, prompt, {});
  EXPECT_EQ(first_difference(a, c), "");
  const int source = m.config().kv_source_layers.front();
  const GlobalPages p0 = a.global_pages(source, 0), p1 = a.global_pages(source, 1);
  EXPECT_GE(p0.main_kv, 0);
  EXPECT_GE(p0.index_keys, 0);
  EXPECT_NE(p0.main_kv, p1.main_kv);
  EXPECT_NE(p0.main_kv, c.global_pages(source, 0).main_kv) << "two sequences' own pages";
  EXPECT_THROW(a.global_pages(source, 2), Error);
  EXPECT_THROW(a.global_pages(-1, 0), Error);
  for (int layer = 0; layer < m.config().n_layers; ++layer) {
    const auto& src = m.config().kv_source_layers;
    if (std::find(src.begin(), src.end(), layer) == src.end()) {
      EXPECT_THROW(a.global_pages(layer, 0), Error) << layer;
      break;
    }
  }
}

// select_candidate_blocks against a direct reading of the reference's definition.
TEST(KernelsCandidates, MatchesASlowFormulation) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2, 2);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + rng() % 70, bs = 1 + rng() % 8, topk = 1 + rng() % 10, visible = rng() % (n + 1);
    std::vector<float> s(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) s[t] = t < visible ? std::round(u(rng) * 4) / 4 : ninf;  // ties too
    std::vector<uint8_t> got(static_cast<size_t>(n), 0);
    for (int32_t b : reference::select_candidate_blocks(s.data(), n, visible, topk, bs))
      for (int64_t t = b * bs; t < std::min(n, (b + 1) * bs); ++t) got[t] = 1;
    // slow: rank blocks by (score, lower index first), pinned block first
    const int64_t blocks = (n + bs - 1) / bs;
    std::vector<std::pair<float, int64_t>> rank;
    for (int64_t b = 0; b < blocks; ++b) {
      float best = ninf;
      for (int64_t t = b * bs; t < std::min(n, (b + 1) * bs); ++t) best = std::max(best, s[t]);
      if (visible > 0 && b == (visible - 1) / bs) best = std::numeric_limits<float>::infinity();
      rank.push_back({best, b});
    }
    std::stable_sort(rank.begin(), rank.end(), [](auto& a, auto& b) { return a.first > b.first; });
    std::vector<uint8_t> want(static_cast<size_t>(n), 0);
    for (int64_t j = 0; j < std::min(topk, blocks); ++j) {
      if (rank[j].first == ninf) continue;
      for (int64_t t = rank[j].second * bs; t < std::min(n, (rank[j].second + 1) * bs); ++t) want[t] = 1;
    }
    ASSERT_EQ(got, want) << "trial " << trial;
  }
}

// Engram row ids against the reference's formula written out directly: per position, the compressed
// ids of the last max_ngram tokens (padding before the start, cumulatively), multiplied, XOR-folded,
// reduced modulo each head's prime, offset into the layer's table.
TEST(EngramHash, MatchesTheFormulaAcrossCallBoundaries) {
  const ModelConfig& c = tiny().config();
  EngramTokenMap map;
  map.size = c.engram_compressed_vocab_size;
  for (int64_t t = 0; t < c.vocab_size; ++t) map.compressed.push_back((t * 7) % map.size);
  EngramHasher h(c, map);
  const std::vector<int32_t> ids = random_ids(40, 5, static_cast<int>(c.vocab_size));
  std::vector<int64_t> comp = h.compress(ids);
  for (int slot = 0; slot < static_cast<int>(c.engram_layer_ids.size()); ++slot) {
    const EngramLayerConstants& L = h.layout()[slot];
    // one call for everything, and the same split into calls of 1, 2 and 5 tokens
    std::vector<int64_t> whole = h.row_ids(slot, {}, comp);
    for (size_t step : {1, 2, 5}) {
      std::vector<int64_t> recent, joined;
      for (size_t i = 0; i < comp.size(); i += step) {
        std::vector<int64_t> part(comp.begin() + i, comp.begin() + std::min(comp.size(), i + step));
        std::vector<int64_t> got = h.row_ids(slot, recent, part);
        joined.insert(joined.end(), got.begin(), got.end());
        recent.insert(recent.end(), part.begin(), part.end());
        if (recent.size() > 3) recent.erase(recent.begin(), recent.end() - 3);
      }
      EXPECT_EQ(joined, whole) << "calls of " << step;
    }
    for (size_t p = 0; p < comp.size(); ++p) {
      std::vector<int64_t> tok(4);
      for (size_t sh = 0; sh < 4; ++sh) tok[sh] = p >= sh ? comp[p - sh] : h.pad();
      int64_t r = tok[0] * L.multipliers[0];
      for (int g = 1; g < 4; ++g) {
        r ^= tok[g] * L.multipliers[g];
        for (int head = 0; head < c.engram_n_heads; ++head) {
          const int col = (g - 1) * c.engram_n_heads + head;
          const int64_t want = ((r % L.primes[col]) + L.primes[col]) % L.primes[col] + L.offsets[col];
          ASSERT_EQ(whole[p * h.columns() + col], want) << "pos " << p << " col " << col;
          ASSERT_LT(want, L.rows);
        }
      }
    }
  }
}

}  // namespace
}  // namespace dsv41

namespace dsv41 {
namespace {

// A batched decode step over several sequences gives each exactly what its own decode step gives.
TEST(ModelBatch, DecodeBatchEqualsDecodingEachSequence) {
  const Model& m = tiny();
  StatePools& pools = test::pools_for(m);
  std::vector<std::unique_ptr<Session>> a, b;
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> prompt = random_ids(20 + 31 * i, 50 + static_cast<uint32_t>(i), 1024);
    a.push_back(std::make_unique<Session>(m, pools, SessionOptions{}));
    b.push_back(std::make_unique<Session>(m, pools, SessionOptions{}));
    a.back()->prefill(prompt);
    b.back()->prefill(prompt);
  }
  for (int step = 0; step < 6; ++step) {
    std::vector<int32_t> tokens = {static_cast<int32_t>(7 + step), static_cast<int32_t>(300 + step), static_cast<int32_t>(900 - step)};
    std::vector<Session*> batch = {a[0].get(), a[1].get(), a[2].get()};
    std::vector<std::vector<float>> together = Session::decode_batch(batch, tokens);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(together[i], b[i]->decode(tokens[i])) << "sequence " << i << " step " << step;
      EXPECT_EQ(first_difference(a[i]->state(), b[i]->state()), "") << "sequence " << i << " step " << step;
    }
  }
}

}  // namespace
}  // namespace dsv41

namespace dsv41 {
namespace {

// Everything a decode step may change in a sequence's state, for comparing two copies of it.
void expect_same_state(const SequenceState& a, const SequenceState& b, const std::string& what) {
  EXPECT_EQ(first_difference(a, b), "") << what;
}

// Sequences at different points of their life decode together exactly as each does alone: one whose
// window is not full and whose sources have next to nothing compressed, ones on either side of a
// ratio-2 compression boundary, one whose indexers have more keys than they keep and a candidate
// pool to restrict to, and one prefilled in tail mode (late layers' windows start late); in both
// index-key modes, since the reference mode reads keys across layers.
TEST(ModelBatch, DecodeBatchIsExactAcrossLengthsRolesAndKeyModes) {
  const Model& m = tiny();
  StatePools& pools = test::pools_for(m);
  struct Start {
    int length;
    PrefillMode mode;
  };
  const std::vector<Start> starts = {{1, PrefillMode::Exact}, {6, PrefillMode::Exact}, {9, PrefillMode::Exact},
                                     {45, PrefillMode::Exact}, {38, PrefillMode::Tail}};
  for (IndexKeysMode keys : {IndexKeysMode::Owner, IndexKeysMode::Reference}) {
    std::vector<std::unique_ptr<Session>> together, alone;
    for (size_t i = 0; i < starts.size(); ++i) {
      SessionOptions opt;
      opt.prefill_mode = starts[i].mode;
      opt.index_keys = keys;
      const std::vector<int32_t> prompt = random_ids(starts[i].length, 70 + static_cast<uint32_t>(i), 1024);
      together.push_back(std::make_unique<Session>(m, pools, opt));
      alone.push_back(std::make_unique<Session>(m, pools, opt));
      together.back()->prefill(prompt);
      alone.back()->prefill(prompt);
    }
    std::vector<Session*> batch;
    for (auto& s : together) batch.push_back(s.get());
    for (int step = 0; step < 5; ++step) {
      std::vector<int32_t> tokens;
      for (size_t i = 0; i < starts.size(); ++i) tokens.push_back(static_cast<int32_t>((131 * i + 17 * step) % 1024));
      const std::vector<std::vector<float>> logits = Session::decode_batch(batch, tokens);
      for (size_t i = 0; i < starts.size(); ++i) {
        const std::string what = "mode " + std::to_string(static_cast<int>(keys)) + " sequence " + std::to_string(i) +
                                 " step " + std::to_string(step);
        EXPECT_EQ(logits[i], alone[i]->decode(tokens[i])) << what;
        expect_same_state(together[i]->state(), alone[i]->state(), what);
      }
    }
  }
}

}  // namespace
}  // namespace dsv41
