// The memory plan (model/memory_plan.h): its figures against independent arithmetic on the released
// config, the loader allocating exactly what it counts, every placement computing the same bits, the
// refusal before loading, sizes and host limits as read, and the `plan` command.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "io/config.h"
#include "kernels/backend.h"
#include "model/memory_plan.h"
#include "model/model.h"
#include "runtime/session.h"
#include "test_util.h"
#include "util/error.h"
#include "util/host_memory.h"

namespace dsv41 {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30, kMiB = uint64_t{1} << 20;

MemoryPlanRequest request(uint64_t ram, int tile_rows) {
  MemoryPlanRequest r;
  r.ram_bytes = ram;
  r.tile_rows = tile_rows;
  r.kv_bytes = kGiB;
  r.prompt_cache_bytes = 256 * kMiB;
  r.prefill_chunk = 256;
  r.threads = 2;
  return r;
}

// One routed expert of the released geometry, from the spec's shapes (model-spec §2): w1 and w3
// [2304, 5120/2] bytes with [2304, 5120/32] scales, w2 [5120, 2304/2] with [5120, 2304/32].
constexpr double kReleasedExpertBytes = 2.0 * (2304.0 * 2560 + 2304.0 * 160) + (5120.0 * 1152 + 5120.0 * 72);

TEST(MemoryPlan, ReleasedCheckpointByBudget) {
  const ModelConfig c = load_config(test::released_config());
  const MemoryPlan big = plan_memory(c, request(768 * kGiB, 32));
  ASSERT_TRUE(big.fits()) << big.refusal;
  uint64_t total = 0;
  for (const PlanRow& r : big.rows) total += r.checkpoint_bytes;
  // what inspect reports for the release: the text model's 509.315 GB and the vision tower's (ViT,
  // aligner, span vectors, bias_vl) 0.971 GB
  EXPECT_NEAR(static_cast<double>(total), 510.286e9, 0.001e9);
  EXPECT_TRUE(big.pack_dense);
  EXPECT_TRUE(big.pack_experts);
  // w1, w2, w3 and their scales for every expert of every backbone layer and DSpark block
  EXPECT_EQ(big.find("routed_experts")->tensors, 6 * (40 * 384 + c.n_mtp_layers * c.routed_experts(c.n_layers)));
  EXPECT_DOUBLE_EQ(big.hit_rate, 1);
  EXPECT_DOUBLE_EQ(big.disk_bytes_per_token, 0);
  // top-6 of 384 in each of the 40 backbone layers
  EXPECT_DOUBLE_EQ(big.expert_bytes_per_token, 40 * 6 * kReleasedExpertBytes);
  EXPECT_LE(big.steady_bytes, 768 * kGiB);

  // 64 GB: the dense matrices packed, the experts streamed into a cache of packed experts that takes
  // what is left.
  const MemoryPlan mid = plan_memory(c, request(64 * kGiB, 32));
  ASSERT_TRUE(mid.fits()) << mid.refusal;
  EXPECT_TRUE(mid.pack_dense);
  EXPECT_FALSE(mid.pack_experts);
  const PlanRow& streamed = *mid.find("routed_experts");
  EXPECT_EQ(streamed.residence, Residence::Streamed);
  EXPECT_GT(mid.expert_cache_bytes, 40 * kGiB);
  EXPECT_EQ(streamed.anon_bytes, mid.expert_cache_bytes);
  EXPECT_EQ(mid.steady_bytes, 64 * kGiB) << "the expert cache takes the rest of the budget";
  // uniform routing: the cached share of the experts, packed (a released expert packs to its own size)
  EXPECT_NEAR(mid.hit_rate, static_cast<double>(mid.expert_cache_bytes) / static_cast<double>(big.find("routed_experts")->anon_bytes), 1e-12);
  EXPECT_EQ(big.find("routed_experts")->anon_bytes, big.find("routed_experts")->checkpoint_bytes);
  // A stated hit rate: the experts' misses plus one page per Engram row (the tables stay cold).
  MemoryPlanRequest at_half = request(64 * kGiB, 32);
  at_half.hit_rate = 0.5;
  const MemoryPlan half = plan_memory(c, at_half);
  const double engram_rows = 2.0 * c.engram_hash_columns() * 4096;
  EXPECT_DOUBLE_EQ(half.disk_bytes_per_token, 0.5 * 40 * 6 * kReleasedExpertBytes + engram_rows);

  // No BF16 matrix twice: wo_a's packed copy alone (o_lora_rank is a multiple of the tile height).
  const PlanRow& wo_a = *big.find("wo_a");
  const uint64_t woa_values = static_cast<uint64_t>(c.o_groups) * c.o_lora_rank * (c.n_heads * c.head_dim / c.o_groups);
  EXPECT_EQ(wo_a.anon_bytes, static_cast<uint64_t>(c.total_layers()) * woa_values * 2);
  // A backend that reads the checkpoint's layout packs nothing: the converted copy is all it holds.
  const MemoryPlan unpacked = plan_memory(c, request(768 * kGiB, 0));
  EXPECT_FALSE(unpacked.pack_dense);
  EXPECT_EQ(unpacked.find("wo_a")->anon_bytes, wo_a.anon_bytes);

  // Too small for even the runtime and the converted tensors: refused, naming both sides.
  const MemoryPlan tiny = plan_memory(c, request(2 * kGiB, 32));
  EXPECT_FALSE(tiny.fits());
  EXPECT_NE(tiny.refusal.find("budget is 2.00 GiB"), std::string::npos) << tiny.refusal;
  EXPECT_NE(tiny.refusal.find("converted tensors"), std::string::npos) << tiny.refusal;
  try {
    require_plan_fits(tiny, "released");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("released: does not fit in the memory budget"), std::string::npos) << e.what();
  }
}

