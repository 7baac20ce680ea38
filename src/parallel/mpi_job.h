// The MPI job of `mpirun -np N dsv41 generate|serve|bench ... --expert-parallel`, and the commands its
// leading rank (rank 0: the command itself, scheduler and server) sends the others, which serve their
// share of the routed experts and Engram rows until told to stop (parallel/expert_follower.h).
//
// A command is four int64 values sent point to point to every other rank; whatever a command moves
// after it (routing, rows, outputs) goes in MPI collectives that every rank enters in the same order.
// Waiting for the next command, the other ranks poll with growing sleeps, so an idle server's ranks
// use no CPU; inside a command they wait in MPI's own way.
#pragma once

#include <cstdint>
#include <memory>

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

class MpiJob {
 public:
  // MPI_Init_thread (serialized calls: the forward runs on one thread at a time, not always the main
  // one). Error when MPI cannot give that.
  MpiJob(int* argc, char*** argv);
  // The leading rank first tells the others to stop (if nothing did), then every rank finalizes.
  ~MpiJob();
  MpiJob(const MpiJob&) = delete;
  MpiJob& operator=(const MpiJob&) = delete;

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  bool leading() const { return rank_ == 0; }

  // Leading rank: sends `command` to every other rank.
  void send(const JobCommand& command);
  // The other ranks: waits for the leading rank's next command.
  JobCommand receive() const;
  // Ends the whole job with exit status `status` (a rank that failed: the others would wait forever).
  [[noreturn]] void abort(int status) const;

 private:
  int rank_ = 0, ranks_ = 1;
  bool stopped_ = false;
};

// This process's resident bytes now (/proc/self/statm).
uint64_t resident_bytes();

}  // namespace dsv41
