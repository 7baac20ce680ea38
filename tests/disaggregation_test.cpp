// Prefill/decode disaggregation on loopback: `serve --role prefill` and `serve --role decode
// --prefill-peer ADDR`, started on their own, answer as one server does, with the prompt's state
// handed over exact (window rings included) or for replay (the decode side replays the last
// window). A prefill server that dies, before or during a handover, or that serves another model,
// costs the decode server a local prefill and the client nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <fstream>
#include <future>
#include <iterator>
#include <optional>
#include <string>
#include <thread>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/synthetic_checkpoint.h"
#include "runtime/engine.h"
#include "state/disk_cache.h"
#include "transfer/peer_backoff.h"
#include "serve_process.h"
#include "server_util.h"
#include "test_util.h"

namespace dsv41::server {
namespace {

// The handover address a prefill server printed in its first line.
std::string handover_address(const ServeProcess& p) {
  const std::string key = "handover on ucx ";
  const size_t at = p.first_line().find(key);
  if (at == std::string::npos) return "";
  const size_t end = p.first_line().find(')', at);
  return p.first_line().substr(at + key.size(), end - at - key.size());
}

// A prompt of about 1,400 tokens: 21 whole blocks the prefill server can take.
json long_chat(int max_tokens, bool stream = false, const std::string& word = "river") {
  std::string text;
  for (int i = 0; i < 120; ++i) text += "word" + std::to_string(i) + " " + word + " stone ";
  json body = {{"messages", {{{"role", "user"}, {"content", text}}}},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"ignore_eos", true}};
  if (stream) body["stream"] = true;
  return body;
}

std::string chat_text(int port, const json& body) {
  const Reply r = post(port, "/v1/chat/completions", body);
  EXPECT_EQ(r.status, 200) << r.raw;
  return r.status == 200 ? r.body["choices"][0]["message"]["content"].get<std::string>() : "";
}

std::string completion_text(int port, const json& body) {
  const Reply r = post(port, "/v1/completions", body);
  EXPECT_EQ(r.status, 200) << r.raw;
  return r.status == 200 ? r.body["choices"][0]["text"].get<std::string>() : "";
}

std::string streamed_text(int port, const json& body) {
  const Stream s = post_stream(port, "/v1/chat/completions", body);
  EXPECT_EQ(s.status, 200) << s.raw;
  std::string text;
  for (const json& e : s.events) {
    if (e.contains("choices") && !e["choices"].empty() && e["choices"][0]["delta"].contains("content"))
      text += e["choices"][0]["delta"]["content"].get<std::string>();
  }
  return text;
}

double metric(int port, const std::string& name) {
  const std::string text = request(port, "GET", "/metrics").raw;
  const size_t at = text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 2));
}

