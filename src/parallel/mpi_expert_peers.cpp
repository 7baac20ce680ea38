#include "parallel/mpi_expert_peers.h"

#include <mpi.h>

#include <algorithm>
#include <string>

#include "io/config.h"
#include "io/safetensors.h"
#include "parallel/exchange.h"
#include "parallel/mpi_wait.h"
#include "util/error.h"

namespace dsv41 {

namespace {

// MPI counts are ints: a count past that is refused rather than truncated.
int mpi_count(int64_t n, const char* what) {
  if (n < 0 || n > INT32_MAX) fail("expert parallel", std::string(what) + " of " + std::to_string(n) + " elements is more than one MPI call moves");
  return static_cast<int>(n);
}

uint64_t fingerprint_bits(const std::string& fingerprint) {
  try {
    return std::stoull(fingerprint, nullptr, 16);
  } catch (const std::exception&) {
    fail("expert parallel", "model fingerprint '" + fingerprint + "' is not hexadecimal");
  }
}

}  // namespace

std::string expert_parallel_fingerprint(const std::string& dir) {
  return model_fingerprint(load_config(dir), Checkpoint(dir).fingerprint());
}

MpiExpertPeers::MpiExpertPeers(MpiJob& job, const std::string& fingerprint)
    : job_(job), share_{job.rank(), job.ranks()} {
  if (!job.leading()) fail("expert parallel", "the peers are rank 0's view of the others");
  job_.send({JobOp::Hello, static_cast<int64_t>(fingerprint_bits(fingerprint))});
  const int64_t mine = 1;
  std::vector<int64_t> matches(static_cast<size_t>(job_.ranks()));
  wait_for(job_, "the greeting's answers", [&](MPI_Request* r) { return MPI_Igather(&mine, 1, MPI_INT64_T, matches.data(), 1, MPI_INT64_T, 0, MPI_COMM_WORLD, r); });
  std::string others;
  for (int r = 1; r < job_.ranks(); ++r)
    if (matches[static_cast<size_t>(r)] != 1) others += (others.empty() ? "" : ", ") + std::to_string(r);
  if (!others.empty()) {
    fail("expert parallel", "rank(s) " + others + " loaded a checkpoint other than rank 0's (model fingerprint " +
                                fingerprint + "): every rank must read the same model folder");
  }
}

void MpiExpertPeers::count(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.bytes += bytes;
}

ExchangeStats MpiExpertPeers::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

void MpiExpertPeers::dispatch(int layer, const float* x, int64_t s, int64_t dim, const int32_t* experts,
                              const float* weights, int64_t k, const MoeDispatch& d) {
  // Held until the combine; released here if the dispatch fails (a rank that stopped answering), so
  // that later exchanges fail with the job's failure instead of waiting for this lock.
  std::unique_lock<std::mutex> held(exchange_);
  const int n = job_.ranks();
  const int64_t n_experts = static_cast<int64_t>(d.offsets.size()) - 1;
  job_.send({JobOp::Moe, layer, s, k});
  // the routing, from which every rank derives the same dispatch
  const int routing = mpi_count(s * k, "a routing");
  wait_for(job_, "the routing", [&](MPI_Request* r) { return MPI_Ibcast(const_cast<int32_t*>(experts), routing, MPI_INT32_T, 0, MPI_COMM_WORLD, r); });
  wait_for(job_, "the routing weights", [&](MPI_Request* r) { return MPI_Ibcast(const_cast<float*>(weights), routing, MPI_FLOAT, 0, MPI_COMM_WORLD, r); });
  // to each owner, the rows of the tokens its experts take
  std::vector<uint16_t> rows;
  std::vector<int> send_counts(static_cast<size_t>(n), 0), send_displs(static_cast<size_t>(n), 0), none(static_cast<size_t>(n), 0);
  for (int r = 1; r < n; ++r) {
    const auto [first, end] = ExpertShare{r, n}.experts(n_experts);
    send_displs[static_cast<size_t>(r)] = mpi_count(static_cast<int64_t>(rows.size()), "a dispatch");
    append_bf16_rows(x, dim, tokens_of_experts(d, first, end), rows);
    send_counts[static_cast<size_t>(r)] = mpi_count(static_cast<int64_t>(rows.size()), "a dispatch") - send_displs[static_cast<size_t>(r)];
  }
  uint16_t nothing = 0;
  wait_for(job_, "the token rows", [&](MPI_Request* r) { return MPI_Ialltoallv(rows.data(), send_counts.data(), send_displs.data(), MPI_UINT16_T, &nothing, none.data(), none.data(),
                MPI_UINT16_T, MPI_COMM_WORLD, r); });
  count(static_cast<uint64_t>(n - 1) * (4 * sizeof(int64_t) + static_cast<uint64_t>(routing) * 8) +
        rows.size() * sizeof(uint16_t));
  moe_held_ = std::move(held);
}

void MpiExpertPeers::combine(int, const MoeDispatch& d, int64_t dim, float* routed) {
  std::unique_lock<std::mutex> held = std::move(moe_held_);
  const int n = job_.ranks();
  const int64_t n_experts = static_cast<int64_t>(d.offsets.size()) - 1;
  std::vector<int> recv_counts(static_cast<size_t>(n), 0), recv_displs(static_cast<size_t>(n), 0), none(static_cast<size_t>(n), 0);
  for (int r = 1; r < n; ++r) {
    const auto [first, end] = ExpertShare{r, n}.experts(n_experts);
    const int64_t from = d.offsets[static_cast<size_t>(first)], to = d.offsets[static_cast<size_t>(end)];
    recv_displs[static_cast<size_t>(r)] = mpi_count(from * dim, "a combine");
    recv_counts[static_cast<size_t>(r)] = mpi_count((to - from) * dim, "a combine");
  }
  // each owner's outputs land at its experts' entries, which are contiguous in dispatch order
  std::vector<uint16_t> outputs(static_cast<size_t>(std::max<int64_t>(1, d.entries() * dim)));
  uint16_t nothing = 0;
  wait_for(job_, "the expert outputs", [&](MPI_Request* r) { return MPI_Ialltoallv(&nothing, none.data(), none.data(), MPI_UINT16_T, outputs.data(), recv_counts.data(),
                recv_displs.data(), MPI_UINT16_T, MPI_COMM_WORLD, r); });
  uint64_t received = 0;
  for (int r = 1; r < n; ++r) {
    const size_t at = static_cast<size_t>(recv_displs[static_cast<size_t>(r)]);
    bf16_to_floats(&outputs[at], recv_counts[static_cast<size_t>(r)], routed + at);
    received += static_cast<uint64_t>(recv_counts[static_cast<size_t>(r)]) * sizeof(uint16_t);
  }
  count(received);
  std::lock_guard<std::mutex> lock(stats_mu_);
  ++stats_.moe_layers;
}

void MpiExpertPeers::engram_rows(int slot, const std::vector<int64_t>& ids, int64_t table_rows, int64_t row_bytes,
                                 int64_t scale_bytes, uint8_t* codes, uint8_t* scales) {
  std::lock_guard<std::mutex> exchange(exchange_);
  const int n = job_.ranks();
  job_.send({JobOp::Engram, slot, static_cast<int64_t>(ids.size())});
  // each owner's ids, in request order, and where their rows go
  std::vector<std::vector<int64_t>> wanted(static_cast<size_t>(n)), at(static_cast<size_t>(n));
  for (size_t i = 0; i < ids.size(); ++i) {
    const int owner = share_.row_owner(ids[i], table_rows);
    if (owner == 0) continue;
    wanted[static_cast<size_t>(owner)].push_back(ids[i]);
    at[static_cast<size_t>(owner)].push_back(static_cast<int64_t>(i));
  }
  std::vector<int> counts(static_cast<size_t>(n), 0), displs(static_cast<size_t>(n), 0), none(static_cast<size_t>(n), 0);
  std::vector<int64_t> flat;
  for (int r = 1; r < n; ++r) {
    displs[static_cast<size_t>(r)] = mpi_count(static_cast<int64_t>(flat.size()), "an Engram request");
    counts[static_cast<size_t>(r)] = mpi_count(static_cast<int64_t>(wanted[static_cast<size_t>(r)].size()), "an Engram request");
    flat.insert(flat.end(), wanted[static_cast<size_t>(r)].begin(), wanted[static_cast<size_t>(r)].end());
  }
  int mine = 0;
  wait_for(job_, "the Engram id counts", [&](MPI_Request* r) { return MPI_Iscatter(counts.data(), 1, MPI_INT, &mine, 1, MPI_INT, 0, MPI_COMM_WORLD, r); });
  int64_t no_id = 0;
  wait_for(job_, "the Engram ids", [&](MPI_Request* r) { return MPI_Ialltoallv(flat.data(), counts.data(), displs.data(), MPI_INT64_T, &no_id, none.data(), none.data(), MPI_INT64_T,
                MPI_COMM_WORLD, r); });
  // the rows back: codes then scales of each row, in the order asked
  const int64_t row = row_bytes + scale_bytes;
  std::vector<int> back_counts(static_cast<size_t>(n), 0), back_displs(static_cast<size_t>(n), 0);
  for (int r = 1; r < n; ++r) {
    back_counts[static_cast<size_t>(r)] = mpi_count(counts[static_cast<size_t>(r)] * row, "an Engram answer");
    back_displs[static_cast<size_t>(r)] = mpi_count(displs[static_cast<size_t>(r)] * row, "an Engram answer");
  }
  std::vector<uint8_t> back(std::max<size_t>(1, flat.size() * static_cast<size_t>(row)));
  uint8_t nothing = 0;
  wait_for(job_, "the Engram rows", [&](MPI_Request* r) { return MPI_Ialltoallv(&nothing, none.data(), none.data(), MPI_UINT8_T, back.data(), back_counts.data(), back_displs.data(),
                MPI_UINT8_T, MPI_COMM_WORLD, r); });
  for (int r = 1; r < n; ++r) {
    const uint8_t* from = &back[static_cast<size_t>(back_displs[static_cast<size_t>(r)])];
    for (int64_t i : at[static_cast<size_t>(r)]) {
      std::copy_n(from, row_bytes, codes + i * row_bytes);
      std::copy_n(from + row_bytes, scale_bytes, scales + i * scale_bytes);
      from += row;
    }
  }
  count(static_cast<uint64_t>(n - 1) * (4 * sizeof(int64_t) + sizeof(int)) + flat.size() * (sizeof(int64_t) + static_cast<size_t>(row)));
  std::lock_guard<std::mutex> lock(stats_mu_);
  ++stats_.engram_lookups;
}

std::vector<uint64_t> MpiExpertPeers::resident_bytes_per_rank() {
  std::lock_guard<std::mutex> exchange(exchange_);
  job_.send({JobOp::Report});
  const uint64_t mine = resident_bytes();
  std::vector<uint64_t> all(static_cast<size_t>(job_.ranks()));
  wait_for(job_, "the resident bytes", [&](MPI_Request* r) { return MPI_Igather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, 0, MPI_COMM_WORLD, r); });
  return all;
}

}  // namespace dsv41
