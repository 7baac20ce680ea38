#include "transfer/prefill_link.h"

#include <algorithm>
#include <future>
#include <nlohmann/json.hpp>

#include "io/cache_namespace.h"
#include "util/error.h"

namespace dsv41 {

namespace {

constexpr uint64_t kMaxRequestBytes = uint64_t{64} << 20;                  // 64 MiB of JSON: ~8M tokens
constexpr std::chrono::seconds kRequestTimeout{30};                         // a decode server's request
constexpr std::chrono::seconds kAnswerSendTimeout{600};                     // the state, to a slow reader
constexpr std::chrono::seconds kLongestBackoff{600};                        // a silent peer, at most

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

UcxPrefillPeer::UcxPrefillPeer(UcxAddress peer, uint64_t max_answer_bytes, std::chrono::seconds timeout)
    : peer_(std::move(peer)), max_answer_bytes_(max_answer_bytes), timeout_(timeout),
      backoff_(timeout, std::max(timeout, kLongestBackoff)) {}

std::vector<uint8_t> UcxPrefillPeer::prefill(const std::vector<int32_t>& tokens, CacheMode mode,
                                             const std::string& cache_namespace) {
  const std::string what = "the prefill server " + peer_.text();
  if (stopping_) fail(what, "not asked: the server is stopping");
  bool trying = false;
  const std::string refusal = backoff_.refusal(std::chrono::steady_clock::now(), &trying);
  if (!refusal.empty()) fail(what, refusal);
  const Deadline deadline = std::chrono::steady_clock::now() + timeout_;
  std::vector<uint8_t> answer;
  try {
    answer = exchange(tokens, mode, cache_namespace, deadline, what);
  } catch (const Error&) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline && !stopping_) {
      backoff_.timed_out(now, trying);
    } else {
      backoff_.failed(trying);
    }
    throw;
  }
  backoff_.answered();  // a refusal too: the peer is there
  if (answer.empty()) fail(what, "answered nothing");
  if (answer[0] != 0) fail(what, "refused: " + std::string(answer.begin() + 1, answer.end()));
  answer.erase(answer.begin());
  return answer;
}

std::vector<uint8_t> UcxPrefillPeer::exchange(const std::vector<int32_t>& tokens, CacheMode mode,
                                              const std::string& cache_namespace, Deadline deadline,
                                              const std::string& what) {
  UcxWorker worker;
  const std::unique_ptr<UcxConnection> c = UcxConnection::connect(worker, peer_, &stopping_);
  const nlohmann::json request = {{"protocol", "dsv41-prefill"},
                                  {"version", kPrefillProtocolVersion},
                                  {"mode", cache_mode_name(mode)},
                                  {"tokens", tokens},
                                  {"namespace", cache_namespace}};
  c->send(bytes_of(request.dump()), deadline, what);
  return c->receive(max_answer_bytes_ + 1, deadline, what);
}

PrefillListener::PrefillListener(const UcxAddress& at, Handler handler, int64_t max_tokens)
    : handler_(std::move(handler)), max_tokens_(max_tokens) {
  std::promise<uint16_t> listening;
  std::future<uint16_t> port = listening.get_future();
  thread_ = std::thread([this, at, &listening] {
    // The worker and listener belong to this thread alone (UCX's single-thread mode).
    std::unique_ptr<UcxWorker> worker;
    std::unique_ptr<UcxListener> listener;
    try {
      worker = std::make_unique<UcxWorker>();
      listener = std::make_unique<UcxListener>(*worker, at);
      listening.set_value(listener->port());
    } catch (...) {
      listening.set_exception(std::current_exception());
      return;
    }
    serve(*listener);
  });
  try {
    port_ = port.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

PrefillListener::~PrefillListener() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
}

void PrefillListener::serve(UcxListener& listener) {
  while (!stopping_) {
    const std::unique_ptr<UcxConnection> c = listener.accept(std::chrono::milliseconds(100), &stopping_);
    if (!c) continue;
    try {
      const std::vector<uint8_t> raw =
          c->receive(kMaxRequestBytes, std::chrono::steady_clock::now() + kRequestTimeout, "a decode server's request");
      std::vector<uint8_t> answer{0};
      try {
        const nlohmann::json request = nlohmann::json::parse(raw.begin(), raw.end(), nullptr, false);
        if (!request.is_object() || request.value("protocol", "") != "dsv41-prefill")
          fail("request", "is not a dsv41-prefill request");
        if (request.value("version", -1) != kPrefillProtocolVersion)
          fail("request", "protocol version " + request.value("version", nlohmann::json(-1)).dump() + ", this server speaks " +
                              std::to_string(kPrefillProtocolVersion));
        const nlohmann::json& t = request.contains("tokens") ? request["tokens"] : nlohmann::json();
        if (!t.is_array() || t.empty() || static_cast<int64_t>(t.size()) > max_tokens_)
          fail("request", "needs 1 to " + std::to_string(max_tokens_) + " tokens");
        std::vector<int32_t> tokens;
        for (const nlohmann::json& id : t) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
            fail("request", "holds a token id that is not a non-negative integer");
          tokens.push_back(id.get<int32_t>());
        }
        const nlohmann::json& ns = request.contains("namespace") ? request["namespace"] : nlohmann::json();
        if (!ns.is_string() || !is_cache_namespace(ns.get<std::string>()))
          fail("request", "needs a namespace: \"\" or 32 lowercase hex digits");
        const std::vector<uint8_t> entry =
            handler_(tokens, parse_cache_mode(request.value("mode", "")), ns.get<std::string>(), stopping_);
        answer.insert(answer.end(), entry.begin(), entry.end());
      } catch (const Error& e) {
        answer = bytes_of(std::string(1, '\1') + e.what());
      }
      c->send(answer, std::chrono::steady_clock::now() + kAnswerSendTimeout, "the answer to a decode server");
    } catch (const Error&) {
      // that decode server went away or stalled: it prefills on its own; serve the next one
    }
  }
}

}  // namespace dsv41
