#include "parallel/mpi_job.h"
#include "parallel/mpi_wait.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "util/error.h"

namespace dsv41 {

namespace {
constexpr int kCommandTag = 1;
}

MpiJob::MpiJob(int* argc, char*** argv) {
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
    fail("--expert-parallel", "MPI_Init_thread failed");
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks_);
  if (provided < MPI_THREAD_SERIALIZED) {
    MPI_Finalize();
    fail("--expert-parallel", "the MPI library does not allow calls from more than one thread (serialized)");
  }
}

MpiJob::~MpiJob() {
  if (leading() && !stopped_) {
    try {
      send({JobOp::Stop});
    } catch (const Error&) {
      // finalizing anyway
    }
  }
  MPI_Finalize();
}

void MpiJob::send(const JobCommand& command) {
  if (!leading()) fail("expert parallel", "only rank 0 sends commands");
  const int64_t words[4] = {static_cast<int64_t>(command.op), command.a, command.b, command.c};
  for (int r = 1; r < ranks_; ++r) MPI_Send(words, 4, MPI_INT64_T, r, kCommandTag, MPI_COMM_WORLD);
  if (command.op == JobOp::Stop) stopped_ = true;
}

JobCommand MpiJob::receive() const {
  int64_t words[4] = {0, 0, 0, 0};
  MPI_Request request;
  MPI_Irecv(words, 4, MPI_INT64_T, 0, kCommandTag, MPI_COMM_WORLD, &request);
  wait_politely(request);
  return {static_cast<JobOp>(words[0]), words[1], words[2], words[3]};
}

void MpiJob::abort(int status) const {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, status);
  std::_Exit(status);  // MPI_Abort does not return; this only tells the compiler
}

void wait_politely(MPI_Request& request) {
  using std::chrono::microseconds;
  const auto start = std::chrono::steady_clock::now();
  auto nap = microseconds(0);
  for (int polls = 0;; ++polls) {
    int done = 0;
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return;
    if (polls < 100) {
      std::this_thread::yield();
      continue;
    }
    const bool idle = std::chrono::steady_clock::now() - start > std::chrono::milliseconds(20);
    nap = std::min(idle ? microseconds(1000) : microseconds(50), std::max(microseconds(10), nap * 2));
    std::this_thread::sleep_for(nap);
  }
}

uint64_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int got = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  return got == 2 ? resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

}  // namespace dsv41
