// The MPI job of `mpirun -np N dsv41 generate|serve|bench ... --expert-parallel`, and the commands its
// leading rank (rank 0: the command itself, scheduler and server) sends the others, which serve their
// share of the routed experts and Engram rows until told to stop (parallel/expert_follower.h).
//
// A command is four int64 values sent point to point to every other rank; whatever a command moves
// after it (routing, rows, outputs) goes in MPI collectives that every rank enters in the same order.
// Waiting for the next command, the other ranks poll with growing sleeps, so an idle server's ranks
// use no CPU; inside a command they wait in MPI's own way.
//
// Inside a step's command (Moe, Engram, Report) no wait lasts for ever: past the rank timeout the
// waiting rank pings every other (each rank answers pings whenever it waits on MPI, idle or not),
// and the job fails naming the ranks that gave no answer (parallel/mpi_wait.h). Rank 0 waits the
// timeout, the others three times as long, so that rank 0, which answers the clients, is the one
// that finds a rank that stopped, and has time to tell its clients before the job ends. The greeting
// (Hello) waits for ever: a rank may take long to load its share.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace dsv41 {

enum class JobOp : int64_t {
  Hello = 1,   // a: the leading rank's model fingerprint; the others answer whether theirs matches
  Moe = 2,     // a: layer, b: tokens, c: k (parallel/mpi_expert_peers.cpp)
  Engram = 3,  // a: Engram slot, b: ids
  Report = 4,  // every rank answers with its resident bytes
  Stop = 5,
};

struct JobCommand {
  JobOp op = JobOp::Stop;
  int64_t a = 0, b = 0, c = 0;
};

// The rank timeout when none is given: far past any healthy step's wait, which lasts one layer's
// exchange (its owners' expert computation: milliseconds to seconds, more when a rank first reads its
// share from a slow disk).
constexpr std::chrono::seconds kDefaultRankTimeout{300};

class MpiJob {
 public:
  // MPI_Init_thread (serialized calls: the forward runs on one thread at a time, not always the main
  // one). Error when MPI cannot give that.
  MpiJob(int* argc, char*** argv);
  // The leading rank first tells the others to stop (if nothing did), then every rank finalizes; a
  // job that failed cannot finalize (a collective is still open with the rank that stopped): it is
  // aborted with status 1.
  ~MpiJob();
  MpiJob(const MpiJob&) = delete;
  MpiJob& operator=(const MpiJob&) = delete;

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  bool leading() const { return rank_ == 0; }

  // Leading rank: sends `command` to every other rank (a step's command waits as its collectives do).
  void send(const JobCommand& command);
  // The other ranks: waits for the leading rank's next command, for as long as it takes.
  JobCommand receive();
  // Ends the whole job with exit status `status` (a rank that failed: the others would wait forever).
  [[noreturn]] void abort(int status) const;

  // The rank timeout (`--rank-timeout`); how long this rank waits inside the command in progress
  // (rank 0: the timeout, the others three times it), or nothing (the greeting, no command).
  void set_rank_timeout(std::chrono::seconds timeout) { rank_timeout_ = timeout; }
  std::chrono::seconds rank_timeout() const { return rank_timeout_; }
  std::optional<std::chrono::milliseconds> wait_limit() const;
  // The command in progress in words ("MoE layer 3"), for messages.
  std::string command_text() const;

  // Answers the pings other ranks sent this one (every wait on MPI calls it).
  void answer_pings();
  // Pings every other rank and returns those that gave no answer within `grace`, ascending.
  std::vector<int> silent_ranks(std::chrono::milliseconds grace);

  // Records that the job cannot go on (the first reason stays), calls the failure handler once, and
  // throws Error (Unavailable) with `why`. Every later wait and send throws the same at once.
  [[noreturn]] void fail_job(const std::string& why);
  // Throws the recorded failure, if any.
  void check_alive() const;
  // The recorded failure, or "" while the job is healthy. Any thread.
  std::string failure() const;
  // Called once, on the thread that found it, when the job fails (rank 0's server stops then).
  void on_failure(std::function<void(const std::string&)> handler);

 private:
  int rank_ = 0, ranks_ = 1;
  bool stopped_ = false;
  std::chrono::seconds rank_timeout_ = kDefaultRankTimeout;
  JobCommand current_{JobOp::Hello};  // the command in progress (the last one sent or received)
  mutable std::mutex failure_mu_;
  std::string failure_;
  std::function<void(const std::string&)> on_failure_;
};

// This process's resident bytes now (/proc/self/statm).
uint64_t resident_bytes();

}  // namespace dsv41
