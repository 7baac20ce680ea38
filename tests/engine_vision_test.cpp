// Images through the one engine path (runtime/prompt_images.h): placeholders expanded into spans, the
// vision tower run when the request starts, spans prefilled whole in any chunk size, and the prompt
// cache keying spans by their image's content, in both cache modes, on tiny-vision (its README).
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "engine_util.h"
#include "golden_util.h"
#include "runtime/image_prepare.h"
#include "test_util.h"
#include "util/error.h"

namespace dsv41 {
namespace {

std::string vision_dir() { return test::golden_dir("tiny-vision"); }

ImageInput image(const std::string& name) {
  const nlohmann::json meta = nlohmann::json::parse(std::ifstream(vision_dir() + "/golden.json"));
  const std::string path = vision_dir() + "/" + meta["images"][name]["png"].get<std::string>();
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return prepare_image(bytes, load_config(vision_dir()).vision, ImageDecodeLimits{}, path);
}

constexpr int32_t kImage = 510;  // tiny-vision's image_token_id

struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<float> rows;
  TokenEvent last;
};

Outcome run(Engine& e, std::vector<int32_t> prompt, std::vector<ImageInput> images, int64_t max_tokens = 8) {
  RequestParams p;
  p.prompt = std::move(prompt);
  p.images = std::move(images);
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  p.return_logits = true;
  Collected c;
  e.submit(p, collect(c));
  wait(c);
  EXPECT_EQ(c.last.finish_reason, FinishReason::Length) << c.last.error;
  return {c.tokens, c.rows, c.last};
}

EngineOptions options(int64_t chunk = 512) {
  EngineOptions o;
  o.model_dir = vision_dir();
  o.parallel = 2;
  o.prefill_chunk = chunk;
  return o;
}

// The reference's prompt p2 (two images) from its token ids and the two PNGs: the expanded length and
// the greedy tokens are the reference's (golden.json), and a prefill in chunks of 1, 5 and 30 (each
// span still prefilled in one piece) gives the one-shot prefill's logits bit for bit.
TEST(EngineVision, ThePromptsImagesReachTheModelAsTheReferencePutsThem) {
  const nlohmann::json p2 = nlohmann::json::parse(std::ifstream(vision_dir() + "/golden.json"))["prompts"]["p2"];
  const std::vector<int32_t> ids = p2["prompt_ids"].get<std::vector<int32_t>>();
  Engine one_shot(options());
  const Outcome want = run(one_shot, ids, {image("a"), image("b")});
  EXPECT_EQ(want.last.prompt_tokens, p2["length"].get<int64_t>());
  EXPECT_EQ(want.tokens, p2["greedy"]["tokens"].get<std::vector<int32_t>>());
  for (const int64_t chunk : {1, 5, 30}) {
    Engine chunked(options(chunk));
    const Outcome got = run(chunked, ids, {image("a"), image("b")});
    EXPECT_EQ(got.tokens, want.tokens) << "chunk " << chunk;
    EXPECT_EQ(got.rows, want.rows) << "chunk " << chunk;
  }
}

// DSpark on a prompt with images: the drafter seeds its windows from the taps at every position,
// the spans' included, drafts text only, and greedy speculative decoding gives the reference's tokens.
TEST(EngineVision, SpeculativeDecodingAfterImagesKeepsTheGreedyTokens) {
  const nlohmann::json p2 = nlohmann::json::parse(std::ifstream(vision_dir() + "/golden.json"))["prompts"]["p2"];
  Engine e(options());
  RequestParams p;
  p.prompt = p2["prompt_ids"].get<std::vector<int32_t>>();
  p.images = {image("a"), image("b")};
  p.max_tokens = 8;
  p.ignore_eos = true;
  p.speculative = SpeculativeMethod::DSpark;
  p.acceptance_guard = false;  // draft at every step, so verification runs throughout
  Collected c;
  e.submit(p, collect(c));
  wait(c);
  ASSERT_EQ(c.last.finish_reason, FinishReason::Length) << c.last.error;
  EXPECT_EQ(c.tokens, p2["greedy"]["tokens"].get<std::vector<int32_t>>());
  EXPECT_GT(c.last.report.verify_steps, 0);
}

TEST(EngineVision, PlaceholdersAndImagesMustPairUp) {
  Engine e(options());
  const auto refused = [&](std::vector<int32_t> prompt, std::vector<ImageInput> images, const std::string& what) {
    RequestParams p;
    p.prompt = std::move(prompt);
    p.images = std::move(images);
    try {
      e.submit(p, [](const TokenEvent&) {});
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(what), std::string::npos) << err.what();
    }
  };
  refused({0, 5, kImage, 6}, {}, "placeholder");
  refused({0, 5, 6}, {image("a")}, "1 image(s) for 0 placeholder(s)");
  refused({0, kImage, kImage}, {image("a")}, "1 image(s) for 2 placeholder(s)");
  ImageInput broken = image("a");
  broken.patches.pop_back();
  refused({0, kImage}, {broken}, "patches");
  // too long once expanded: image b takes 44 positions of the context of 160
  refused({0, kImage, kImage, kImage, kImage}, {image("b"), image("b"), image("b"), image("b")}, "context");
  // a checkpoint without a tower
  EngineOptions text_only;
  text_only.model_dir = test::golden_dir("tiny-dense");
  Engine t(text_only);
  RequestParams p;
  p.prompt = {0, 5, 6};
  p.images = {image("a")};
  EXPECT_THROW(t.submit(p, [](const TokenEvent&) {}), Error);
}

