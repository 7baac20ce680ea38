// dsv41 chat: an interactive conversation in the terminal over the same Engine the server uses.
// Each turn renders the whole history with the V4.1 chat encoder and submits it; the engine's prefix
// cache finds the earlier turns' state, so a turn costs its new tokens. Ctrl-C stops the answer being
// written (the request is cancelled) and returns to the prompt; Ctrl-D or /exit leaves.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "backend_env.h"
#include "cli.h"
#include "commands.h"
#include "runtime/engine.h"
#include "text/chat_encoding.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 chat -m DIR [options]

  -m, --model DIR        model folder
      --thinking on|off  start with reasoning on or off (default on; /think on|off changes it)
      --max-tokens N     longest answer per turn (default 1024)
      --temperature T    sampling temperature (default 0: greedy)
      --system TEXT      a system prompt for the conversation
      --ignore-eos       keep writing past the end-of-sequence token (for measuring)
      --ram SIZE         memory budget the model's load follows, e.g. 16G (default: the available RAM, or the
                         memory cgroup's limit when lower; above that limit it is refused; `dsv41 plan`
                         shows the plan)

At the prompt: a line is your message; /reset starts a new conversation; /think on|off turns
reasoning on or off; /exit or Ctrl-D leaves. Ctrl-C stops the answer being written.
After each answer a line on stderr gives its prompt, cached and generated tokens and its speed.
Special tokens written in your messages are plain text, as in `dsv41 serve`; the model's answers go
back into the conversation with their special tokens as it wrote them.
)";

// `text` with every invalid UTF-8 sequence (a cut token's partial bytes) replaced by U+FFFD, so it
// can go back into a JSON history.
std::string valid_utf8(const std::string& text) {
  return nlohmann::json::parse(nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace))
      .get<std::string>();
}

// The reasoning and the answer of an output that may hold "</think>" (thinking on: the prompt
// ends inside the reasoning).
std::pair<std::string, std::string> split_reasoning(const std::string& out, bool thinking) {
  if (!thinking) return {"", out};
  const size_t end = out.find("</think>");
  if (end == std::string::npos) return {out, ""};
  return {out.substr(0, end), out.substr(end + 8)};
}

}  // namespace