TEST(PrefillDecode, ChatAndStreamGiveTheSingleServerAnswersInBothModes) {
  std::string want, want_streamed;
  {
    ServeProcess single(test::tiny_model_dir(), "");
    ASSERT_GT(single.port(), 0) << single.first_line();
    want = chat_text(single.port(), long_chat(16));
    want_streamed = streamed_text(single.port(), long_chat(12, true));
  }
  ServeProcess prefill(test::tiny_model_dir(), "--role prefill");
  ASSERT_GT(prefill.port(), 0) << prefill.first_line();
  const std::string peer = handover_address(prefill);
  ASSERT_FALSE(peer.empty()) << prefill.first_line();
  for (const std::string mode : {"exact", "replay"}) {
    SCOPED_TRACE(mode);
    ServeProcess decode(test::tiny_model_dir(), "--role decode --prefill-peer " + peer + " --handover " + mode);
    ASSERT_GT(decode.port(), 0) << decode.first_line();
    const Reply r = post(decode.port(), "/v1/chat/completions", long_chat(16));
    ASSERT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(r.body["choices"][0]["message"]["content"].get<std::string>(), want);
    // the prompt's blocks came from the prefill server (reported as cached: not computed here)
    const int64_t prompt = r.body["usage"]["prompt_tokens"].get<int64_t>();
    EXPECT_EQ(r.body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), (prompt - 1) / 64 * 64);
    // the same prompt again: the handed state is this server's now (an agent's next turn asks the
    // prefill server for nothing it holds)
    EXPECT_EQ(streamed_text(decode.port(), long_chat(12, true)), want_streamed);
    EXPECT_EQ(metric(decode.port(), "dsv41_handovers_total"), 1);
    EXPECT_EQ(metric(decode.port(), "dsv41_handover_fallbacks_total"), 0);
    // the wire carries the global rows of the handed tokens and the fixed state, no more
    const double bytes = metric(decode.port(), "dsv41_handover_bytes_total");
    const double tokens = metric(decode.port(), "dsv41_handover_tokens_total");
    EXPECT_GT(bytes, 0);
    EXPECT_EQ(tokens, static_cast<double>((prompt - 1) / 64 * 64));
    if (mode == "replay") continue;
    // A tenant's turn (cache_salt): both servers hold the prompt in the shared namespace only, so the
    // decode server asks again, and the prefill server, told the namespace, computes it again.
    const double prefill_cached = metric(prefill.port(), "dsv41_cached_tokens_total");
    json salted = long_chat(16);
    salted["cache_salt"] = "tenant-a";
    const Reply t = post(decode.port(), "/v1/chat/completions", salted);
    ASSERT_EQ(t.status, 200) << t.raw;
    EXPECT_EQ(t.body["choices"][0]["message"]["content"].get<std::string>(), want);
    EXPECT_EQ(metric(decode.port(), "dsv41_handovers_total"), 2);
    EXPECT_EQ(metric(prefill.port(), "dsv41_cached_tokens_total"), prefill_cached)
        << "the prefill server must not serve a salted request from the shared namespace";
  }
}

// DSpark on the decode side after an exact handover, on the trained model (whose drafts are
// accepted): the prefill server hands the drafter's rings over with the rest, so the decode server
// drafts, and has accepted, exactly what a single server speculating on the same prompt does.
TEST(PrefillDecode, SpeculativeDecodingAfterAHandoverDraftsAsASingleServer) {
  const std::string model = test::source_dir() + "/models/brown-tiny";
  std::ifstream heldout(model + "/heldout.txt");
  std::string text(4000, '\0');
  heldout.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(heldout.gcount()));
  // 10 blocks and 2 tokens: the decode server prefills 2 tokens itself, so 14 of the drafter's 16
  // ring rows (brown-tiny's window) can only come from the handover
  json body = {{"prompt", text}, {"max_tokens", 48}, {"temperature", 0}, {"ignore_eos", true},
               {"speculative", "dspark"}, {"acceptance_guard", false}};
  const std::vector<std::string> counters = {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                                             "vllm:spec_decode_num_accepted_tokens_total"};
  std::string want;
  std::vector<double> want_counts;
  {
    ServeProcess single(model, "");
    ASSERT_GT(single.port(), 0) << single.first_line();
    const Reply ids = post(single.port(), "/tokenize", {{"prompt", text}});
    ASSERT_EQ(ids.status, 200) << ids.raw;
    std::vector<int32_t> prompt = ids.body["tokens"].get<std::vector<int32_t>>();
    ASSERT_GT(prompt.size(), 642u);
    prompt.resize(642);
    body["prompt"] = prompt;
    want = completion_text(single.port(), body);
    for (const std::string& c : counters) want_counts.push_back(metric(single.port(), c));
  }
  ASSERT_GT(want_counts[2], 0) << "the trained drafter accepts nothing here: the comparison would prove nothing";
  ServeProcess prefill(model, "--role prefill");
  ASSERT_GT(prefill.port(), 0) << prefill.first_line();
  ServeProcess decode(model, "--role decode --prefill-peer " + handover_address(prefill));
  ASSERT_GT(decode.port(), 0) << decode.first_line();
  EXPECT_EQ(completion_text(decode.port(), body), want);
  EXPECT_EQ(metric(decode.port(), "dsv41_handovers_total"), 1);
  for (size_t i = 0; i < counters.size(); ++i) EXPECT_EQ(metric(decode.port(), counters[i]), want_counts[i]) << counters[i];
}