// A prompt of text, an image, then text past the first block: the second run restores the first
// block from the cache (the image's span inside it) and computes what a cold run computes; the same
// prompt with another image in the same place shares no block with it.
void expect_cache_keys_spans_by_content(CacheMode mode, int64_t text_before) {
  std::vector<int32_t> prompt = {0};
  const std::vector<int32_t> before = ids(static_cast<int>(text_before), 7), after = ids(60, 8);
  for (int32_t& t : prompt) t %= 500;
  for (int32_t t : before) prompt.push_back(t % 500);
  prompt.push_back(kImage);
  for (int32_t t : after) prompt.push_back(t % 500);

  Engine cold(options());  // a fresh engine: nothing cached
  const Outcome want = run(cold, prompt, {image("a")});
  EngineOptions o = options();
  o.cache_mode = mode;
  Engine e(o);
  run(e, prompt, {image("a")});
  const Outcome again = run(e, prompt, {image("a")});
  EXPECT_EQ(again.last.cached_tokens, 64);
  EXPECT_EQ(again.tokens, want.tokens);
  if (mode == CacheMode::Exact) {
    EXPECT_EQ(again.rows, want.rows);
  }
  // image c in place of a: its span's key tokens differ, so the block holding it is not a hit
  const Outcome other = run(e, prompt, {image("c")});
  EXPECT_EQ(other.last.cached_tokens, 0);
  Engine cold_c(options());
  EXPECT_EQ(other.tokens, run(cold_c, prompt, {image("c")}).tokens);
}

TEST(EngineVision, TheExactCacheKeysASpanByItsImage) { expect_cache_keys_spans_by_content(CacheMode::Exact, 10); }

// Replay mode re-runs the last window (16 positions) before the boundary at 64; with the span at
// 41..57 the replay would start inside it, so it starts at the span's start and replays 23.
TEST(EngineVision, AReplayStartsWhereItCutsNoSpan) {
  expect_cache_keys_spans_by_content(CacheMode::Replay, 40);
  EngineOptions o = options();
  o.cache_mode = CacheMode::Replay;
  Engine e(o);
  std::vector<int32_t> prompt = {0};
  for (int32_t t : ids(40, 7)) prompt.push_back(t % 500);
  prompt.push_back(kImage);
  for (int32_t t : ids(60, 8)) prompt.push_back(t % 500);
  run(e, prompt, {image("a")});
  const Outcome again = run(e, prompt, {image("a")});
  EXPECT_EQ(again.last.cached_tokens, 64);
  EXPECT_EQ(again.last.report.replayed_tokens, 64 - 41);
}

}  // namespace
}  // namespace dsv41
