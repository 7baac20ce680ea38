// Images in chat requests (server/image_parts.h): image_url parts with base64 data: URLs reach the
// model as spans (a request's usage counts them), images in tool results too; remote URLs, broken,
// truncated, oversized and decompression-bomb images, too many images, and images sent to a model
// without a tower are each a 400 naming the problem, and the server goes on serving. The official
// openai npm client sends one too (tests/npm/openai_vision.mjs).
#include <gtest/gtest.h>

#include <boost/beast/core/detail/base64.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "http_lib.h"
#include "server/http_server.h"
#include "server_util.h"
#include "test_util.h"

namespace dsv41::server {
namespace {

using json = nlohmann::json;

// The golden images; the model is the tiny preset with a tower (the golden tiny-vision's tokenizer has
// no byte tokens, so chat text would not tokenize), whose image plan is tiny-vision's.
std::string images_dir() { return test::golden_dir("tiny-vision") + "/images"; }

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string base64(const std::string& bytes) {
  namespace b64 = boost::beast::detail::base64;
  std::string out(b64::encoded_size(bytes.size()), '\0');
  out.resize(b64::encode(out.data(), bytes.data(), bytes.size()));
  return out;
}

std::string png_url(const std::string& bytes) { return "data:image/png;base64," + base64(bytes); }
std::string ring_png() { return file_bytes(images_dir() + "/c_rings_400x300.png"); }

json image_part(const std::string& url) { return {{"type", "image_url"}, {"image_url", {{"url", url}}}}; }

json chat_with(const json& content, int max_tokens = 4) {
  return {{"messages", json::array({{{"role", "user"}, {"content", content}}})},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"ignore_eos", true}};
}

EngineOptions vision_options() {
  EngineOptions eo;
  eo.model_dir = test::tiny_vision_model_dir();
  eo.parallel = 2;
  return eo;
}

// A PNG signature and an IHDR chunk (its CRC right) claiming width × height RGB pixels, then nothing.
std::string png_header_claiming(uint32_t width, uint32_t height) {
  const auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
  };
  std::string chunk = "IHDR" + be32(width) + be32(height) + std::string{8, 2, 0, 0, 0};
  uint32_t crc = 0xFFFFFFFFu;  // CRC-32 (IEEE) of type and data
  for (unsigned char c : chunk) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return std::string("\x89PNG\r\n\x1a\n", 8) + be32(13) + chunk + be32(~crc);
}

