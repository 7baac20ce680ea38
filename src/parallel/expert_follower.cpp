#include "parallel/expert_follower.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "io/config.h"
#include "model/moe.h"
#include "model/weights.h"
#include "parallel/exchange.h"
#include "parallel/mpi_wait.h"
#include "util/error.h"

namespace dsv41 {

namespace {

class Follower {
 public:
  Follower(MpiJob& job, const std::string& dir, std::shared_ptr<const Backend> backend, EngramTier engram)
      : job_(job), be_(std::move(backend)), share_{job.rank(), job.ranks()}, config_(load_config(dir)) {
    WeightPlacement placement;
    placement.share = share_;
    placement.dense = false;
    weights_ = std::make_unique<ModelWeights>(dir, config_, be_, engram, placement);
    fingerprint_ = model_fingerprint(config_, weights_->checkpoint().fingerprint());
  }

  void serve() {
    for (;;) {
      const JobCommand c = job_.receive();
      switch (c.op) {
        case JobOp::Hello: hello(c); break;
        case JobOp::Moe: moe(c); break;
        case JobOp::Engram: engram(c); break;
        case JobOp::Report: report(); break;
        case JobOp::Stop: return;
        default: fail("expert parallel", "unknown command " + std::to_string(static_cast<int64_t>(c.op)));
      }
    }
  }

 private:
  void hello(const JobCommand& c) {
    const int64_t match = std::stoull(fingerprint_, nullptr, 16) == static_cast<uint64_t>(c.a) ? 1 : 0;
    wait_for(job_, "the greeting's answers", [&](MPI_Request* r) { return MPI_Igather(&match, 1, MPI_INT64_T, nullptr, 1, MPI_INT64_T, 0, MPI_COMM_WORLD, r); });
  }

  // One MoE layer: the routing, the rows of this share's tokens, its experts, their outputs back.
  void moe(const JobCommand& c) {
    const int layer = static_cast<int>(c.a);
    const int64_t s = c.b, k = c.c, dim = config_.dim, n = job_.ranks();
    if (layer < 0 || layer >= static_cast<int>(weights_->layers.size())) fail("expert parallel", "no MoE layer " + std::to_string(layer));
    std::vector<int32_t> experts(static_cast<size_t>(s * k));
    std::vector<float> weights(static_cast<size_t>(s * k));
    wait_for(job_, "the routing", [&](MPI_Request* r) { return MPI_Ibcast(experts.data(), static_cast<int>(s * k), MPI_INT32_T, 0, MPI_COMM_WORLD, r); });
    wait_for(job_, "the routing weights", [&](MPI_Request* r) { return MPI_Ibcast(weights.data(), static_cast<int>(s * k), MPI_FLOAT, 0, MPI_COMM_WORLD, r); });
    const int64_t n_experts = config_.routed_experts(layer);
    const MoeDispatch d = be_->moe_dispatch(experts.data(), weights.data(), s, k, n_experts);
    const auto [first, end] = share_.experts(n_experts);
    const std::vector<int64_t> tokens = tokens_of_experts(d, first, end);
    // the rows, into their places of a [tokens, dim] x whose other rows no expert here reads
    std::vector<uint16_t> rows(std::max<size_t>(1, tokens.size() * static_cast<size_t>(dim)));
    std::vector<int> counts(static_cast<size_t>(n), 0), displs(static_cast<size_t>(n), 0);
    counts[0] = static_cast<int>(tokens.size() * static_cast<size_t>(dim));
    uint16_t nothing = 0;
    wait_for(job_, "the token rows", [&](MPI_Request* r) { return MPI_Ialltoallv(&nothing, displs.data(), displs.data(), MPI_UINT16_T, rows.data(), counts.data(), displs.data(),
                  MPI_UINT16_T, MPI_COMM_WORLD, r); });
    std::vector<float> x(static_cast<size_t>(s * dim), 0.0f);
    for (size_t i = 0; i < tokens.size(); ++i) bf16_to_floats(&rows[i * static_cast<size_t>(dim)], dim, &x[static_cast<size_t>(tokens[i] * dim)]);
    const int64_t from = d.offsets[static_cast<size_t>(first)], to = d.offsets[static_cast<size_t>(end)];
    std::vector<float> routed(static_cast<size_t>(std::max<int64_t>(1, d.entries() * dim)));
    run_routed_experts(*be_, config_, layer, weights_->layers[static_cast<size_t>(layer)].ffn, x.data(), d, first, end,
                       nullptr, routed.data());
    std::vector<uint16_t> out(static_cast<size_t>(std::max<int64_t>(1, (to - from) * dim)));
    floats_to_bf16(&routed[static_cast<size_t>(from * dim)], (to - from) * dim, out.data());
    std::vector<int> send_counts(static_cast<size_t>(n), 0), none(static_cast<size_t>(n), 0);
    send_counts[0] = static_cast<int>((to - from) * dim);
    wait_for(job_, "the expert outputs", [&](MPI_Request* r) { return MPI_Ialltoallv(out.data(), send_counts.data(), none.data(), MPI_UINT16_T, &nothing, none.data(), none.data(),
                  MPI_UINT16_T, MPI_COMM_WORLD, r); });
  }

