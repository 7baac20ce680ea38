#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "backend_env.h"
#include "cli.h"
#include "commands.h"
#include "expert_parallel.h"
#include "io/safetensors_writer.h"
#include "runtime/engine.h"
#include "runtime/image_prepare.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 generate -m DIR (-p TEXT | -f FILE | --prompt-ids 1,2,3) [--image FILE ...] [options]

  -m, --model DIR            model folder (config.json, tokenizer.json, safetensors)
  -p, --prompt TEXT          prompt text (tokenized, BOS prepended unless --no-bos)
  -f, --file FILE            prompt text read from FILE (UTF-8; as -p, for prompts too long for an argument)
      --prompt-ids LIST      prompt as comma-separated token ids (used as given)
      --image FILE           a PNG or JPEG for the next image placeholder of the prompt (<｜deepseek_image｜>
                             in text, the config's image_token_id in --prompt-ids); repeat for more images
  -n, --n-predict N          tokens to generate (default 32)
      --temp T               temperature; 0 = greedy (default 0)
      --top-p P              nucleus sampling mass (default 1)
      --seed S               sampling seed (default 0)
      --teacher-ids LIST     after the prompt, feed exactly these ids one at a time instead of sampled
                             ones (one logits row per id, the first at the last prompt position)
      --prefill-mode M       exact (every layer on every prompt token) or tail (CED: layers after the
                             last KV source only on the prompt's last window rows)
      --chunk N              prefill in calls of at most N tokens (default 512; bounds activation memory)
      --index-keys M         owner (default) or reference (the shipped decode behaviour)
      --speculative dspark   draft with the model's DSpark blocks and verify the drafts in one forward
      --draft-length N       drafts verified per step (default: adaptive, from the confidence head)
      --acceptance-guard on|off
                             on (default): a sequence whose drafts do not pay decodes plainly for a
                             while; off: draft at every step (to measure what a verification costs)
      --oracle-drafts LIST   measurement hook: replace the drafts with this continuation of the prompt
                             (e.g. a previous greedy output), to measure verification at full acceptance
      --engram T             where the Engram tables are read from: mmap (default), ram (loaded into
                             memory) or pread (rows read from the file by I/O threads, fetched ahead)
      --ram SIZE             memory budget the model's load follows, e.g. 16G (default: the available RAM, or
                             the memory cgroup's limit when lower; above that limit it is refused;
                             `dsv41 plan` shows the plan)
      --prompt-cache DIR     keep prompt prefixes' state in DIR and reuse it in later runs
      --cache-mode M         exact (windows kept: bit-identical restore, default) or replay (only
                             global KV kept; the last window tokens are re-run on a hit)
      --ignore-eos           keep generating after the end-of-sentence token
      --dump-logits FILE     write the float32 logits row of every sampled position:
                             "dsv41-logits v1 vocab=V rows=R\n" then R*V little-endian float32
      --json                 print one JSON object instead of streaming text
      --expert-parallel      under mpirun -np N: each rank holds 1/N of the routed experts and Engram
                             rows (docs/distributed.md)
      --rank-timeout S       with --expert-parallel: how long rank 0 waits for another rank's part of
                             one layer's exchange before the request fails and the job ends with
                             status 1, naming the rank that did not answer (default 300)
)";

std::vector<int32_t> parse_ids(const std::string& flag, const std::string& text) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= text.size()) {
    size_t j = text.find(',', i);
    if (j == std::string::npos) j = text.size();
    std::string item = text.substr(i, j - i);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || v < 0 || v > INT32_MAX) {
      fail(flag, "expects comma-separated non-negative token ids, got \"" + item + "\"");
    }
    ids.push_back(static_cast<int32_t>(v));
    i = j + 1;
  }
  return ids;
}

// The process's peak resident memory so far, in MiB.
double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux reports KiB
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// An image file's bytes (Error naming the path when it cannot be read or is larger than any image
// the decoder takes).
std::vector<uint8_t> read_image_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot be opened");
  std::vector<uint8_t> bytes;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    bytes.insert(bytes.end(), buf, buf + in.gcount());
    if (bytes.size() > ImageDecodeLimits{}.max_encoded_bytes) fail(path, "is larger than an image may be");
  }
  if (in.bad()) fail(path, "could not be read");
  return bytes;
}

}  // namespace

