// dsv41 serve: the OpenAI-compatible HTTP server over an Engine, until SIGINT or SIGTERM.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
#include <thread>

#include "backend_env.h"
#include "cli.h"
#include "commands.h"
#include "descriptor_limit.h"
#include "expert_parallel.h"
#include "io/engram_store.h"
#include "runtime/engine.h"
#include "runtime/prefix_cache.h"
#include "state/state_graph.h"
#include "io/layer_roles.h"
#include "transfer/kv_event_publisher.h"
#include "transfer/prefill_link.h"
#include "server/access_policy.h"
#include "server/http_server.h"
#include "server/line_log.h"
#include "text/chat_encoding.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 serve -m DIR [options]

  -m, --model DIR            model folder (config.json, tokenizer.json, safetensors)
      --host ADDR            address to listen on (default 127.0.0.1)
      --port N               port (default 8080; 0 picks a free one, printed at start)
      --parallel N           sequences decoded together; more requests wait in a queue (default 4)
      --kv-budget-mb N       KV memory for running sequences and the prefix cache (default 1024)
      --prompt-cache DIR     keep prompt prefixes' state in DIR too, for later runs (default: RAM only)
      --prompt-cache-disk-mb N
                             the folder's size cap; least recently used entries go past it (default 8192)
      --cache-mode M         exact (default) or replay, as in generate
      --cache-ram-mb N       RAM the prefix cache may keep (default 256)
      --kv-events ENDPOINT   publish what the prefix cache stores and evicts as vLLM's KV events (msgpack
                             over a ZeroMQ PUB socket bound at ENDPOINT, e.g. tcp://0.0.0.0:5557; port *
                             picks a free one, printed at start), for cache-aware routers (default: off)
      --kv-events-replay ENDPOINT
                             with --kv-events: a ZeroMQ ROUTER socket there answers subscribers that missed
                             batches with the last 10000 (default: none)
      --kv-events-topic T    the topic frame of every KV event message (default: empty, as vLLM's)
      --ram SIZE             memory budget the model's load follows, e.g. 16G (default: the available RAM, or
                             the memory cgroup's limit when lower; above that limit it is refused;
                             `dsv41 plan` shows the plan)
      --prefill-chunk N      prompt tokens a step runs at most (default 256): the activations' bound
      --scheduling-policy P  fcfs (default): requests run in the order they came; priority: a request's
                             "priority" (an integer, lower first; vLLM's meaning) orders admission and the
                             prompt rows of a step, the oldest first among equals
      --step-budget-ms MS    while sequences decode, a step runs only the prompt rows that keep it within
                             this time, so their tokens keep coming while long prompts are read (default
                             0: three measured decode steps, at least 25 ms and at most 1 s)
      --engram T             mmap (default), ram or pread
      --speculative M        dspark or off (default): speculative decoding for requests that do not
                             choose ("speculative": "dspark" | "off" in the body)
      --draft-length N       drafts verified per step with dspark (default 0: adaptive, from the
                             confidence head); a request's "draft_length" overrides it
      --threads N            workers that parse and tokenize request bodies (default 4); every socket is
                             served by one I/O thread, so slow clients hold no thread
      --max-connections N    open connections at most; more are answered 503 (default 1024, lowered to
                             what the file-descriptor limit leaves; the soft limit is raised to the hard one)
      --max-client-connections N
                             open connections from one client address at most (default 256); past either
                             cap 8 more connections may open for GET /health and /metrics only
      --bodies-in-flight-mb N
                             request bodies being read or parsed, all clients together; a body that does not
                             fit is answered 503 before it is read (default 128)
      --request-timeout S    a request still running S seconds after it arrived ends with 504 (default: none)
      --shutdown-grace S     on SIGTERM or SIGINT, requests in flight get their 503 (streams an error event and
                             [DONE]) for up to S seconds before their connections close (default 10)
      --stall-timeout S      /health answers 503 while one engine step has run longer than S (default 120)
      --header-timeout S     deadline for a whole request head, keep-alive idling included (default 30)
      --body-timeout S       deadline for a whole request body (default 60)
      --thinking on|off      chat template default when a request does not say (default on)
      --special-tokens-in ROLES
                             the roles whose message text may write control tokens ("<｜User｜>",
                             "</think>", "｜DSML｜", EOS written in it becoming those tokens): all (the
                             reference encoder's behaviour), none, or a comma-separated list of system,
                             user, assistant, tool, latest_reminder (default system,latest_reminder).
                             The other roles' text is tokenized as plain characters, so a tool result
                             or a pasted document cannot end its turn and forge another
      --max-images N         image parts one chat request may carry (default 8; 0 refuses images)
      --max-image-pixels N   width x height of all the images of one request together, read from their
                             headers before any is decoded (default 41943040)
      --default-max-tokens N max_tokens of a request that sets none, capped by the context (default 8192)
      --served-model-name N[,ALIAS...]
                             the model id clients use (default: the model folder's name); further
                             names are accepted as aliases
      --api-key KEY          require "Authorization: Bearer KEY" on /v1/ routes, /tokenize, /detokenize
      --api-key-file FILE    the same, with the key read from FILE (its first line), kept out of `ps`
      --role R               both (default), prefill or decode: prefill/decode disaggregation
                             (docs/distributed.md). prefill: also answers decode servers' handovers over
                             UCX at --handover-listen HOST:PORT (default: --host, a free port, printed).
                             decode: prompts of two blocks or more are prefilled by --prefill-peer
                             HOST:PORT and their state handed over, --handover exact (the window rings
                             too, default) or replay (the last window replayed here); a prefill server
                             that fails is logged and the prompt prefilled here. --handover-timeout S
                             bounds one handover (default 600); a prefill server that lets one time
                             out is not asked for as long again (doubling while it stays silent, up
                             to 10 minutes), its prompts prefilled here at once
      --expert-parallel      under mpirun -np N: each rank holds 1/N of the routed experts and Engram
                             rows, rank 0 serves (docs/distributed.md)
      --rank-timeout S       with --expert-parallel: how long rank 0 waits for another rank's part of
                             one layer's exchange (default 300, far past a healthy step's). Past it
                             the requests of that step get a 500 naming the rank that did not answer,
                             the server stops and the job ends with status 1
      --cors-origins LIST    comma-separated origins web pages may call from ("*": any); default none,
                             and a request with an Origin header not listed is refused (403)
      --log-requests         one line per request on stderr (lines are dropped, and counted in /metrics,
                             while stderr is a pipe nobody reads)
      --test-hooks           accept "dsv41_forced_output": TEXT in requests, emitted as if generated (tests)

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /v1/messages
(Anthropic's; each with "stream": true for SSE; "speculative", "draft_length" and "prefill_mode" as
extension fields), POST /v1/messages/count_tokens,
GET /v1/models, GET /health, GET /metrics (Prometheus), POST /tokenize and /detokenize, and
POST /v1/debug/render, which takes a chat request and returns the rendered prompt and its token ids
without generating. Bound to a loopback address, the server answers only loopback Host names (a web
page cannot reach it by DNS rebinding). Request bodies must be JSON (Content-Length or chunked).
)";

// Comma-separated non-empty names, each printable and without spaces.
std::vector<std::string> name_list(const std::string& text, const std::string& flag) {
  std::vector<std::string> out;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) {
    if (item.empty()) fail(flag, "has an empty name in \"" + text + "\"");
    for (char c : item) {
      if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7F) {
        fail(flag, "names must be printable ASCII without spaces, got \"" + item + "\"");
      }
    }
    out.push_back(item);
  }
  if (out.empty()) fail(flag, "needs at least one name");
  return out;
}

