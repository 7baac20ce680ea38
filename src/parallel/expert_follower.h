// Every rank of an expert-parallel job but the leading one: it holds its share of the routed experts
// and of the Engram rows (model/expert_share.h) and none of the dense weights, and serves the leading
// rank's commands (parallel/mpi_job.h) until it is told to stop.
#pragma once

#include <memory>
#include <string>

#include "io/engram_store.h"
#include "kernels/backend.h"
#include "parallel/mpi_job.h"

namespace dsv41 {

// Loads the share from `dir` and serves until Stop. A failure (a load error, a failed read) is printed
// and ends the whole job (MpiJob::abort): the leading rank would otherwise wait for this one forever.
void follow_leader(MpiJob& job, const std::string& dir, std::shared_ptr<const Backend> backend, EngramTier engram);

}  // namespace dsv41