// One request through the Engine, the path `serve` and `chat` take: the command only turns flags
// into the request, prints its tokens as they come and reports what the engine reports at the end.
int run_generate(int argc, char** argv, MpiJob* job) {
  if (wants_help(argc, argv)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Args args("generate", argc, argv,
            {"--model", "--prompt", "--file", "--prompt-ids", "--image", "--n-predict", "--temp", "--top-p", "--seed", "--teacher-ids",
             "--prefill-mode", "--chunk", "--index-keys", "--dump-logits", "--prompt-cache", "--cache-mode", "--engram", "--ram", "--speculative", "--draft-length", "--oracle-drafts", "--acceptance-guard",
             "--rank-timeout"},
            {"--json", "--ignore-eos", "--no-bos", "--expert-parallel"}, {{"-m", "--model"}, {"-p", "--prompt"}, {"-f", "--file"}, {"-n", "--n-predict"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const std::string dir = args.required("--model");
  if (static_cast<int>(args.has("--prompt")) + static_cast<int>(args.has("--file")) + static_cast<int>(args.has("--prompt-ids")) != 1) {
    fail("generate", "give exactly one of -p TEXT, -f FILE and --prompt-ids");
  }
  std::string prompt_text;
  if (args.has("--file")) {
    const std::string path = args.get("--file");
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(path, "cannot be opened");
    prompt_text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) fail(path, "could not be read");
  } else if (args.has("--prompt")) {
    prompt_text = args.get("--prompt");
  }

  RequestParams req;
  const std::string mode = args.get("--prefill-mode", "exact");
  if (mode != "exact" && mode != "tail") fail("--prefill-mode", "must be exact or tail, got \"" + mode + "\"");
  req.prefill_mode = mode == "tail" ? PrefillMode::Tail : PrefillMode::Exact;
  const int64_t chunk = args.get_int("--chunk", 0, 0, INT32_MAX);
  const std::string keys = args.get("--index-keys", "owner");
  if (keys != "owner" && keys != "reference") fail("--index-keys", "must be owner or reference, got \"" + keys + "\"");
  req.index_keys = keys == "reference" ? IndexKeysMode::Reference : IndexKeysMode::Owner;
  if (args.has("--prompt-cache") && req.index_keys == IndexKeysMode::Reference) {
    fail("--prompt-cache", "holds owner-mode state; it cannot serve --index-keys reference");
  }
  req.sampling.temperature = args.get_number("--temp", 0);
  req.sampling.top_p = args.get_number("--top-p", 1);
  req.sampling.seed = args.get_u64("--seed", 0);
  const bool teacher = args.has("--teacher-ids");
  const std::vector<int32_t> teacher_ids = teacher ? parse_ids("--teacher-ids", args.get("--teacher-ids")) : std::vector<int32_t>{};
  const int64_t n_predict = teacher ? static_cast<int64_t>(teacher_ids.size()) : args.get_int("--n-predict", 32, 0, 1 << 24);
  const bool json_out = args.has("--json");
  const std::string spec_name = args.get("--speculative", "");
  if (!spec_name.empty() && spec_name != "dspark") fail("--speculative", "the only method is dspark, got \"" + spec_name + "\"");
  if (args.has("--draft-length") && spec_name.empty()) fail("--draft-length", "needs --speculative dspark");
  if (args.has("--oracle-drafts") && spec_name.empty()) fail("--oracle-drafts", "needs --speculative dspark");
  if (args.has("--acceptance-guard") && spec_name.empty()) fail("--acceptance-guard", "needs --speculative dspark");
  const std::string guard = args.get("--acceptance-guard", "on");
  if (guard != "on" && guard != "off") fail("--acceptance-guard", "must be on or off, got \"" + guard + "\"");
  req.acceptance_guard = guard == "on";
  if (!spec_name.empty() && teacher) fail("--speculative", "cannot be combined with --teacher-ids");

  EngineOptions eo;
  eo.model_dir = dir;
  eo.parallel = 1;
  eo.prefill_chunk = chunk > 0 ? chunk : kDefaultPrefillChunk;
  eo.kv_budget_bytes = uint64_t{1} << 60;  // one request: nothing to admit it against but the machine
  eo.cache_ram_bytes = uint64_t{1} << 30;
  eo.prompt_cache_dir = args.get("--prompt-cache", "");
  eo.cache_mode = parse_cache_mode(args.get("--cache-mode", "exact"));
  eo.engram = parse_engram_tier(args.get("--engram", "mmap"));
  eo.ram_bytes = ram_flag(args);
  eo.backend = backend_from_environment();
  std::shared_ptr<MpiExpertPeers> peers;
  const std::chrono::seconds rank_timeout = rank_timeout_flag(args);
  if (args.has("--expert-parallel")) eo.expert_peers = peers = expert_peers_for(job, dir, rank_timeout);
  eo.log = [](const std::string& line) { std::fprintf(stderr, "dsv41 generate: warning: %s\n", line.c_str()); };
  Engine engine(eo);
  const ModelConfig& cfg = engine.config();
  const Tokenizer& tokenizer = engine.tokenizer();

  std::vector<int32_t>& prompt = req.prompt;
  if (!args.has("--prompt-ids")) {
    if (!args.has("--no-bos")) prompt.push_back(static_cast<int32_t>(cfg.bos_token_id));
    std::vector<int32_t> text = tokenizer.encode(prompt_text);
    prompt.insert(prompt.end(), text.begin(), text.end());
  } else {
    prompt = parse_ids("--prompt-ids", args.get("--prompt-ids"));
  }
  for (int32_t id : prompt) {
    if (id >= cfg.vocab_size) fail("--prompt-ids", "id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(cfg.vocab_size));
  }
  for (const std::string& path : args.get_all("--image")) {
    const std::vector<uint8_t> bytes = read_image_file(path);
    req.images.push_back(prepare_image(bytes, cfg.vision, ImageDecodeLimits{}, path));
  }
  for (int32_t id : teacher_ids) {
    if (id >= cfg.vocab_size) fail("--teacher-ids", "id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(cfg.vocab_size));
  }
  if (req.images.empty() && static_cast<int64_t>(prompt.size()) + n_predict > cfg.max_seq_len) {
    fail("generate", "prompt (" + std::to_string(prompt.size()) + ") plus -n (" + std::to_string(n_predict) +
                         ") exceeds the model's context of " + std::to_string(cfg.max_seq_len));
  }
  req.max_tokens = n_predict;
  req.ignore_eos = teacher || args.has("--ignore-eos");  // teacher ids are fed whatever they are
  req.forced_output = teacher_ids;
  const bool want_dump = args.has("--dump-logits");
  req.return_logits = want_dump;
  if (!spec_name.empty()) {
    req.speculative = SpeculativeMethod::DSpark;
    if (engine.draft_block_size() == 0) fail("--speculative", "this model has no DSpark blocks");
    req.draft_length = static_cast<int>(args.get_int("--draft-length", 0, 1, engine.draft_block_size()));
    if (args.has("--oracle-drafts")) {
      const std::vector<int32_t> oracle = parse_ids("--oracle-drafts", args.get("--oracle-drafts"));
      const int64_t start = static_cast<int64_t>(prompt.size());
      // a whole block (or the fixed length) of the continuation, whatever length the drafter chose
      const size_t length = static_cast<size_t>(req.draft_length > 0 ? req.draft_length : engine.draft_block_size());
      req.force_drafts = [oracle, start, length](int64_t pos, const std::vector<int32_t>&) {
        std::vector<int32_t> d;  // the continuation after the token at `pos`
        for (int64_t i = pos - start + 1; i < static_cast<int64_t>(oracle.size()) && d.size() < length; ++i) {
          d.push_back(oracle[static_cast<size_t>(i)]);
        }
        return d;
      };
    }
  } else {
    req.speculative = SpeculativeMethod::Off;
  }
  const bool tty = isatty(fileno(stderr)) != 0;
  const auto t_submit = std::chrono::steady_clock::now();
  if (tty) {
    req.prefill_progress = [t_submit](int64_t done, int64_t total) {
      if (total < 256) return;
      std::fprintf(stderr, "\rprefill %lld/%lld tokens (%.0f tok/s)", static_cast<long long>(done),
                   static_cast<long long>(total), static_cast<double>(done) / seconds_since(t_submit));
      if (done == total) std::fputc('\n', stderr);
    };
  }

  // the scheduler thread delivers the events; this thread waits for the last one
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  TokenEvent last;
  std::vector<int32_t> generated;
  std::vector<float> dump;
  std::chrono::steady_clock::time_point t_first = t_submit;
  engine.submit(req, [&](const TokenEvent& e) {
    if (e.token >= 0) {
      if (generated.empty()) t_first = std::chrono::steady_clock::now();
      generated.push_back(e.token);
    }
    dump.insert(dump.end(), e.logits.begin(), e.logits.end());  // the stop token's row comes at done
    if (!json_out && !e.text.empty()) {
      std::fwrite(e.text.data(), 1, e.text.size(), stdout);
      std::fflush(stdout);
    }
    if (e.done) {
      std::lock_guard<std::mutex> lock(mu);
      last = e;
      finished = true;
      cv.notify_all();
    }
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return finished; });
  }
  const auto t_done = std::chrono::steady_clock::now();
  if (last.finish_reason == FinishReason::Error) fail("generate", last.error);
  if (last.stop_token >= 0) generated.push_back(last.stop_token);
  if (!json_out) std::fputs("\n", stdout);
  // the prefill ends with the first token; without one (-n 0) the request's whole time is the prefill
  const double prefill_s = std::chrono::duration<double>((generated.empty() ? t_done : t_first) - t_submit).count();
  const double decode_s = generated.empty() ? 0.0 : std::chrono::duration<double>(t_done - t_first).count();

  if (want_dump) {
    const int64_t rows = static_cast<int64_t>(dump.size()) / cfg.vocab_size;
    std::string out = "dsv41-logits v1 vocab=" + std::to_string(cfg.vocab_size) + " rows=" + std::to_string(rows) + "\n";
    out.append(reinterpret_cast<const char*>(dump.data()), dump.size() * sizeof(float));
    write_file_atomic(args.get("--dump-logits"), out.data(), out.size());
  }
  if (json_out) {
    const RequestReport& rep = last.report;
    nlohmann::json j = {
        {"prompt_tokens", last.prompt_tokens},  // image placeholders expanded into their spans
        {"images", args.get_all("--image").size()},
        {"tokens", generated},
        {"text", tokenizer.decode(generated)},
        {"prefill_mode", mode},
        {"peak_rss_mb", peak_rss_mb()},
        {"cached_tokens", last.cached_tokens},
        {"replayed_tokens", rep.replayed_tokens},
        {"cache_source", cache_source_name(rep.cache_source)},
        {"state_bytes_per_token",
         {{"main_kv", rep.main_kv_bytes_per_token},
          {"index_keys", rep.index_key_bytes_per_token},
          {"global", rep.main_kv_bytes_per_token + rep.index_key_bytes_per_token}}},
        {"timings",
         {{"prefill_s", prefill_s},
          {"decode_s", decode_s},
          {"prefill_tok_s", prefill_s > 0 ? static_cast<double>(last.prompt_tokens) / prefill_s : 0.0},
          {"decode_tok_s", decode_s > 0 ? static_cast<double>(generated.size() - 1) / decode_s : 0.0}}},
    };
    if (req.speculative == SpeculativeMethod::DSpark) {
      const double forwards = static_cast<double>(rep.verify_steps + rep.plain_steps);
      j["spec"] = {{"proposed", rep.drafts_proposed},
                   {"accepted", rep.drafts_accepted},
                   {"accepted_per_position", rep.accepted_per_position},
                   {"mean_accept_len", rep.verify_steps ? static_cast<double>(rep.drafts_accepted + rep.verify_steps) /
                                                              static_cast<double>(rep.verify_steps)
                                                        : 0.0},
                   {"target_forwards", rep.verify_steps + rep.plain_steps},
                   {"verify_steps", rep.verify_steps},
                   {"plain_steps", rep.plain_steps},
                   {"guard_pauses", rep.guard_pauses},
                   {"target_forwards_per_token",
                    generated.size() > 1 ? forwards / static_cast<double>(generated.size() - 1) : 0.0}};
    }
    const EngineMetrics m = engine.metrics();
    if (m.expert_cache_capacity_bytes > 0) {  // the plan streams the routed experts
      j["expert_cache"] = {{"capacity_bytes", m.expert_cache_capacity_bytes},
                           {"hits", m.expert_cache_hits},
                           {"misses", m.expert_cache_misses},
                           {"bytes_read", m.expert_cache_bytes_read},
                           {"read_s", m.expert_cache_read_seconds}};
    }
    if (peers) {  // --expert-parallel: what crossed between the ranks
      const ExchangeStats x = peers->stats();
      j["expert_parallel"] = {{"ranks", peers->share().ranks},
                              {"exchanged_bytes", x.bytes},
                              {"moe_layers", x.moe_layers},
                              {"engram_lookups", x.engram_lookups}};
    }
    if (rep.cache_tokens_stored > 0 && rep.cache_bytes_written > 0) {
      j["disk_bytes_per_token"] = static_cast<double>(rep.cache_bytes_written) / static_cast<double>(rep.cache_tokens_stored);
    }
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace dsv41::cli