// The smallest budget at which the tiny preset's plan takes each placement it can choose.
std::map<std::pair<bool, bool>, uint64_t> tiny_placements(const Backend& backend, ModelOptions o) {
  const ModelConfig c = load_config(test::tiny_model_dir());
  std::map<std::pair<bool, bool>, uint64_t> first;
  for (uint64_t ram = kMiB; ram <= 512 * kMiB; ram += kMiB / 4) {
    o.ram_bytes = ram;
    const MemoryPlan plan = plan_model_memory(c, backend, o);
    if (plan.fits()) first.emplace(std::make_pair(plan.pack_dense, plan.pack_experts), ram);
  }
  return first;
}

ModelOptions tiny_options(std::shared_ptr<const Backend> backend) {
  ModelOptions o;
  o.backend = std::move(backend);
  o.kv_bytes = 16 * kMiB;
  return o;
}

// The loader's anonymous bytes are the plan's, at every placement the plan chooses, and a budget
// below the minimal plan is refused.
TEST(MemoryPlan, TheLoaderAllocatesWhatThePlanCounts) {
  std::shared_ptr<const Backend> backend = make_backend();
  if (backend->weight_tile_rows() == 0) GTEST_SKIP() << "this backend packs nothing";
  ModelOptions o = tiny_options(backend);
  const auto placements = tiny_placements(*backend, o);
  ASSERT_EQ(placements.size(), 3u) << "all packed, dense only, nothing packed";
  for (const auto& [packs, ram] : placements) {
    o.ram_bytes = ram;
    MemoryPlan followed;
    const auto model = load_model(test::tiny_model_dir(), o, &followed);
    EXPECT_EQ(std::make_pair(followed.pack_dense, followed.pack_experts), packs);
    EXPECT_EQ(model->weights().anon_bytes(), followed.weights_anon_bytes)
        << "budget " << ram << ", dense packed " << packs.first << ", experts packed " << packs.second;
  }
  o.ram_bytes = placements.begin()->second - kMiB / 4;
  try {
    load_model(test::tiny_model_dir(), o);
    ADD_FAILURE() << "a load below its minimal plan";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit in the memory budget"), std::string::npos) << e.what();
  }
}

// Packed or read through the mapping, each class computes the same bits (the kernels' two layouts
// are held to the same results op by op; this checks the loader's wiring of them, wo_a's packed-only
// copy included).
TEST(MemoryPlan, EveryPlacementGivesTheSameLogits) {
  std::shared_ptr<const Backend> backend = make_backend();
  ModelOptions o = tiny_options(backend);
  std::vector<float> want_prefill, want_decode;
  for (const auto& [packs, ram] : tiny_placements(*backend, o)) {
    o.ram_bytes = ram;
    const auto model = load_model(test::tiny_model_dir(), o);
    const std::vector<int32_t> prompt = {0, 17, 93, 41, 250, 7, 8, 99, 300, 12, 64, 5, 77, 3, 1000, 31, 2, 9};
    Session session(*model, test::pools_for(*model), {});
    const std::vector<float> prefill = session.prefill(prompt), decode = session.decode(42);
    if (want_prefill.empty()) {
      want_prefill = prefill;
      want_decode = decode;
      continue;
    }
    EXPECT_EQ(prefill, want_prefill) << "dense packed " << packs.first << ", experts packed " << packs.second;
    EXPECT_EQ(decode, want_decode) << "dense packed " << packs.first << ", experts packed " << packs.second;
  }
}

TEST(HostMemory, SizesAsUsersWriteThem) {
  EXPECT_EQ(parse_byte_size("16G", "--ram"), 16 * kGiB);
  EXPECT_EQ(parse_byte_size("512M", "--ram"), 512 * kMiB);
  EXPECT_EQ(parse_byte_size("1.5GiB", "--ram"), 3 * kGiB / 2);
  EXPECT_EQ(parse_byte_size("64kb", "--ram"), 64 * 1024u);
  EXPECT_EQ(parse_byte_size("123", "--ram"), 123u);
  EXPECT_EQ(parse_byte_size("2T", "--ram"), 2048 * kGiB);
  for (const char* bad : {"", "G", "16X", "16GG", "-1G", "0", "1e3G", "16 G", "nanG", "99999999999T"}) {
    try {
      parse_byte_size(bad, "--ram");
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_EQ(e.where(), "--ram") << bad;
    }
  }
  EXPECT_EQ(format_bytes(1536.0 * kMiB), "1.50 GiB");
  const HostMemory host = read_host_memory();
  EXPECT_GT(host.total_bytes, 0u);
  EXPECT_GT(host.budget_bytes(), 0u);
  EXPECT_LE(host.budget_bytes(), host.total_bytes);
}

