#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "backend_env.h"
#include "cli.h"
#include "commands.h"
#include "io/safetensors_writer.h"
#include "model/model.h"
#include "runtime/prefix_cache.h"
#include "runtime/sampler.h"
#include "runtime/speculative.h"
#include "runtime/session.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

constexpr const char* kHelp = R"(usage: dsv41 generate -m DIR (-p TEXT | --prompt-ids 1,2,3) [options]

  -m, --model DIR            model folder (config.json, tokenizer.json, safetensors)
  -p, --prompt TEXT          prompt text (tokenized, BOS prepended unless --no-bos)
      --prompt-ids LIST      prompt as comma-separated token ids (used as given)
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
      --oracle-drafts LIST   measurement hook: replace the drafts with this continuation of the prompt
                             (e.g. a previous greedy output), to measure verification at full acceptance
      --engram T             where the Engram tables are read from: mmap (default), ram (loaded into
                             memory) or pread (rows read from the file by I/O threads, fetched ahead)
      --prompt-cache DIR     keep prompt prefixes' state in DIR and reuse it in later runs
      --cache-mode M         exact (windows kept: bit-identical restore, default) or replay (only
                             global KV kept; the last window tokens are re-run on a hit)
      --ignore-eos           keep generating after the end-of-sentence token
      --dump-logits FILE     write the float32 logits row of every sampled position:
                             "dsv41-logits v1 vocab=V rows=R\n" then R*V little-endian float32
      --json                 print one JSON object instead of streaming text
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

// Measured bytes per token of the global state classes: the packed rows the sequence holds over its
// length (page slack excluded), and their sum.
nlohmann::json state_bytes_per_token(const SequenceState& st, int64_t length) {
  double main = 0, keys = 0;
  for (const auto& src : st.sources) {
    if (!src) continue;
    main += static_cast<double>(src->compressed.size() * static_cast<int64_t>(src->compressed.row_bytes()));
    keys += static_cast<double>(src->index_keys.size() * static_cast<int64_t>(src->index_keys.row_bytes()));
  }
  const double n = static_cast<double>(std::max<int64_t>(length, 1));
  return {{"main_kv", main / n}, {"index_keys", keys / n}, {"global", (main + keys) / n}};
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

}  // namespace