// The first line of `path`, without surrounding whitespace.
std::string read_key_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) fail(path, "cannot read the API key file");
  std::string line;
  std::getline(f, line);
  const size_t b = line.find_first_not_of(" \t\r");
  if (b == std::string::npos) fail(path, "the API key file's first line is empty");
  return line.substr(b, line.find_last_not_of(" \t\r") - b + 1);
}

// A prefill server's answer to a decode server: the prompt prefilled through the engine (with every
// other request it runs) and its state as prompt-cache entry bytes. A stop cancels the prefill, so a
// server told to stop does not first finish a long prompt (perhaps for a decode server long gone).
std::vector<uint8_t> prefill_for_peer(Engine& engine, const std::vector<int32_t>& tokens, CacheMode mode,
                                      const std::string& cache_namespace, const std::atomic<bool>& stopping) {
  RequestParams p;
  p.prompt = tokens;
  p.cache_namespace = cache_namespace;
  p.max_tokens = 0;
  p.export_state = mode;
  std::promise<TokenEvent> done;
  std::future<TokenEvent> final_event = done.get_future();
  const uint64_t id = engine.submit(std::move(p), [&done](const TokenEvent& e) {
    if (e.done) done.set_value(e);
  });
  while (final_event.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
    if (stopping) {
      engine.cancel(id);  // its final event follows within a step
      break;
    }
  }
  const TokenEvent e = final_event.get();
  if (e.finish_reason == FinishReason::Cancelled) fail("prefill", "cancelled: this server is stopping");
  if (e.finish_reason == FinishReason::Error || !e.exported_state) fail("prefill", e.error.empty() ? "ended without a state" : e.error);
  return *e.exported_state;
}


}  // namespace