TEST(ServerVision, AnImagePartReachesTheModelAsItsSpan) {
  LiveServer s(vision_options());
  const Reply text_only = post(s.port(), "/v1/chat/completions", chat_with(json::array({{{"type", "text"}, {"text", "What is this?"}}})));
  ASSERT_EQ(text_only.status, 200) << text_only.raw;
  const json with_image = json::array({{{"type", "text"}, {"text", "What is this?"}}, image_part(png_url(ring_png()))});
  const Reply r = post(s.port(), "/v1/chat/completions", chat_with(with_image));
  ASSERT_EQ(r.status, 200) << r.raw;
  // image c's span is 42 positions (tiny-vision README); the part joins the text with "\n\n"
  const int64_t grew = r.body["usage"]["prompt_tokens"].get<int64_t>() - text_only.body["usage"]["prompt_tokens"].get<int64_t>();
  EXPECT_GE(grew, 42);
  EXPECT_LE(grew, 42 + 4);
  // greedy: the same request streamed gives the same text
  json streamed = chat_with(with_image);
  streamed["stream"] = true;
  const Stream st = post_stream(s.port(), "/v1/chat/completions", streamed);
  ASSERT_EQ(st.status, 200) << st.raw;
  // a random model may answer in its reasoning or its content: both are the answer's text
  std::string text;
  for (const json& e : st.events) {
    if (e["choices"].empty()) continue;
    const json& delta = e["choices"][0]["delta"];
    text += delta.value("reasoning_content", "") + delta.value("content", "");
  }
  const json& message = r.body["choices"][0]["message"];
  const std::string answer = (message.contains("reasoning_content") && message["reasoning_content"].is_string()
                                  ? message["reasoning_content"].get<std::string>()
                                  : std::string()) +
                             (message["content"].is_string() ? message["content"].get<std::string>() : std::string());
  EXPECT_FALSE(answer.empty()) << r.raw;
  EXPECT_EQ(text, answer);
  // an image inside a tool result is placed there by the chat encoding and seen the same way
  json tool_chat = {{"messages", json::array({{{"role", "user"}, {"content", "Look at the picture the tool returns."}},
                                              {{"role", "assistant"}, {"content", ""}, {"tool_calls", json::array({{{"id", "c1"}, {"type", "function"}, {"function", {{"name", "camera"}, {"arguments", "{}"}}}}})}},
                                              {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", json::array({image_part(png_url(ring_png()))})}}})},
                    {"max_tokens", 2},
                    {"temperature", 0}};
  const Reply tool = post(s.port(), "/v1/chat/completions", tool_chat);
  ASSERT_EQ(tool.status, 200) << tool.raw;
  EXPECT_GE(tool.body["usage"]["prompt_tokens"].get<int64_t>(), 42);
}

TEST(ServerVision, BadImagesAre400sAndTheServerGoesOn) {
  ServerOptions so;
  so.images.max_images = 2;
  LiveServer s(vision_options(), so);
  const std::string png = ring_png();
  const auto refused = [&](const json& content, const std::string& says) {
    const auto t0 = std::chrono::steady_clock::now();
    const Reply r = post(s.port(), "/v1/chat/completions", chat_with(content));
    EXPECT_EQ(r.status, 400) << says << ": " << r.raw;
    EXPECT_NE(r.raw.find(says), std::string::npos) << r.raw;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0) << says;
  };
  refused(json::array({image_part("https://example.com/cat.png")}), "not fetched");
  refused(json::array({image_part("file:///etc/passwd")}), "base64 data: URL");
  refused(json::array({image_part("data:image/png,rawbytes")}), "must be base64");
  refused(json::array({image_part("data:image/png;base64,@@@@")}), "not valid base64");
  refused(json::array({image_part(png_url("this is not an image at all"))}), "image");
  refused(json::array({image_part(png_url(png.substr(0, png.size() / 2)))}), "image");  // truncated
  refused(json::array({image_part(png_url(png.substr(0, 40)))}), "image");              // header only
  refused(json::array({image_part(png_url(png_header_claiming(100000, 100000)))}), "pixels");  // a bomb
  refused(json::array({image_part(png_url(png)), image_part(png_url(png)), image_part(png_url(png))}), "at most 2");
  // the placeholder typed as text cannot forge an image
  refused(json::array({{{"type", "text"}, {"text", "<｜deepseek_image｜>"}}}), "placeholder");
  // after all that, an image request still works
  const Reply ok = post(s.port(), "/v1/chat/completions", chat_with(json::array({image_part(png_url(png))})));
  EXPECT_EQ(ok.status, 200) << ok.raw;
}

// --max-image-pixels bounds the pixels of all images of one request together, from their headers and
// before any is decoded: eight images of the cap each would otherwise cost eight times the cap.
TEST(ServerVision, ThePixelCapIsPerRequestNotPerImage) {
  const std::string png = ring_png();  // 400 x 300
  ServerOptions so;
  so.images.decode.max_pixels = 2 * 400 * 300;
  LiveServer s(vision_options(), so);
  const Reply two = post(s.port(), "/v1/chat/completions", chat_with(json::array({image_part(png_url(png)), image_part(png_url(png))})));
  EXPECT_EQ(two.status, 200) << two.raw;
  const json three = json::array({image_part(png_url(png)), image_part(png_url(png)), image_part(png_url(png))});
  const Reply r = post(s.port(), "/v1/chat/completions", chat_with(three));
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_NE(r.raw.find("360000 pixels in all, over the limit of 240000 pixels per request"), std::string::npos) << r.raw;
  // a header-only image counts from its header: the total is refused before anything is decoded
  const json bombs = json::array({image_part(png_url(png)), image_part(png_url(png_header_claiming(400, 300))),
                                  image_part(png_url(png_header_claiming(400, 300)))});
  const Reply b = post(s.port(), "/v1/chat/completions", chat_with(bombs));
  EXPECT_EQ(b.status, 400) << b.raw;
  EXPECT_NE(b.raw.find("over the limit of 240000 pixels per request"), std::string::npos) << b.raw;
}

TEST(ServerVision, AModelWithoutATowerRefusesImages) {
  LiveServer s(tiny_engine_options());
  const Reply r = post(s.port(), "/v1/chat/completions", chat_with(json::array({image_part(png_url(ring_png()))})));
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_NE(r.raw.find("vision"), std::string::npos) << r.raw;
}

TEST(ServerVision, OfficialOpenAIClientSendsAnImage) {
  const std::filesystem::path npm_dir = std::filesystem::path(test::source_dir()) / "tests" / "npm";
  const char* require = std::getenv("DSV41_REQUIRE_NPM");
  const bool required = require != nullptr && std::string(require) == "1";
  if (!std::filesystem::exists(npm_dir / "node_modules" / "openai" / "package.json") ||
      std::system("node --version > /dev/null 2>&1") != 0) {
    if (required) FAIL() << "DSV41_REQUIRE_NPM=1 but node or the openai package is missing";
    GTEST_SKIP() << "node or the openai npm package is not installed (npm ci in tests/npm)";
  }
  LiveServer s(vision_options());
  const std::string cmd = "cd '" + npm_dir.string() + "' && DSV41_BASE_URL='" + s.url() + "/v1' DSV41_MODEL='" +
                          s.engine().model_name() + "' DSV41_IMAGE='" + images_dir() +
                          "/c_rings_400x300.png' node openai_vision.mjs";
  const test::CommandResult r = test::run_shell(cmd);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("all checks passed"), std::string::npos) << r.out;
}

// The official @anthropic-ai/sdk client sends an image as a base64 block (tests/npm/anthropic_client.mjs).
TEST(ServerVision, OfficialAnthropicClientSendsAnImage) {
  const std::filesystem::path npm_dir = std::filesystem::path(test::source_dir()) / "tests" / "npm";
  const char* require = std::getenv("DSV41_REQUIRE_NPM");
  const bool required = require != nullptr && std::string(require) == "1";
  if (!std::filesystem::exists(npm_dir / "node_modules" / "@anthropic-ai" / "sdk" / "package.json") ||
      std::system("node --version > /dev/null 2>&1") != 0) {
    if (required) FAIL() << "DSV41_REQUIRE_NPM=1 but node or the @anthropic-ai/sdk package is missing";
    GTEST_SKIP() << "node or the @anthropic-ai/sdk npm package is not installed (npm ci in tests/npm)";
  }
  LiveServer s(vision_options());
  const std::string cmd = "cd '" + npm_dir.string() + "' && DSV41_BASE_URL='" + s.url() + "' DSV41_MODEL='" +
                          s.engine().model_name() + "' DSV41_IMAGE='" + images_dir() +
                          "/c_rings_400x300.png' node anthropic_client.mjs";
  const test::CommandResult r = test::run_shell(cmd);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("all checks passed"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace dsv41::server