// What a prefill server hands over, section by section: exact carries every layer's window ring,
// the drafter's among them; replay carries no ring at all.
TEST(PrefillDecode, AnExactHandoverCarriesTheDraftersRingsAndReplayNoRing) {
  const std::string model = test::source_dir() + "/models/brown-tiny";
  EngineOptions eo;
  eo.model_dir = model;
  eo.parallel = 1;
  Engine engine(eo);
  const ModelConfig& c = engine.config();
  const std::string fingerprint = model_fingerprint(load_config(model), Checkpoint(model).fingerprint());
  std::vector<int32_t> prompt;
  for (int i = 0; i < 640; ++i) prompt.push_back(100 + (i * 37) % 500);
  for (const CacheMode mode : {CacheMode::Exact, CacheMode::Replay}) {
    RequestParams p;
    p.prompt = prompt;
    p.max_tokens = 0;
    p.export_state = mode;
    std::promise<TokenEvent> done;
    engine.submit(p, [&done](const TokenEvent& e) {
      if (e.done) done.set_value(e);
    });
    const TokenEvent e = done.get_future().get();
    ASSERT_TRUE(e.exported_state) << e.error;
    std::string why;
    const std::optional<CacheEntry> entry =
        decode_cache_entry(e.exported_state->data(), e.exported_state->size(), fingerprint, "export", &why);
    ASSERT_TRUE(entry) << why;
    EXPECT_EQ(entry->tokens, prompt);
    int backbone_rings = 0, drafter_rings = 0;
    for (const CacheSection& sec : entry->sections) {
      if (sec.name != "window") continue;
      EXPECT_FALSE(sec.bytes.empty());
      (sec.layer < c.n_layers ? backbone_rings : drafter_rings) += 1;
    }
    EXPECT_EQ(backbone_rings, mode == CacheMode::Exact ? c.n_layers : 0);
    EXPECT_EQ(drafter_rings, mode == CacheMode::Exact ? c.n_mtp_layers : 0);
  }
}

TEST(PrefillDecode, APrefillServerThatDiesCostsOnlyALocalPrefill) {
  std::string want, want_other;
  {
    ServeProcess single(test::tiny_model_dir(), "");
    ASSERT_GT(single.port(), 0) << single.first_line();
    want = chat_text(single.port(), long_chat(8));
    want_other = chat_text(single.port(), long_chat(8, false, "lake"));
  }
  ServeProcess prefill(test::tiny_model_dir(), "--role prefill");
  ASSERT_GT(prefill.port(), 0) << prefill.first_line();
  ServeProcess decode(test::tiny_model_dir(), "--role decode --prefill-peer " + handover_address(prefill));
  ASSERT_GT(decode.port(), 0) << decode.first_line();
  // killed while it works on the request: the decode server sees the connection drop
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    kill(prefill.pid(), SIGKILL);
  });
  EXPECT_EQ(chat_text(decode.port(), long_chat(8)), want);
  killer.join();
  // and gone: the next prompt's handover cannot connect at all
  EXPECT_EQ(chat_text(decode.port(), long_chat(8, false, "lake")), want_other);
  EXPECT_GE(metric(decode.port(), "dsv41_handover_fallbacks_total"), 1);
  EXPECT_EQ(metric(decode.port(), "dsv41_handovers_total") + metric(decode.port(), "dsv41_handover_fallbacks_total"), 2);
}