int run_serve(int argc, char** argv, MpiJob* job) {
  if (wants_help(argc, argv)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Args args("serve", argc, argv,
            {"--model", "--host", "--port", "--parallel", "--kv-budget-mb", "--prompt-cache", "--cache-mode",
             "--cache-ram-mb", "--prefill-chunk", "--step-budget-ms", "--scheduling-policy", "--engram", "--ram", "--threads", "--thinking",
             "--default-max-tokens", "--served-model-name", "--api-key", "--api-key-file", "--cors-origins", "--max-connections", "--prompt-cache-disk-mb",
             "--request-timeout", "--header-timeout", "--body-timeout", "--speculative", "--draft-length",
             "--max-client-connections", "--bodies-in-flight-mb", "--shutdown-grace", "--stall-timeout",
             "--role", "--prefill-peer", "--handover", "--handover-listen", "--handover-timeout", "--max-images",
             "--max-image-pixels", "--rank-timeout", "--special-tokens-in", "--kv-events", "--kv-events-replay",
             "--kv-events-topic"},
            {"--log-requests", "--test-hooks", "--expert-parallel"}, {{"-m", "--model"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");

  // stderr may be a pipe that nobody reads: the scheduler's and the I/O thread's lines drop, never block
  auto log = std::make_shared<server::LineLog>(2);
  EngineOptions eo;
  eo.log = [log](const std::string& line) { log->write("dsv41 engine: " + line); };
  eo.model_dir = args.required("--model");
  eo.parallel = static_cast<int>(args.get_int("--parallel", 4, 1, 4096));
  eo.kv_budget_bytes = static_cast<uint64_t>(args.get_int("--kv-budget-mb", 1024, 1, int64_t{1} << 24)) << 20;
  eo.prompt_cache_dir = args.get("--prompt-cache");
  eo.prompt_cache_disk_bytes = static_cast<uint64_t>(args.get_int("--prompt-cache-disk-mb", static_cast<int64_t>(kDefaultPromptCacheDiskBytes >> 20), 0, int64_t{1} << 30)) << 20;
  eo.cache_mode = parse_cache_mode(args.get("--cache-mode", "exact"));
  eo.cache_ram_bytes = static_cast<uint64_t>(args.get_int("--cache-ram-mb", 256, 0, int64_t{1} << 24)) << 20;
  eo.prefill_chunk = args.get_int("--prefill-chunk", 256, 1, 1 << 20);
  eo.step_budget_ms = args.get_number("--step-budget-ms", 0);
  const std::string policy = args.get("--scheduling-policy", "fcfs");
  if (policy != "fcfs" && policy != "priority") fail("--scheduling-policy", "must be fcfs or priority, got \"" + policy + "\"");
  eo.scheduling = policy == "priority" ? SchedulingPolicy::Priority : SchedulingPolicy::Fcfs;
  eo.engram = parse_engram_tier(args.get("--engram", "mmap"));
  eo.ram_bytes = ram_flag(args);
  const std::chrono::seconds rank_timeout = rank_timeout_flag(args);
  if (args.has("--expert-parallel")) eo.expert_peers = expert_peers_for(job, eo.model_dir, rank_timeout);
  const std::string spec = args.get("--speculative", "off");
  if (spec != "dspark" && spec != "off") fail("--speculative", "must be dspark or off, got \"" + spec + "\"");
  eo.speculative = spec == "dspark" ? SpeculativeMethod::DSpark : SpeculativeMethod::Off;
  eo.draft_length = static_cast<int>(args.get_int("--draft-length", 0, 0, 1 << 16));
  const std::string role = args.get("--role", "both");
  if (role != "both" && role != "prefill" && role != "decode")
    fail("--role", "must be both, prefill or decode, got \"" + role + "\"");
  if (role != "decode" && (args.has("--prefill-peer") || args.has("--handover") || args.has("--handover-timeout")))
    fail(args.has("--prefill-peer") ? "--prefill-peer" : args.has("--handover") ? "--handover" : "--handover-timeout",
         "belongs to --role decode");
  if (role != "prefill" && args.has("--handover-listen")) fail("--handover-listen", "belongs to --role prefill");
  // A prefill server started again at once (after a crash, a freeze, a restart) binds its handover
  // port even while its predecessor's connections sit in TIME_WAIT: UCX's listener asks for
  // SO_REUSEADDR only when its environment says so (transfer/ucx_link.h), set here before the engine
  // starts its threads, unless the operator chose otherwise.
  if (role == "prefill") setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
  if (role == "decode") {
    const UcxAddress peer = parse_ucx_address(args.required("--prefill-peer"), "--prefill-peer");
    eo.handover = parse_cache_mode(args.get("--handover", "exact"));
    const auto timeout = std::chrono::seconds(args.get_int("--handover-timeout", 600, 1, 86400));
    // the most a handover can hold: the model's whole context of state, and headroom for the format
    const ModelConfig config = load_config(eo.model_dir);
    const StateGraph graph = build_state_graph(config, derive_layer_roles(config));
    const uint64_t most = static_cast<uint64_t>(graph.global_bytes_per_token() * static_cast<double>(config.max_seq_len)) +
                          static_cast<uint64_t>(graph.fixed_bytes_per_sequence()) + (uint64_t{64} << 20);
    eo.prefill_peer = std::make_shared<UcxPrefillPeer>(peer, most, timeout);
  }

  std::shared_ptr<ZmqKvEventPublisher> kv_events;
  if (!args.has("--kv-events") && (args.has("--kv-events-replay") || args.has("--kv-events-topic"))) {
    fail(args.has("--kv-events-replay") ? "--kv-events-replay" : "--kv-events-topic", "needs --kv-events");
  }
  if (args.has("--kv-events")) {
    KvEventPublisherOptions ko;
    ko.endpoint = args.get("--kv-events");
    ko.replay_endpoint = args.get("--kv-events-replay");
    ko.topic = args.get("--kv-events-topic");
    kv_events = std::make_shared<ZmqKvEventPublisher>(ko);
    eo.kv_events = kv_events;
  }

  server::ServerOptions so;
  so.host = args.get("--host", "127.0.0.1");
  so.port = static_cast<int>(args.get_int("--port", 8080, 0, 65535));
  so.threads = static_cast<int>(args.get_int("--threads", 4, 1, 1024));
  so.log = log;
  so.max_connections = static_cast<size_t>(args.get_int("--max-connections", 1024, 1, 1 << 20));
  so.max_client_connections = static_cast<size_t>(args.get_int("--max-client-connections", 256, 1, 1 << 20));
  so.body_bytes_in_flight = static_cast<size_t>(args.get_int("--bodies-in-flight-mb", 128, 8, 1 << 20)) << 20;
  so.shutdown_grace = std::chrono::seconds(args.get_int("--shutdown-grace", 10, 0, 3600));
  so.stall_timeout = std::chrono::seconds(args.get_int("--stall-timeout", 120, 1, 86400));
  so.request_timeout = std::chrono::seconds(args.get_int("--request-timeout", 0, 0, int64_t{1} << 31));
  so.header_timeout = std::chrono::seconds(args.get_int("--header-timeout", 30, 1, 86400));
  so.body_timeout = std::chrono::seconds(args.get_int("--body-timeout", 60, 1, 86400));
  const std::string thinking = args.get("--thinking", "on");
  if (thinking != "on" && thinking != "off") fail("--thinking", "must be on or off, got \"" + thinking + "\"");
  so.chat.thinking = thinking == "on";
  if (args.has("--special-tokens-in")) {
    so.chat.special_tokens_in = parse_special_token_roles(args.get("--special-tokens-in"), "--special-tokens-in");
  }
  so.log_requests = args.has("--log-requests");
  so.test_hooks = args.has("--test-hooks");
  so.images.max_images = static_cast<size_t>(args.get_int("--max-images", 8, 0, 1024));
  so.images.decode.max_pixels = static_cast<uint64_t>(args.get_int("--max-image-pixels", int64_t{40} << 20, 1, int64_t{1} << 32));
  so.images.decode.max_encoded_bytes = so.max_body_bytes;  // a base64 image fits in a body, or nowhere
  so.default_max_tokens = args.get_int("--default-max-tokens", 8192, 1, int64_t{1} << 40);
  if (args.has("--served-model-name")) so.served_model_names = name_list(args.get("--served-model-name"), "--served-model-name");
  if (args.has("--cors-origins")) so.cors_origins = name_list(args.get("--cors-origins"), "--cors-origins");
  if (args.has("--api-key") && args.has("--api-key-file")) fail("--api-key-file", "give --api-key or --api-key-file, not both");
  if (args.has("--api-key")) so.api_key = args.get("--api-key");
  if (args.has("--api-key-file")) so.api_key = read_key_file(args.get("--api-key-file"));
  if ((args.has("--api-key") || args.has("--api-key-file")) && so.api_key.empty()) fail("--api-key", "the key is empty");

  // SIGINT and SIGTERM are taken by one thread with sigwait, so they must be blocked before any other
  // thread (the engine's scheduler, the connection pool) exists and inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  eo.backend = backend_from_environment();
  Engine engine(eo);
  // The engine's files are open now: what the descriptor limit leaves is the connections' (and a
  // cap above it would have accept fail with EMFILE, answering no one).
  const size_t connections_asked = so.max_connections;
  so.max_connections = connection_cap(raise_descriptor_limit(), args.has("--max-connections"), connections_asked,
                                      connections_asked, so.probe_connections);
  if (so.max_connections < connections_asked) {
    std::fprintf(stderr, "dsv41 serve: --max-connections lowered to %zu, what the open-files limit leaves\n",
                 so.max_connections);
  }
  std::unique_ptr<PrefillListener> handover;
  std::string role_note;
  if (role == "prefill") {
    UcxAddress at = parse_ucx_address(args.get("--handover-listen", so.host + ":0"), "--handover-listen");
    handover = std::make_unique<PrefillListener>(
        at,
        [&engine](const std::vector<int32_t>& tokens, CacheMode mode, const std::string& cache_namespace,
                  const std::atomic<bool>& stopping) {
          return prefill_for_peer(engine, tokens, mode, cache_namespace, stopping);
        },
        engine.config().max_seq_len);
    at.port = handover->port();
    role_note = "; prefill role, handover on ucx " + at.text();
  } else if (role == "decode") {
    role_note = "; decode role, prefill peer " + args.get("--prefill-peer") + ", " + cache_mode_name(eo.handover) + " handover";
  }
  if (kv_events) {
    role_note += "; kv events on " + kv_events->endpoint();
    if (!kv_events->replay_endpoint().empty()) role_note += ", replay on " + kv_events->replay_endpoint();
  }
  server::HttpServer server(engine, so);
  const int port = server.bind();
  std::printf("dsv41 serve: listening on http://%s:%d (model %s, parallel %d%s)\n", so.host.c_str(), port,
              so.served_model_names.empty() ? engine.model_name().c_str() : so.served_model_names.front().c_str(),
              eo.parallel, role_note.c_str());
  if (so.api_key.empty() && !server::is_loopback_address(so.host)) {
    std::fprintf(stderr, "dsv41 serve: warning: %s is reachable from other machines and no --api-key is set\n",
                 so.host.c_str());
  }
  std::fflush(stdout);

  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    server.stop();
  });
  if (job != nullptr) {
    // An expert-parallel rank that stops answering fails the scheduler's step that waited on it (its
    // requests end with the error naming the rank) and the job: the server stops as on SIGTERM (the
    // step's requests are answered within the shutdown grace), and the command ends with status 1.
    // The handler runs on the scheduler's thread, inside the step; its signal goes to the process,
    // whose only taker is the waiter.
    job->on_failure([](const std::string&) { kill(getpid(), SIGTERM); });
  }
  server.run();
  // run() returned: by a signal, or because the server failed. Which, is read before the waiter is
  // woken (a no-op signal to it if it already returned is harmless since the signal stays blocked).
  const bool stop_asked = server.stop_requested();
  pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  if (job != nullptr && !job->failure().empty()) {
    std::fprintf(stderr, "dsv41 serve: error: expert parallel: %s\n", job->failure().c_str());
    return 1;
  }
  if (!stop_asked) {
    // Not by a signal: a supervisor's restart-on-failure must see a failure.
    std::fprintf(stderr, "dsv41 serve: the server stopped without being asked to\n");
    return 1;
  }
  std::fprintf(stderr, "dsv41 serve: stopped\n");
  return 0;
}

}  // namespace dsv41::cli
