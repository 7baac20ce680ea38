// Small helpers shared by the test files.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/config.h"
#include "model/model.h"
#include "model/synthetic_checkpoint.h"
#include "runtime/sampler.h"
#include "state/state_pools.h"
#include "text/tiny_tokenizer.h"
#include "test_paths.h"

// Sanitizer builds (cmake -DDSV41_SANITIZE=address|thread) run several times slower and hold more
// memory (ASan's shadow and quarantine): a test that checks a speed or a peak memory skips there with
// this, and keeps its check in every other build. Use inside a TEST body.
#ifdef DSV41_SANITIZED
#define DSV41_SKIP_UNDER_SANITIZERS(what) \
  GTEST_SKIP() << what << " is not meaningful under the " DSV41_SANITIZED " sanitizer build"
#else
#define DSV41_SKIP_UNDER_SANITIZERS(what) static_cast<void>(0)
#endif

namespace dsv41::test {

// True in sanitizer builds: the slowest sweeps run a smaller sample there (the Release run keeps them
// whole), so the sanitizer stages of scripts/test.sh fit CI's time.
#ifdef DSV41_SANITIZED
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// The data the tests read lives in the project (tests/golden/README.md, configs/README.md), so a
// fresh clone needs nothing beside it.
inline std::string released_config() { return source_dir() + "/configs/deepseek-v4.1-flash/config.json"; }
inline std::string golden_dir(const std::string& name) { return source_dir() + "/tests/golden/" + name; }

// A fresh empty folder under the system temp dir, removed when the object goes away.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dsv41-test-XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct CommandResult {
  int status = -1;
  std::string out;  // stdout and stderr together
};

// Runs `script` with /bin/sh, stdout and stderr together.
inline CommandResult run_shell(const std::string& script) {
  CommandResult r;
  FILE* p = popen(("{ " + script + "\n} 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Runs the dsv41 binary with the given argument string (shell syntax).
inline CommandResult run_dsv41(const std::string& args) {
  CommandResult r;
  std::string cmd = test::dsv41_binary() + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int status = pclose(p);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The tiny preset written once per test process (seed 0), shared by tests that only read it.
inline const std::string& tiny_model_dir() {
  static TempDir dir;
  static const bool written = (write_synthetic_checkpoint(dir.path(), "tiny", 0), true);
  (void)written;
  return dir.path();
}

// The long-context preset (1M positions, sparse selection from a few thousand tokens on), written
// once per test process.
inline const std::string& long_model_dir() {
  static TempDir dir;
  static const bool written = (write_synthetic_checkpoint(dir.path(), "long", 0), true);
  (void)written;
  return dir.path();
}

// The tiny preset with a vision tower (make-tiny --vision: tiny-vision's tower geometry and image
// plan, the tiny preset's tokenizer, so chat text tokenizes), written once per test process.
inline const std::string& tiny_vision_model_dir() {
  static TempDir dir;
  static const bool written = [] {
    const nlohmann::json tokenizer = build_tiny_tokenizer(synthetic_config("tiny").vocab_size);
    write_synthetic_checkpoint(dir.path(), with_synthetic_vision(synthetic_config("tiny", tokenizer), tokenizer), 0,
                               tokenizer, synthetic_shard_bytes("tiny"));
    return true;
  }();
  (void)written;
  return dir.path();
}

// The tiny preset loaded once per test process.
inline const Model& tiny_model() {
  static std::unique_ptr<Model> model = load_model(tiny_model_dir());
  return *model;
}

// Page pools for sequences of `model`, one set per model geometry for the whole test process (they
// must outlive every sequence that uses them).
inline StatePools& pools_for(const Model& model) {
  static HostAllocator host;  // constructed first, so destroyed after the pools whose pages it holds
  static std::map<std::string, std::unique_ptr<StatePools>> pools;
  auto& p = pools[config_fingerprint(model.config())];
  if (!p) p = std::make_unique<StatePools>(model.config(), model.roles(), host);
  return *p;
}

// Relative L2 distance of the logits rows `a` from `ref`, and in how many rows their argmaxes agree.
struct Deviation {
  double rel_l2 = 0;
  int same_top1 = 0, rows = 0;
};
inline Deviation deviation(const std::vector<float>& a, const std::vector<float>& ref, int64_t vocab) {
  Deviation d;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  d.rel_l2 = std::sqrt(num / den);
  d.rows = static_cast<int>(static_cast<int64_t>(ref.size()) / vocab);
  for (int r = 0; r < d.rows; ++r) d.same_top1 += argmax(&a[r * vocab], vocab) == argmax(&ref[r * vocab], vocab);
  return d;
}

}  // namespace dsv41::test
