// The leading rank's side of an expert-parallel job (model/expert_peers.h) over MPI: per MoE layer the
// routing goes to every rank and each owner gets the token rows its experts need (an all-to-all-v,
// bf16 rows), the owners' outputs come back the same way; Engram ids go to the ranks holding their
// rows and the rows come back. Each expert computes exactly the rows, in the same batch, that it does
// in a single process, and rank 0 sums them in ascending expert order as before: the same bits.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "model/expert_peers.h"
#include "parallel/mpi_job.h"

namespace dsv41 {

struct ExchangeStats {
  uint64_t bytes = 0;          // sent and received by rank 0: every byte the job moved between ranks
  int64_t moe_layers = 0;      // MoE layers exchanged
  int64_t engram_lookups = 0;  // Engram gathers exchanged
};

class MpiExpertPeers final : public ExpertPeers {
 public:
  // Greets the other ranks with `fingerprint` (the model fingerprint of what rank 0 loads): an Error
  // naming the ranks that loaded another checkpoint. `job` must be the leading rank's and outlive this.
  MpiExpertPeers(MpiJob& job, const std::string& fingerprint);

  const ExpertShare& share() const override { return share_; }
  void dispatch(int layer, const float* x, int64_t tokens, int64_t dim, const int32_t* experts, const float* weights,
                int64_t k, const MoeDispatch& d) override;
  void combine(int layer, const MoeDispatch& d, int64_t dim, float* routed) override;
  void engram_rows(int slot, const std::vector<int64_t>& ids, int64_t table_rows, int64_t row_bytes,
                   int64_t scale_bytes, uint8_t* codes, uint8_t* scales) override;

  ExchangeStats stats() const;
  // Every rank's resident bytes now, in rank order.
  std::vector<uint64_t> resident_bytes_per_rank();

 private:
  void count(uint64_t bytes);
  MpiJob& job_;
  ExpertShare share_;
  // One exchange at a time, a dispatch and its combine as one (engines sharing a model may run their
  // forwards on different threads).
  std::mutex exchange_;
  std::unique_lock<std::mutex> moe_held_;
  mutable std::mutex stats_mu_;
  ExchangeStats stats_;
};

// The fingerprint an expert-parallel job compares across ranks: model_fingerprint of `dir`'s config
// and checkpoint (io/config.h).
std::string expert_parallel_fingerprint(const std::string& dir);

}  // namespace dsv41