// The detection reads the smallest memory limit along this process's cgroup path (v1 and v2), here
// from files a test writes; a --ram above it is refused naming both numbers and the cgroup, one at or
// below it is the budget, and without one the budget is the lower of the limit and the available RAM.
TEST(HostMemory, ReadsTheCgroupLimitAndRefusesRamAboveIt) {
  test::TempDir dir;
  const auto put = [&](const std::string& rel, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(dir / rel).parent_path());
    std::ofstream(dir / rel) << text;
  };
  put("meminfo", "MemTotal:       16777216 kB\nMemFree:  1 kB\nMemAvailable:    8388608 kB\n");
  put("v1-cgroup", "5:cpu:/\n4:memory:/jobs/one\n0::/\n");
  put("v1/jobs/memory.limit_in_bytes", std::to_string(3 * kGiB) + "\n");
  put("v1/jobs/one/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  put("v2-cgroup", "0::/svc/app\n");
  put("v2/svc/memory.max", "max\n");
  put("v2/svc/app/memory.max", std::to_string(2 * kGiB) + "\n");
  HostMemoryFiles files{dir / "meminfo", dir / "v1-cgroup", dir / "v1", dir / "v2"};

  const HostMemory v1 = read_host_memory(files);
  EXPECT_EQ(v1.total_bytes, 16 * kGiB);
  EXPECT_EQ(v1.available_bytes, 8 * kGiB);
  EXPECT_EQ(v1.cgroup_limit_bytes, 3 * kGiB);
  EXPECT_EQ(v1.cgroup, dir / "v1/jobs");
  files.self_cgroup = dir / "v2-cgroup";
  const HostMemory v2 = read_host_memory(files);
  EXPECT_EQ(v2.cgroup_limit_bytes, 2 * kGiB);
  EXPECT_EQ(v2.cgroup, dir / "v2/svc/app");

  EXPECT_EQ(v2.ram_budget(0), 2 * kGiB);
  EXPECT_EQ(v2.ram_budget(2 * kGiB), 2 * kGiB);
  EXPECT_EQ(v2.ram_budget(kGiB), kGiB);
  EXPECT_EQ(v2.ram_refusal(2 * kGiB), "");
  try {
    v2.ram_budget(2 * kGiB + 1);
    ADD_FAILURE() << "a budget above the cgroup's limit was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.where(), "--ram");
    EXPECT_NE(std::string(e.what()).find("--ram: 2147483649 bytes (2.00 GiB) is above the memory cgroup's limit of "
                                         "2147483648 bytes (2.00 GiB, " + dir / "v2/svc/app" + ")"),
              std::string::npos) << e.what();
  }
  files.self_cgroup = dir / "nothing";  // no cgroup file: no limit, any budget goes
  const HostMemory free = read_host_memory(files);
  EXPECT_EQ(free.cgroup_limit_bytes, 0u);
  EXPECT_EQ(free.ram_budget(64 * kGiB), 64 * kGiB);
  EXPECT_EQ(free.ram_budget(0), 8 * kGiB);
}

TEST(CliPlan, PlansAFolderOrAConfigAndRefusesWhatDoesNotFit) {
  const auto released = test::run_dsv41("plan " + test::released_config() + " --ram 64G --json");
  ASSERT_EQ(released.status, 0) << released.out;
  const nlohmann::json j = nlohmann::json::parse(released.out);
  EXPECT_EQ(j["budget_bytes"].get<uint64_t>(), 64 * kGiB);
  EXPECT_TRUE(j["fits"].get<bool>());
  EXPECT_EQ(j["classes"].size(), 7u);
  EXPECT_GT(j["disk_bytes_per_token"].get<double>(), 0);

  const auto folder = test::run_dsv41("plan -m " + test::tiny_model_dir());
  ASSERT_EQ(folder.status, 0) << folder.out;
  EXPECT_NE(folder.out.find("routed_experts"), std::string::npos) << folder.out;

  const auto refused = test::run_dsv41("plan " + test::released_config() + " --ram 1G");
  EXPECT_EQ(refused.status, 1) << refused.out;
  EXPECT_NE(refused.out.find("does not fit: even the minimal plan needs"), std::string::npos) << refused.out;
  const auto bad = test::run_dsv41("plan " + test::released_config() + " --ram 12Q");
  EXPECT_EQ(bad.status, 1) << bad.out;
  EXPECT_NE(bad.out.find("--ram: must be a size"), std::string::npos) << bad.out;
  const auto load = test::run_dsv41("generate -m " + test::tiny_model_dir() + " -p hi -n 1 --ram 1M");
  EXPECT_NE(load.status, 0);
  EXPECT_NE(load.out.find("does not fit in the memory budget"), std::string::npos) << load.out;
}

}  // namespace
}  // namespace dsv41
