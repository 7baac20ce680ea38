#include "descriptor_limit.h"

#include <dirent.h>
#include <sys/resource.h>

#include <algorithm>

#include "util/error.h"

namespace dsv41::cli {

namespace {

// Descriptors kept free for what the process opens while it serves: prompt-cache files, expert reads
// of a streamed checkpoint, the log, UCX and MPI endpoints.
constexpr size_t kHeadroom = 64;

size_t open_descriptors() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  size_t n = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n > 0 ? n - 1 : 0;  // less the directory's own descriptor
}

}  // namespace

DescriptorBudget raise_descriptor_limit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);  // may be refused (a hard limit above the kernel's nr_open)
    getrlimit(RLIMIT_NOFILE, &limit);
  }
  DescriptorBudget b;
  b.soft_limit = limit.rlim_cur == RLIM_INFINITY ? static_cast<size_t>(1) << 30 : static_cast<size_t>(limit.rlim_cur);
  b.in_use = open_descriptors();
  b.headroom = kHeadroom;
  return b;
}

size_t connection_cap(const DescriptorBudget& budget, bool given, size_t asked, size_t fallback, size_t probes) {
  const size_t room = budget.connections() > probes ? budget.connections() - probes : 0;
  if (room == 0) {
    fail("file descriptors", "the limit of " + std::to_string(budget.soft_limit) + " open files leaves no room for connections (" +
                                 std::to_string(budget.in_use) + " in use); raise it (ulimit -n)");
  }
  if (given && asked > room) {
    fail("--max-connections", std::to_string(asked) + " connections need more file descriptors than the limit of " +
                                  std::to_string(budget.soft_limit) + " leaves (" + std::to_string(budget.in_use) +
                                  " in use, " + std::to_string(budget.headroom + probes) +
                                  " kept for files and probes): at most " + std::to_string(room) +
                                  "; raise the limit (ulimit -n) or lower --max-connections");
  }
  return given ? asked : std::min(fallback, room);
}

}  // namespace dsv41::cli