  // One Engram gather: the ids asked of this share, their codes and scales back.
  void engram(const JobCommand& c) {
    const size_t slot = static_cast<size_t>(c.a);
    if (slot >= config_.engram_layer_ids.size()) fail("expert parallel", "no Engram slot " + std::to_string(slot));
    EngramStore& table = *weights_->layers[static_cast<size_t>(config_.engram_layer_ids[slot])].engram->table;
    const int64_t n = job_.ranks(), rb = table.row_bytes(), sb = table.scale_bytes();
    int mine = 0;
    wait_for(job_, "the Engram id counts", [&](MPI_Request* r) { return MPI_Iscatter(nullptr, 1, MPI_INT, &mine, 1, MPI_INT, 0, MPI_COMM_WORLD, r); });
    std::vector<int64_t> ids(static_cast<size_t>(std::max(1, mine)));
    std::vector<int> counts(static_cast<size_t>(n), 0), none(static_cast<size_t>(n), 0);
    counts[0] = mine;
    int64_t no_id = 0;
    wait_for(job_, "the Engram ids", [&](MPI_Request* r) { return MPI_Ialltoallv(&no_id, none.data(), none.data(), MPI_INT64_T, ids.data(), counts.data(), none.data(), MPI_INT64_T,
                  MPI_COMM_WORLD, r); });
    ids.resize(static_cast<size_t>(mine));
    std::vector<uint8_t> codes(ids.size() * static_cast<size_t>(rb)), scales(ids.size() * static_cast<size_t>(sb));
    table.gather(table.prefetch(ids), codes.data(), scales.data());
    std::vector<uint8_t> back(std::max<size_t>(1, ids.size() * static_cast<size_t>(rb + sb)));
    for (size_t i = 0; i < ids.size(); ++i) {
      std::copy_n(&codes[i * static_cast<size_t>(rb)], rb, &back[i * static_cast<size_t>(rb + sb)]);
      std::copy_n(&scales[i * static_cast<size_t>(sb)], sb, &back[i * static_cast<size_t>(rb + sb) + static_cast<size_t>(rb)]);
    }
    std::vector<int> send_counts(static_cast<size_t>(n), 0);
    send_counts[0] = static_cast<int>(ids.size() * static_cast<size_t>(rb + sb));
    uint8_t nothing = 0;
    wait_for(job_, "the Engram rows", [&](MPI_Request* r) { return MPI_Ialltoallv(back.data(), send_counts.data(), none.data(), MPI_UINT8_T, &nothing, none.data(), none.data(),
                  MPI_UINT8_T, MPI_COMM_WORLD, r); });
  }

  void report() {
    const uint64_t mine = resident_bytes();
    wait_for(job_, "the resident bytes", [&](MPI_Request* r) { return MPI_Igather(&mine, 1, MPI_UINT64_T, nullptr, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD, r); });
  }

  MpiJob& job_;
  std::shared_ptr<const Backend> be_;
  ExpertShare share_;
  ModelConfig config_;
  std::unique_ptr<ModelWeights> weights_;
  std::string fingerprint_;
};

}  // namespace

void follow_leader(MpiJob& job, const std::string& dir, std::shared_ptr<const Backend> backend, EngramTier engram) {
  try {
    Follower(job, dir, std::move(backend), engram).serve();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv41 (expert-parallel rank %d of %d): error: %s\n", job.rank(), job.ranks(), e.what());
    job.abort(1);
  }
}

}  // namespace dsv41
