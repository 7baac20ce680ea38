#include "expert_parallel.h"

#include <pthread.h>
#include <signal.h>

#include <csignal>
#include <cstdio>
#include <cstring>

#include "backend_env.h"
#include "parallel/expert_follower.h"
#include "util/error.h"

namespace dsv41::cli {

namespace {

// The value of `flag` ("--model DIR", "--model=DIR", or a short alias "-m DIR"), or "".
std::string flag_value(int argc, char** argv, const std::string& flag, const std::string& alias = "") {
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == flag || (!alias.empty() && a == alias)) && i + 1 < argc) return argv[i + 1];
    if (a.rfind(flag + "=", 0) == 0) return a.substr(flag.size() + 1);
  }
  return "";
}

// The other ranks' --rank-timeout: rank 0 checks the flag (and ends the job over a bad one), so a
// value it would refuse only leaves the default here.
std::chrono::seconds follower_rank_timeout(const std::string& text) {
  if (text.empty() || text.size() > 5 || text.find_first_not_of("0123456789") != std::string::npos) return kDefaultRankTimeout;
  const int64_t seconds = std::stoll(text);
  return seconds >= 1 ? std::chrono::seconds(seconds) : kDefaultRankTimeout;
}

}  // namespace

bool wants_expert_parallel(int argc, char** argv) {
  for (int i = 0; i < argc; ++i)
    if (std::strcmp(argv[i], "--expert-parallel") == 0) return true;
  return false;
}

int run_expert_parallel(const std::string& command, int argc, char** argv, int (*run)(int, char**, MpiJob*)) {
  // MPI starts threads of its own. SIGINT and SIGTERM are blocked while it does, so that none of
  // them takes the signal (and dies of it) where `serve` waits for it on a thread of its own; the
  // other commands unblock them again on this thread.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  MpiJob job(nullptr, nullptr);
  if (command != "serve") pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
  if (!job.leading()) {
    // Rank 0 alone decides when the job ends (it tells the others when its command returns): a
    // terminal's or mpirun's SIGINT/SIGTERM goes to rank 0's own handling (a server's graceful stop).
    std::signal(SIGINT, SIG_IGN);
    std::signal(SIGTERM, SIG_IGN);
    try {
      // rank 0 parses the whole command line (and ends the job over a bad one); these ranks need the
      // model folder and the Engram tier
      const std::string dir = flag_value(argc, argv, "--model", "-m");
      if (dir.empty()) fail(command, "--model is required");
      const std::string tier = flag_value(argc, argv, "--engram");
      job.set_rank_timeout(follower_rank_timeout(flag_value(argc, argv, "--rank-timeout")));
      follow_leader(job, dir, backend_from_environment(), parse_engram_tier(tier.empty() ? "mmap" : tier));
    } catch (const Error& e) {
      std::fprintf(stderr, "dsv41 %s (rank %d): error: %s\n", command.c_str(), job.rank(), e.what());
      job.abort(1);
    }
    return 0;
  }
  try {
    const int status = run(argc, argv, &job);
    // a rank stopped answering (the command has said so): the job cannot finalize, and ends here
    if (!job.failure().empty()) job.abort(1);
    return status;
  } catch (const Error& e) {
    std::fprintf(stderr, "dsv41 %s: error: %s\n", command.c_str(), e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv41 %s: internal error: %s\n", command.c_str(), e.what());
  }
  if (job.ranks() == 1) return 1;
  job.abort(1);
}

std::chrono::seconds rank_timeout_flag(const Args& args) {
  if (args.has("--rank-timeout") && !args.has("--expert-parallel")) fail("--rank-timeout", "belongs to --expert-parallel");
  return std::chrono::seconds(args.get_int("--rank-timeout", kDefaultRankTimeout.count(), 1, 86400));
}

std::shared_ptr<MpiExpertPeers> expert_peers_for(MpiJob* job, const std::string& dir, std::chrono::seconds rank_timeout) {
  if (job == nullptr) fail("--expert-parallel", "is handled by the tool's entry point (a bug if seen)");
  job->set_rank_timeout(rank_timeout);
  return std::make_shared<MpiExpertPeers>(*job, expert_parallel_fingerprint(dir));
}

}  // namespace dsv41::cli
