// Command-line parsing shared by the dsv41 subcommands: flags are declared up front, so an unknown
// flag, a missing value or a malformed number is an Error naming the flag, never a guess.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dsv41::cli {

class Args {
 public:
  // value_flags take a value ("--seed 3" or "--seed=3"); switches take none ("--json").
  // Short aliases map to long names, e.g. {"-m", "--model"}.
  Args(const std::string& command, int argc, char** argv, const std::set<std::string>& value_flags,
       const std::set<std::string>& switches, const std::map<std::string, std::string>& aliases = {});

  bool has(const std::string& flag) const;
  std::string get(const std::string& flag, const std::string& fallback = "") const;
  // Every value of a flag given more than once, in order (get() returns the last).
  std::vector<std::string> get_all(const std::string& flag) const {
    const auto it = all_.find(flag);
    return it == all_.end() ? std::vector<std::string>{} : it->second;
  }
  std::string required(const std::string& flag) const;
  int64_t get_int(const std::string& flag, int64_t fallback, int64_t min, int64_t max) const;
  uint64_t get_u64(const std::string& flag, uint64_t fallback) const;
  double get_number(const std::string& flag, double fallback) const;  // finite decimal or exponent form
  uint64_t get_size(const std::string& flag, uint64_t fallback) const;  // "16G", "512M" (util/host_memory.h)
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<std::string>> all_;
  std::vector<std::string> positional_;
};

// --ram SIZE as a load's budget (0 when not given), refused at once when it is above this machine's
// memory cgroup limit (util/host_memory.h), before the command does any work: the kernel would kill
// the process at that limit. The load checks the same again.
uint64_t ram_flag(const Args& args);

// A JSON file the user named: Error "<path>: cannot be opened" or "<path>: is not valid JSON: ...".
nlohmann::json read_json_file(const std::string& path);

}  // namespace dsv41::cli