int run_generate(int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Args args("generate", argc, argv,
            {"--model", "--prompt", "--prompt-ids", "--n-predict", "--temp", "--top-p", "--seed", "--teacher-ids",
             "--prefill-mode", "--chunk", "--index-keys", "--dump-logits", "--prompt-cache", "--cache-mode", "--engram", "--speculative", "--draft-length", "--oracle-drafts"},
            {"--json", "--ignore-eos", "--no-bos"}, {{"-m", "--model"}, {"-p", "--prompt"}, {"-n", "--n-predict"}});
  if (!args.positional().empty()) fail(args.positional()[0], "unexpected argument");
  const std::string dir = args.required("--model");
  if (args.has("--prompt") == args.has("--prompt-ids")) fail("generate", "give exactly one of -p TEXT and --prompt-ids");

  SessionOptions so;
  const std::string mode = args.get("--prefill-mode", "exact");
  if (mode != "exact" && mode != "tail") fail("--prefill-mode", "must be exact or tail, got \"" + mode + "\"");
  so.prefill_mode = mode == "tail" ? PrefillMode::Tail : PrefillMode::Exact;
  so.chunk = args.get_int("--chunk", 0, 0, INT32_MAX);
  const std::string keys = args.get("--index-keys", "owner");
  if (keys != "owner" && keys != "reference") fail("--index-keys", "must be owner or reference, got \"" + keys + "\"");
  so.index_keys = keys == "reference" ? IndexKeysMode::Reference : IndexKeysMode::Owner;
  SamplingParams sp;
  sp.temperature = args.get_number("--temp", 0);
  sp.top_p = args.get_number("--top-p", 1);
  sp.seed = args.get_u64("--seed", 0);
  Sampler sampler(sp);
  const bool teacher = args.has("--teacher-ids");
  const std::vector<int32_t> teacher_ids = teacher ? parse_ids("--teacher-ids", args.get("--teacher-ids")) : std::vector<int32_t>{};
  const int64_t n_predict = teacher ? static_cast<int64_t>(teacher_ids.size()) : args.get_int("--n-predict", 32, 0, 1 << 24);
  const bool json_out = args.has("--json");

  auto model = load_model(dir, {backend_from_environment(), parse_engram_tier(args.get("--engram", "mmap"))});
  const ModelConfig& cfg = model->config();
  Tokenizer tokenizer = Tokenizer::from_file(dir + "/tokenizer.json");
  std::vector<int32_t> prompt;
  if (args.has("--prompt")) {
    if (!args.has("--no-bos")) prompt.push_back(static_cast<int32_t>(cfg.bos_token_id));
    std::vector<int32_t> text = tokenizer.encode(args.get("--prompt"));
    prompt.insert(prompt.end(), text.begin(), text.end());
  } else {
    prompt = parse_ids("--prompt-ids", args.get("--prompt-ids"));
  }
  for (int32_t id : prompt) {
    if (id >= cfg.vocab_size) fail("--prompt-ids", "id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(cfg.vocab_size));
  }
  for (int32_t id : teacher_ids) {
    if (id >= cfg.vocab_size) fail("--teacher-ids", "id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(cfg.vocab_size));
  }
  if (static_cast<int64_t>(prompt.size()) + n_predict > cfg.max_seq_len) {
    fail("generate", "prompt (" + std::to_string(prompt.size()) + ") plus -n (" + std::to_string(n_predict) +
                         ") exceeds the model's context of " + std::to_string(cfg.max_seq_len));
  }

  StatePools pools(cfg, model->roles(), model->backend().allocator());
  std::unique_ptr<PrefixCache> cache;
  const CacheMode cache_mode = parse_cache_mode(args.get("--cache-mode", "exact"));
  if (args.has("--prompt-cache")) {
    const std::string cache_dir = args.get("--prompt-cache");
    std::error_code ec;
    std::filesystem::create_directories(cache_dir, ec);
    if (ec) fail("--prompt-cache", cache_dir + ": cannot create the folder: " + ec.message());
    DiskTierOptions disk;
    disk.log = [](const std::string& w) { std::fprintf(stderr, "dsv41 generate: warning: %s\n", w.c_str()); };
    cache = std::make_unique<PrefixCache>(*model, pools, cache_mode, uint64_t{1} << 30, cache_dir, so.index_keys, disk);
  }
  Session session(*model, pools, so, cache.get());
  const std::string spec_name = args.get("--speculative", "");
  if (!spec_name.empty() && spec_name != "dspark") fail("--speculative", "the only method is dspark, got \"" + spec_name + "\"");
  if (args.has("--draft-length") && spec_name.empty()) fail("--draft-length", "needs --speculative dspark");
  if (args.has("--oracle-drafts") && spec_name.empty()) fail("--oracle-drafts", "needs --speculative dspark");
  if (!spec_name.empty() && teacher) fail("--speculative", "cannot be combined with --teacher-ids");
  std::unique_ptr<Drafter> drafter;
  std::unique_ptr<SpeculativeDecoder> spec;
  if (!spec_name.empty()) {
    drafter = std::make_unique<Drafter>(*model);
    attach_drafter(session, *drafter);
    SpeculativeOptions spo;
    spo.fixed_length = static_cast<int>(args.get_int("--draft-length", 0, 1, drafter->block_size()));
    if (args.has("--oracle-drafts")) {
      const std::vector<int32_t> oracle = parse_ids("--oracle-drafts", args.get("--oracle-drafts"));
      const int64_t start = static_cast<int64_t>(prompt.size()), block = drafter->block_size();
      const int64_t length = spo.fixed_length > 0 ? spo.fixed_length : block;
      spo.force_drafts = [oracle, start, length](int64_t pos, const std::vector<int32_t>&) {
        std::vector<int32_t> d;  // the continuation after the token at `pos`
        for (int64_t i = pos - start + 1; i < static_cast<int64_t>(oracle.size()) && static_cast<int64_t>(d.size()) < length; ++i) {
          d.push_back(oracle[static_cast<size_t>(i)]);
        }
        return d;
      };
    }
    spec = std::make_unique<SpeculativeDecoder>(session, *drafter, sampler, spo);
  }
  const bool tty = isatty(fileno(stderr)) != 0;
  const auto t_prefill = std::chrono::steady_clock::now();
  std::vector<float> logits = session.prefill(prompt, [&](int64_t done, int64_t total) {
    if (tty && total >= 256) {
      std::fprintf(stderr, "\rprefill %lld/%lld tokens (%.0f tok/s)", static_cast<long long>(done),
                   static_cast<long long>(total), static_cast<double>(done) / seconds_since(t_prefill));
      if (done == total) std::fputc('\n', stderr);
    }
  });
  const double prefill_s = seconds_since(t_prefill);

  std::vector<int32_t> generated;
  std::vector<float> dump;
  const bool want_dump = args.has("--dump-logits");
  StreamDecoder stream(tokenizer);
  double decode_s = 0;
  // emits one token (and the logits row that chose it); false once generation must stop
  auto emit = [&](int32_t token, const float* row) {
    if (want_dump) dump.insert(dump.end(), row, row + cfg.vocab_size);
    generated.push_back(token);
    if (!json_out) {
      std::string piece = stream.push(token);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    const bool eos = !teacher && token == cfg.eos_token_id && !args.has("--ignore-eos");
    return !eos && static_cast<int64_t>(generated.size()) < n_predict;
  };
  if (n_predict > 0) {
    int32_t token = teacher ? teacher_ids[0] : sampler.sample(logits.data(), cfg.vocab_size);
    bool more = emit(token, logits.data());
    while (more) {
      const auto t0 = std::chrono::steady_clock::now();
      if (spec) {
        SpeculativeDecoder::Step st = spec->step(token);
        decode_s += seconds_since(t0);
        for (size_t i = 0; i < st.tokens.size() && more; ++i) {
          more = emit(st.tokens[i], &st.rows[i * static_cast<size_t>(cfg.vocab_size)]);
          token = st.tokens[i];
        }
        continue;
      }
      logits = session.decode(token);
      decode_s += seconds_since(t0);
      token = teacher ? teacher_ids[generated.size()] : sampler.sample(logits.data(), cfg.vocab_size);
      more = emit(token, logits.data());
    }
  }
  if (!json_out) {
    std::string rest = stream.flush() + "\n";
    std::fwrite(rest.data(), 1, rest.size(), stdout);
  }

  if (want_dump) {
    const int64_t rows = static_cast<int64_t>(dump.size()) / cfg.vocab_size;
    std::string out = "dsv41-logits v1 vocab=" + std::to_string(cfg.vocab_size) + " rows=" + std::to_string(rows) + "\n";
    out.append(reinterpret_cast<const char*>(dump.data()), dump.size() * sizeof(float));
    write_file_atomic(args.get("--dump-logits"), out.data(), out.size());
  }
  if (json_out) {
    nlohmann::json j = {
        {"prompt_tokens", prompt.size()},
        {"tokens", generated},
        {"text", tokenizer.decode(generated)},
        {"prefill_mode", mode},
        {"peak_rss_mb", peak_rss_mb()},
        {"cached_tokens", session.cache_hit().cached_tokens},
        {"replayed_tokens", session.cache_hit().replayed_tokens},
        {"cache_source", session.cache_hit().source},
        {"state_bytes_per_token", state_bytes_per_token(session.state(), session.position())},
        {"timings",
         {{"prefill_s", prefill_s},
          {"decode_s", decode_s},
          {"prefill_tok_s", prefill_s > 0 ? static_cast<double>(prompt.size()) / prefill_s : 0.0},
          {"decode_tok_s", decode_s > 0 ? static_cast<double>(generated.size() - 1) / decode_s : 0.0}}},
    };
    if (spec) {
      const SpeculativeStats& ss = spec->stats();
      j["spec"] = {{"proposed", ss.proposed},
                   {"accepted", ss.accepted},
                   {"accepted_per_position", ss.accepted_per_position},
                   {"mean_accept_len", ss.mean_accept_len()},
                   {"target_forwards", ss.target_forwards},
                   {"target_forwards_per_token",
                    generated.size() > 1 ? static_cast<double>(ss.target_forwards) / static_cast<double>(generated.size() - 1) : 0.0}};
    }
    if (session.cache_tokens_stored() > 0 && session.cache_bytes_written() > 0) {
      j["disk_bytes_per_token"] = static_cast<double>(session.cache_bytes_written()) /
                                  static_cast<double>(session.cache_tokens_stored());
    }
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace dsv41::cli
