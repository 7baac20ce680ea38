// How much memory this process may use: the machine's RAM and the limits of the memory cgroups it
// runs in (cgroup v1 memory.limit_in_bytes or v2 memory.max, the smallest along the path, since a
// parent's limit binds its children), read from /proc and /sys. And sizes as users write them.
#pragma once

#include <cstdint>
#include <string>

namespace dsv41 {

struct HostMemory {
  uint64_t total_bytes = 0;      // MemTotal
  uint64_t available_bytes = 0;  // MemAvailable: what can be had without swapping now
  uint64_t cgroup_limit_bytes = 0;  // 0: no memory cgroup limit
  std::string cgroup;             // the limiting cgroup's folder, when there is one

  // What a model may plan for: the memory available now (MemAvailable: RAM the kernel can hand out
  // without swapping), or the cgroup's limit where that is lower.
  uint64_t budget_bytes() const;

  // Why a budget of `asked` bytes may not be used here: it is above the memory cgroup's limit, where
  // the kernel kills the process with nothing logged. Names both numbers; "" when it may be used.
  std::string ram_refusal(uint64_t asked) const;
  // The budget a load follows: `asked` (the user's --ram) when non-zero, else budget_bytes(). An Error
  // naming --ram with ram_refusal()'s reason when `asked` is above the cgroup's limit.
  uint64_t ram_budget(uint64_t asked) const;
};

// Where read_host_memory looks. The defaults are the system's files; a test points them elsewhere.
struct HostMemoryFiles {
  std::string meminfo = "/proc/meminfo";
  std::string self_cgroup = "/proc/self/cgroup";       // "ID:controllers:path" per hierarchy
  std::string cgroup_v1_memory = "/sys/fs/cgroup/memory";  // v1's memory hierarchy (memory.limit_in_bytes)
  std::string cgroup_v2 = "/sys/fs/cgroup";               // v2's unified hierarchy (memory.max)
};

// Reads /proc/meminfo, /proc/self/cgroup and the cgroup files; what cannot be read is left 0.
HostMemory read_host_memory(const HostMemoryFiles& files = {});

// "16G", "512M", "1.5GiB", "64KB", "123" (bytes): K, M, G, T in powers of 1024, with or without
// "B"/"iB"; an Error naming `flag` for anything else, or for zero.
uint64_t parse_byte_size(const std::string& text, const std::string& flag);

// 1536 MiB as "1.50 GiB": for plans and messages.
std::string format_bytes(double bytes);

}  // namespace dsv41