int run_chat(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Args args("chat", argc, argv, {"--model", "--thinking", "--max-tokens", "--temperature", "--system", "--ram"}, {"--ignore-eos"},
            {{"-m", "--model"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const std::string thinking_flag = args.get("--thinking", "on");
  if (thinking_flag != "on" && thinking_flag != "off") fail("--thinking", "must be on or off, got \"" + thinking_flag + "\"");
  bool thinking = thinking_flag == "on";
  const int64_t max_tokens = args.get_int("--max-tokens", 1024, 1, int64_t{1} << 30);
  const double temperature = args.get_number("--temperature", 0);
  if (!(temperature >= 0 && temperature <= 2)) fail("--temperature", "must be in [0, 2]");
  const std::string system = args.get("--system");

  // Ctrl-C is taken by one thread with sigwait, so the mask must be set before the engine's threads
  // exist and inherit it; the thread cancels the answer being written. A shell starts background
  // commands with SIGINT ignored, and an ignored signal never reaches sigwait, so the default
  // disposition comes back first (blocked, the signal only waits for the thread).
  std::signal(SIGINT, SIG_DFL);
  sigset_t interrupt;
  sigemptyset(&interrupt);
  sigaddset(&interrupt, SIGINT);
  pthread_sigmask(SIG_BLOCK, &interrupt, nullptr);

  EngineOptions eo;
  eo.model_dir = args.required("--model");
  eo.parallel = 1;
  eo.ram_bytes = ram_flag(args);
  eo.backend = backend_from_environment();
  Engine engine(eo);
  const bool tty = isatty(fileno(stdin)) != 0;

  std::atomic<uint64_t> current{0};  // the request being answered, 0 for none
  std::atomic<bool> leaving{false};
  std::thread waiter([&] {
    for (;;) {
      int sig = 0;
      sigwait(&interrupt, &sig);
      if (leaving) return;
      if (const uint64_t id = current.load()) engine.cancel(id);
    }
  });
  struct StopWaiter {  // however the loop ends, the waiter is woken and joined
    std::atomic<bool>& leaving;
    std::thread& waiter;
    ~StopWaiter() {
      leaving = true;
      pthread_kill(waiter.native_handle(), SIGINT);
      waiter.join();
    }
  } stop_waiter{leaving, waiter};

  nlohmann::ordered_json history = nlohmann::ordered_json::array();
  auto reset = [&] {
    history = nlohmann::ordered_json::array();
    if (!system.empty()) history.push_back({{"role", "system"}, {"content", system}});
  };
  reset();
  for (std::string line;;) {
    if (tty) std::fputs("> ", stdout), std::fflush(stdout);
    if (!std::getline(std::cin, line) || line == "/exit") break;
    if (line.empty()) continue;
    if (line == "/reset") {
      reset();
      std::fprintf(stderr, "[new conversation]\n");
      continue;
    }
    if (line == "/think on" || line == "/think off") {
      thinking = line == "/think on";
      std::fprintf(stderr, "[reasoning %s]\n", thinking ? "on" : "off");
      continue;
    }
    if (line[0] == '/') {
      std::fprintf(stderr, "[unknown command %s: /reset, /think on|off, /exit]\n", line.c_str());
      continue;
    }
    history.push_back({{"role", "user"}, {"content", valid_utf8(line)}});
    ChatOptions co;
    co.thinking = thinking;
    // The assistant turns are this process's own answers, never a client's: the special tokens the
    // model wrote go back as tokens, not spelled out in characters (which would also lengthen the
    // prompt several times over for a model that writes many). What the person types stays plain.
    co.special_tokens_in.assistant = true;
    nlohmann::ordered_json request = nlohmann::ordered_json::object();
    request["messages"] = history;
    ChatPrompt prompt;
    try {
      prompt = render_chat(request, co);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[cannot render the conversation: %s]\n", e.what());
      history.erase(history.size() - 1);
      continue;
    }
    RequestParams p;
    p.prompt = engine.tokenizer().encode(prompt.text, prompt.plain_spans);
    p.max_tokens = std::min<int64_t>(max_tokens, engine.config().max_seq_len - static_cast<int64_t>(p.prompt.size()));
    p.sampling.temperature = temperature;
    p.sampling.seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    p.ignore_eos = args.has("--ignore-eos");
    if (p.max_tokens < 1) {
      std::fprintf(stderr, "[the conversation fills the model's context (%lld tokens): /reset]\n",
                   static_cast<long long>(engine.config().max_seq_len));
      history.erase(history.size() - 1);
      continue;
    }

    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    TokenEvent last;
    std::string out;
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t id = 0;
    try {
      id = engine.submit(p, [&](const TokenEvent& e) {
        std::fwrite(e.text.data(), 1, e.text.size(), stdout);
        std::fflush(stdout);
        std::lock_guard<std::mutex> lock(mu);
        out += e.text;
        if (e.done) {
          last = e;
          done = true;
          cv.notify_all();
        }
      });
    } catch (const Error& e) {
      std::fprintf(stderr, "[refused: %s]\n", e.what());
      history.erase(history.size() - 1);
      continue;
    }
    current = id;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done; });
    }
    current = 0;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fputs("\n", stdout);
    std::fflush(stdout);
    if (last.finish_reason == FinishReason::Cancelled) std::fprintf(stderr, "[stopped]\n");
    if (last.finish_reason == FinishReason::Error) std::fprintf(stderr, "[failed: %s]\n", last.error.c_str());
    // The answer goes back into the history as the model's text. An image placeholder in it (a model
    // can emit the token; as text the encoder refuses it) would make every later turn unrenderable.
    std::string said = valid_utf8(out);
    for (size_t at; (at = said.find(kImagePlaceholder)) != std::string::npos;) said.erase(at, kImagePlaceholder.size());
    const auto [reasoning, answer] = split_reasoning(said, prompt.starts_in_reasoning);
    nlohmann::ordered_json reply = {{"role", "assistant"}, {"content", answer}};
    if (!reasoning.empty()) reply["reasoning_content"] = reasoning;
    history.push_back(reply);
    std::fprintf(stderr, "[%lld prompt tokens, %lld cached, %lld generated, %.1f tok/s]\n",
                 static_cast<long long>(last.prompt_tokens), static_cast<long long>(last.cached_tokens),
                 static_cast<long long>(last.completion_tokens), static_cast<double>(last.completion_tokens) / secs);
  }
  return 0;
}

}  // namespace dsv41::cli
