// Waiting for an MPI request without holding a core. MPI's blocking calls poll without pause, and
// a rank waiting for another (the others for rank 0's next command, rank 0 for the owners' experts)
// would take a core from the ranks doing the work whenever there are no more cores than ranks'
// threads (2 cores, rank 0's worker pool and a second rank: 80x slower decode, measured). So every
// wait here polls a little, then sleeps in naps that double from 10 us: up to 50 us while traffic is
// recent (a layer's exchange), up to 1 ms once the wait has lasted 20 ms (an idle server). Every wait
// answers the other ranks' pings meanwhile (parallel/mpi_job.h).
#pragma once

#include <mpi.h>

#include <chrono>
#include <optional>

#include "parallel/mpi_job.h"

namespace dsv41 {

// Waits for `request` until it completes (true) or `deadline` passes (false; the request stays open).
bool wait_politely(MpiJob& job, MPI_Request& request,
                   std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt);

// Waits for `request` of the command in progress up to the job's wait limit. Past it, the job fails
// (MpiJob::fail_job) naming the ranks that do not answer a ping, the command and `what` it waited for.
void wait_in_command(MpiJob& job, MPI_Request& request, const char* what);

// Starts a nonblocking collective of the command in progress (`start(&request)`) and waits for it as
// wait_in_command does. Every rank uses the nonblocking forms, which MPI matches only with their own
// kind. A job that failed starts nothing: the call throws its failure.
template <typename Start>
void wait_for(MpiJob& job, const char* what, Start start) {
  job.check_alive();
  MPI_Request request;
  start(&request);
  wait_in_command(job, request, what);
}

}  // namespace dsv41
