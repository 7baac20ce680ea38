#include "util/host_memory.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

#include "util/error.h"

namespace dsv41 {

namespace {

// A cgroup memory file holding a byte count, or "max" (v2: no limit). Nullopt-like 0 when absent.
uint64_t read_limit(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0') return 0;
  // cgroup v1 reports "no limit" as the largest page-aligned signed 64-bit number.
  if (v >= (uint64_t{1} << 62)) return 0;
  return v;
}

// The smallest limit from `folder` up to `root` (a parent's limit binds its children).
void smallest_limit(const std::string& root, std::string rel, const std::string& file, HostMemory& out) {
  while (true) {
    const std::string folder = rel.empty() || rel == "/" ? root : root + rel;
    const uint64_t v = read_limit(folder + "/" + file);
    if (v != 0 && (out.cgroup_limit_bytes == 0 || v < out.cgroup_limit_bytes)) {
      out.cgroup_limit_bytes = v;
      out.cgroup = folder;
    }
    if (rel.empty() || rel == "/") return;
    const size_t slash = rel.find_last_of('/');
    rel = slash == std::string::npos ? "" : rel.substr(0, slash);
  }
}

}  // namespace

uint64_t HostMemory::budget_bytes() const {
  // What is available now, not the whole RAM: the kernel, other processes and the page cache the
  // plan does not count keep theirs. A cgroup's limit binds when it is lower.
  const uint64_t host = available_bytes != 0 ? available_bytes : total_bytes;
  if (cgroup_limit_bytes != 0 && (host == 0 || cgroup_limit_bytes < host)) return cgroup_limit_bytes;
  return host;
}

std::string HostMemory::ram_refusal(uint64_t asked) const {
  if (cgroup_limit_bytes == 0 || asked <= cgroup_limit_bytes) return "";
  const auto both = [](uint64_t bytes) {
    return std::to_string(bytes) + " bytes (" + format_bytes(static_cast<double>(bytes));
  };
  return both(asked) + ") is above the memory cgroup's limit of " + both(cgroup_limit_bytes) + ", " + cgroup +
         "): the kernel would kill the process on reaching the limit; give at most the limit, or leave --ram out "
         "to plan for it";
}

uint64_t HostMemory::ram_budget(uint64_t asked) const {
  if (asked == 0) return budget_bytes();
  const std::string refusal = ram_refusal(asked);
  if (!refusal.empty()) fail("--ram", refusal);
  return asked;
}

HostMemory read_host_memory(const HostMemoryFiles& files) {
  HostMemory out;
  std::ifstream meminfo(files.meminfo);
  std::string key, unit;
  uint64_t kb = 0;
  while (meminfo >> key >> kb) {
    std::getline(meminfo, unit);
    if (key == "MemTotal:") out.total_bytes = kb * 1024;
    if (key == "MemAvailable:") out.available_bytes = kb * 1024;
  }
  // "ID:controllers:path" per hierarchy; v1's memory controller, or v2's unified "0::path".
  std::ifstream cgroups(files.self_cgroup);
  std::string line;
  while (std::getline(cgroups, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::stringstream list(controllers);
    std::string c;
    bool memory = false;
    while (std::getline(list, c, ',')) memory |= c == "memory";
    if (memory) smallest_limit(files.cgroup_v1_memory, path, "memory.limit_in_bytes", out);
    if (controllers.empty() && line.compare(0, a, "0") == 0) smallest_limit(files.cgroup_v2, path, "memory.max", out);
  }
  return out;
}

uint64_t parse_byte_size(const std::string& text, const std::string& flag) {
  const auto bad = [&]() -> uint64_t {
    fail(flag, "must be a size such as 16G, 512M or 1.5GiB (K, M, G, T in powers of 1024), got \"" + text + "\"");
  };
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) return bad();
  char* end = nullptr;
  const std::string number = text.substr(0, i);
  const double v = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size() || !std::isfinite(v)) return bad();
  std::string unit = text.substr(i);
  for (char& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double scale = 1;
  if (!unit.empty() && unit != "B") {
    const std::string units = "KMGT";
    const size_t u = units.find(unit[0]);
    const std::string rest = unit.substr(1);
    if (u == std::string::npos || !(rest.empty() || rest == "B" || rest == "IB")) return bad();
    scale = std::pow(1024.0, static_cast<double>(u + 1));
  }
  const double bytes = std::floor(v * scale);
  if (bytes < 1 || bytes > static_cast<double>(std::numeric_limits<int64_t>::max())) {
    fail(flag, "must be a size from 1 byte to 8 EiB, got \"" + text + "\"");
  }
  return static_cast<uint64_t>(bytes);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char text[32];
  std::snprintf(text, sizeof text, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return text;
}

}  // namespace dsv41
