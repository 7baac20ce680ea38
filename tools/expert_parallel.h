// `mpirun -np N dsv41 generate|serve|bench ... --expert-parallel`: rank 0 runs the command, the other
// ranks hold their share of the routed experts and Engram rows and serve rank 0's exchanges
// (src/parallel/). Without mpirun the job has one rank, which holds everything.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "cli.h"
#include "parallel/mpi_expert_peers.h"
#include "parallel/mpi_job.h"

namespace dsv41::cli {

// Whether argv (a command's arguments) holds --expert-parallel.
bool wants_expert_parallel(int argc, char** argv);

// Starts the MPI job and runs `command` in it: rank 0 runs the command (`run` with the job), the
// others follow it. An error on any rank is printed and ends the whole job with status 1, as does a
// rank that stops answering inside a step (MpiJob: the rank timeout).
int run_expert_parallel(const std::string& command, int argc, char** argv,
                        int (*run)(int argc, char** argv, MpiJob* job));

// --rank-timeout S: how long rank 0 waits for another rank's part of a step before the job fails
// (kDefaultRankTimeout when not given). Error when given without --expert-parallel.
std::chrono::seconds rank_timeout_flag(const Args& args);

// The command's side: rank 0's peers for the model in `dir`, waiting `rank_timeout` inside a step
// (Error when `job` is null, i.e. the command was not started through run_expert_parallel).
std::shared_ptr<MpiExpertPeers> expert_peers_for(MpiJob* job, const std::string& dir, std::chrono::seconds rank_timeout);

}  // namespace dsv41::cli
