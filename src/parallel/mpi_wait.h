// Waiting for an MPI request without holding a core. MPI's blocking calls poll without pause, and
// a rank waiting for another (the others for rank 0's next command, rank 0 for the owners' experts)
// would take a core from the ranks doing the work whenever there are no more cores than ranks'
// threads (2 cores, rank 0's worker pool and a second rank: 80x slower decode, measured). So every
// wait here polls a little, then sleeps in naps that double from 10 us: up to 50 us while traffic is
// recent (a layer's exchange), up to 1 ms once the wait has lasted 20 ms (an idle server).
#pragma once

#include <mpi.h>

namespace dsv41 {

void wait_politely(MPI_Request& request);

// Starts a nonblocking collective (`start(&request)`) and waits for it politely. Every rank uses the
// nonblocking forms, which MPI matches only with their own kind.
template <typename Start>
void wait_for(Start start) {
  MPI_Request request;
  start(&request);
  wait_politely(request);
}

}  // namespace dsv41
