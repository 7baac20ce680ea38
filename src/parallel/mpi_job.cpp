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
constexpr int kPingTag = 2;
constexpr int kPingAnswerTag = 3;
constexpr int64_t kPing = 1;  // what a ping and its answer carry (only their arrival counts)

// How long a rank that timed out waits for the others' answers to its pings: a healthy rank answers
// as soon as it next waits on MPI, which is within one layer's expert computation.
constexpr std::chrono::seconds kLongestPingGrace{10};

std::string seconds_text(std::chrono::milliseconds d) {
  const long long ms = d.count();
  return ms % 1000 == 0 ? std::to_string(ms / 1000) + " s" : std::to_string(ms) + " ms";
}

}  // namespace

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
  if (leading() && !stopped_ && failure().empty()) {
    try {
      send({JobOp::Stop});
    } catch (const Error&) {
      // a rank did not take it: the job failed, and is aborted below
    }
  }
  if (!failure().empty()) {
    std::fprintf(stderr, "dsv41 (expert-parallel rank %d of %d): the job failed: %s\n", rank_, ranks_, failure().c_str());
    abort(1);
  }
  MPI_Finalize();
}

void MpiJob::send(const JobCommand& command) {
  if (!leading()) fail("expert parallel", "only rank 0 sends commands");
  check_alive();
  current_ = command;
  const int64_t words[4] = {static_cast<int64_t>(command.op), command.a, command.b, command.c};
  for (int r = 1; r < ranks_; ++r) {
    MPI_Request request;
    MPI_Isend(words, 4, MPI_INT64_T, r, kCommandTag, MPI_COMM_WORLD, &request);
    wait_in_command(*this, request, "the command");
  }
  if (command.op == JobOp::Stop) stopped_ = true;
}

JobCommand MpiJob::receive() {
  int64_t words[4] = {0, 0, 0, 0};
  MPI_Request request;
  MPI_Irecv(words, 4, MPI_INT64_T, 0, kCommandTag, MPI_COMM_WORLD, &request);
  wait_politely(*this, request);
  current_ = {static_cast<JobOp>(words[0]), words[1], words[2], words[3]};
  return current_;
}

void MpiJob::abort(int status) const {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, status);
  std::_Exit(status);  // MPI_Abort does not return; this only tells the compiler
}

std::optional<std::chrono::milliseconds> MpiJob::wait_limit() const {
  if (current_.op == JobOp::Hello) return std::nullopt;
  return leading() ? rank_timeout_ : 3 * rank_timeout_;
}

std::string MpiJob::command_text() const {
  switch (current_.op) {
    case JobOp::Hello: return "the greeting";
    case JobOp::Moe: return "MoE layer " + std::to_string(current_.a);
    case JobOp::Engram: return "Engram slot " + std::to_string(current_.a);
    case JobOp::Report: return "the memory report";
    case JobOp::Stop: return "the stop";
  }
  return "command " + std::to_string(static_cast<int64_t>(current_.op));
}

void MpiJob::answer_pings() {
  for (;;) {
    int pending = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kPingTag, MPI_COMM_WORLD, &pending, &status);
    if (!pending) return;
    int64_t ping = 0;
    MPI_Recv(&ping, 1, MPI_INT64_T, status.MPI_SOURCE, kPingTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Request answer;
    MPI_Isend(&kPing, 1, MPI_INT64_T, status.MPI_SOURCE, kPingAnswerTag, MPI_COMM_WORLD, &answer);
    MPI_Request_free(&answer);  // delivered when the asker takes it; nothing here waits for that
  }
}

std::vector<int> MpiJob::silent_ranks(std::chrono::milliseconds grace) {
  std::vector<int64_t> answers(static_cast<size_t>(ranks_), 0);
  std::vector<MPI_Request> waiting(static_cast<size_t>(ranks_), MPI_REQUEST_NULL);
  for (int r = 0; r < ranks_; ++r) {
    if (r == rank_) continue;
    MPI_Irecv(&answers[static_cast<size_t>(r)], 1, MPI_INT64_T, r, kPingAnswerTag, MPI_COMM_WORLD, &waiting[static_cast<size_t>(r)]);
    MPI_Request ping;
    MPI_Isend(&kPing, 1, MPI_INT64_T, r, kPingTag, MPI_COMM_WORLD, &ping);
    MPI_Request_free(&ping);
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (;;) {
    bool all = true;
    for (MPI_Request& w : waiting) {
      if (w == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&w, &done, MPI_STATUS_IGNORE);  // sets w to MPI_REQUEST_NULL once done
      if (!done) all = false;
    }
    answer_pings();  // a rank that timed out at the same time asks this one
    if (all || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<int> silent;
  for (int r = 0; r < ranks_; ++r) {
    MPI_Request& w = waiting[static_cast<size_t>(r)];
    if (w == MPI_REQUEST_NULL) continue;
    silent.push_back(r);
    MPI_Cancel(&w);
    MPI_Request_free(&w);
  }
  return silent;
}

void MpiJob::fail_job(const std::string& why) {
  std::function<void(const std::string&)> handler;
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.empty()) {
      failure_ = why;
      handler = std::move(on_failure_);
    }
  }
  if (handler) handler(why);
  fail_unavailable("expert parallel", failure());
}

void MpiJob::check_alive() const {
  const std::string why = failure();
  if (!why.empty()) fail_unavailable("expert parallel", why);
}

std::string MpiJob::failure() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

void MpiJob::on_failure(std::function<void(const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  on_failure_ = std::move(handler);
}

bool wait_politely(MpiJob& job, MPI_Request& request, std::optional<std::chrono::steady_clock::time_point> deadline) {
  using std::chrono::microseconds;
  const auto start = std::chrono::steady_clock::now();
  auto nap = microseconds(0);
  for (int polls = 0;; ++polls) {
    int done = 0;
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return true;
    if (polls < 100) {
      std::this_thread::yield();
      continue;
    }
    job.answer_pings();  // only once the wait lasts: the first polls of a layer's exchange stay as cheap as they were
    const auto now = std::chrono::steady_clock::now();
    if (deadline && now >= *deadline) return false;
    const bool idle = now - start > std::chrono::milliseconds(20);
    nap = std::min(idle ? microseconds(1000) : microseconds(50), std::max(microseconds(10), nap * 2));
    std::this_thread::sleep_for(nap);
  }
}

void wait_in_command(MpiJob& job, MPI_Request& request, const char* what) {
  const std::optional<std::chrono::milliseconds> limit = job.wait_limit();
  if (wait_politely(job, request, limit ? std::optional(std::chrono::steady_clock::now() + *limit) : std::nullopt)) return;
  // Past the limit. The request stays open (MPI cannot cancel a collective): the job is done for.
  const std::vector<int> silent =
      job.silent_ranks(std::min<std::chrono::milliseconds>(*limit, kLongestPingGrace));
  const std::string where = " within " + seconds_text(*limit) + " (" + job.command_text() + ", " + what + ")";
  std::string who;
  for (int r : silent) who += (who.empty() ? "" : ", ") + std::to_string(r);
  job.fail_job(silent.empty() ? "every rank answers, but none completed the exchange" + where
                              : (silent.size() == 1 ? "rank " : "ranks ") + who + " did not answer" + where +
                                    "; the expert-parallel job cannot go on");
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