// The client's answer to `body` and the seconds it took.
std::pair<std::string, double> timed_chat(int port, const json& body) {
  const auto start = std::chrono::steady_clock::now();
  std::string text = chat_text(port, body);
  return {text, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

std::string file_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The back-off alone, on a clock of its own: prompts that time out together start one pause; past it
// one prompt at a time tries the peer; a try that times out too doubles the pause, up to the longest;
// a try that fails otherwise lets the next prompt try; an answer ends the back-off.
TEST(PrefillDecode, TheBackoffPausesTriesOnePromptAtATimeAndDoubles) {
  using namespace std::chrono_literals;
  PeerBackoff b(10s, 30s);
  const PeerBackoff::Clock::time_point t0 = PeerBackoff::Clock::now();
  bool trying = true, other = true;
  EXPECT_EQ(b.refusal(t0, &trying), "");
  EXPECT_FALSE(trying);
  b.timed_out(t0, false);
  b.timed_out(t0 + 1s, false);  // asked before the freeze too: the same pause, not a doubled one
  EXPECT_NE(b.refusal(t0 + 10s, &trying).find("asked again in 1.0 s"), std::string::npos);
  EXPECT_EQ(b.refusal(t0 + 11s, &trying), "");
  EXPECT_TRUE(trying);
  EXPECT_NE(b.refusal(t0 + 12s, &other).find("another prompt is trying it"), std::string::npos);
  b.timed_out(t0 + 21s, true);  // 20 s
  EXPECT_NE(b.refusal(t0 + 40s, &trying), "");
  EXPECT_EQ(b.refusal(t0 + 41s, &trying), "");
  b.timed_out(t0 + 51s, true);  // 30 s, the longest
  EXPECT_NE(b.refusal(t0 + 80s, &trying), "");
  EXPECT_EQ(b.refusal(t0 + 81s, &trying), "");
  EXPECT_TRUE(trying);
  b.failed(true);  // refused at once, say: nothing paid, the next prompt tries
  EXPECT_EQ(b.refusal(t0 + 82s, &trying), "");
  EXPECT_TRUE(trying);
  b.answered();
  EXPECT_EQ(b.refusal(t0 + 82s, &trying), "");
  EXPECT_FALSE(trying);
  b.timed_out(t0 + 90s, false);  // a new freeze starts from the first pause again
  EXPECT_NE(b.refusal(t0 + 99s, &trying), "");
  EXPECT_EQ(b.refusal(t0 + 100s, &trying), "");
}

// A prefill server that stops answering (SIGSTOP: a wedged host, a long pause) costs the first long
// prompt the handover timeout and then a local prefill; while it is backed off, later prompts are
// prefilled here at once without asking it; once it runs again and the back-off has passed, prompts
// are handed over again.
TEST(PrefillDecode, AFrozenPrefillServerCostsOneTimeoutThenIsBackedOff) {
  constexpr int kTimeout = 3;  // long enough for the try after the back-off to be answered on a loaded machine
  std::vector<std::string> want;
  double local_s = 0;
  {
    ServeProcess single(test::tiny_model_dir(), "");
    ASSERT_GT(single.port(), 0) << single.first_line();
    for (const std::string word : {"river", "lake", "sea"}) {
      const auto [text, s] = timed_chat(single.port(), long_chat(4, false, word));
      want.push_back(text);
      local_s = std::max(local_s, s);
    }
  }
  test::TempDir dir;
  ServeProcess prefill(test::tiny_model_dir(), "--role prefill");
  ASSERT_GT(prefill.port(), 0) << prefill.first_line();
  ServeProcess decode(test::tiny_model_dir(), "--role decode --prefill-peer " + handover_address(prefill) +
                                                  " --handover-timeout " + std::to_string(kTimeout) + " 2>" + dir / "decode.log");
  ASSERT_GT(decode.port(), 0) << decode.first_line();
  kill(prefill.pid(), SIGSTOP);
  std::future<std::pair<std::string, double>> first =
      std::async(std::launch::async, [&] { return timed_chat(decode.port(), long_chat(4, false, "river")); });
  if (first.wait_for(std::chrono::seconds(kTimeout + 8)) != std::future_status::ready) {
    ADD_FAILURE() << "the prompt still waits for the frozen prefill server " << kTimeout + 8 << " s on";
    kill(prefill.pid(), SIGCONT);
  }
  const auto [text, first_s] = first.get();
  EXPECT_EQ(text, want[0]);
  EXPECT_GE(first_s, kTimeout - 0.5);
  EXPECT_LT(first_s, kTimeout + 2 + local_s);
  // still frozen: the next prompt does not ask it, and pays nothing for it
  const auto [second, second_s] = timed_chat(decode.port(), long_chat(4, false, "lake"));
  EXPECT_EQ(second, want[1]);
  EXPECT_LT(second_s, kTimeout - 1 + local_s);
  EXPECT_EQ(metric(decode.port(), "dsv41_handovers_total"), 0);
  EXPECT_EQ(metric(decode.port(), "dsv41_handover_fallbacks_total"), 2);
  const std::string log = file_text(dir / "decode.log");
  EXPECT_NE(log.find("timed out"), std::string::npos) << log;
  EXPECT_NE(log.find("not asked"), std::string::npos) << log;
  // running again and past the back-off: asked again, and it answers
  kill(prefill.pid(), SIGCONT);
  std::this_thread::sleep_for(std::chrono::seconds(kTimeout));
  EXPECT_EQ(chat_text(decode.port(), long_chat(4, false, "sea")), want[2]);
  EXPECT_EQ(metric(decode.port(), "dsv41_handovers_total"), 1) << file_text(dir / "decode.log");
}

// SIGTERM during a freeze: the decode server, whose request waits on the frozen prefill server, stops
// at once; the prefill server, told while it is stopped, stops as soon as it runs again. A prefill
// server started again on the same handover port binds it at once (no wait for TIME_WAIT sockets).
TEST(PrefillDecode, SigtermStopsBothServersDuringAFreezeAndTheHandoverPortIsReusedAtOnce) {
  std::future<Reply> client;  // destroyed last: its request ends when the decode server does
  std::optional<ServeProcess> prefill;
  prefill.emplace(test::tiny_model_dir(), "--role prefill");
  ASSERT_GT(prefill->port(), 0) << prefill->first_line();
  const std::string peer = handover_address(*prefill);
  ServeProcess decode(test::tiny_model_dir(), "--role decode --prefill-peer " + peer);
  ASSERT_GT(decode.port(), 0) << decode.first_line();
  EXPECT_EQ(post(decode.port(), "/v1/chat/completions", long_chat(4)).status, 200);  // a handover: a connection came and went
  EXPECT_EQ(metric(decode.port(), "dsv41_handovers_total"), 1);
  kill(prefill->pid(), SIGSTOP);
  client = std::async(std::launch::async, [&] { return post(decode.port(), "/v1/chat/completions", long_chat(4, false, "lake")); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the request waits on the frozen server
  EXPECT_NE(decode.stop(SIGTERM, 5), -1) << "the decode server did not stop within 5 s of SIGTERM";
  kill(prefill->pid(), SIGTERM);
  kill(prefill->pid(), SIGCONT);
  EXPECT_NE(prefill->wait(5), -1) << "the prefill server did not stop within 5 s of SIGTERM and SIGCONT";
  prefill.reset();
  ServeProcess again(test::tiny_model_dir(), "--role prefill --handover-listen " + peer);
  EXPECT_GT(again.port(), 0) << "a prefill server could not listen on " << peer << " again at once";
  EXPECT_EQ(handover_address(again), peer);
}

// A prefill server with other weights hands over state stamped with another fingerprint: refused
// on arrival, never decoded.
TEST(PrefillDecode, StateOfAnotherModelIsRefused) {
  test::TempDir other;
  write_synthetic_checkpoint(other.path(), "tiny", 1);
  std::string want;
  {
    ServeProcess single(test::tiny_model_dir(), "");
    ASSERT_GT(single.port(), 0) << single.first_line();
    want = chat_text(single.port(), long_chat(8));
  }
  ServeProcess prefill(other.path(), "--role prefill");
  ASSERT_GT(prefill.port(), 0) << prefill.first_line();
  ServeProcess decode(test::tiny_model_dir(), "--role decode --prefill-peer " + handover_address(prefill));
  ASSERT_GT(decode.port(), 0) << decode.first_line();
  EXPECT_EQ(chat_text(decode.port(), long_chat(8)), want);
  EXPECT_EQ(metric(decode.port(), "dsv41_handovers_total"), 0);
  EXPECT_EQ(metric(decode.port(), "dsv41_handover_fallbacks_total"), 1);
}

TEST(PrefillDecode, FlagsOutOfTheirRoleAreRefused) {
  const std::string model = "serve -m '" + test::tiny_model_dir() + "' --port 0 ";
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--prefill-peer 127.0.0.1:9", "--prefill-peer"},
           {"--role decode", "--prefill-peer"},
           {"--role decode --prefill-peer nowhere", "HOST:PORT"},
           {"--role decode --prefill-peer 127.0.0.1:9 --handover all", "exact"},
           {"--role prefill --handover replay", "--handover"},
           {"--role relay", "--role"}}) {
    const test::CommandResult r = test::run_dsv41(model + args);
    EXPECT_EQ(r.status, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << "\n" << r.out;
  }
}

}  // namespace
}  // namespace dsv41::server
