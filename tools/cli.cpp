#include "cli.h"

#include <charconv>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "util/error.h"
#include "util/host_memory.h"

namespace dsv41::cli {

Args::Args(const std::string& command, int argc, char** argv, const std::set<std::string>& value_flags,
           const std::set<std::string>& switches, const std::map<std::string, std::string>& aliases)
    : command_(command) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.size() < 2 || arg[0] != '-') {
      positional_.push_back(arg);
      continue;
    }
    std::string value;
    bool inline_value = false;
    if (auto eq = arg.find('='); eq != std::string::npos && arg.rfind("--", 0) == 0) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      inline_value = true;
    }
    if (auto a = aliases.find(arg); a != aliases.end()) arg = a->second;
    if (switches.count(arg)) {
      if (inline_value) fail(arg, "takes no value");
      values_[arg] = "1";
    } else if (value_flags.count(arg)) {
      if (!inline_value) {
        if (i + 1 >= argc) fail(arg, "needs a value");
        value = argv[++i];
      }
      values_[arg] = value;
      all_[arg].push_back(value);
    } else {
      fail(arg, "unknown flag for 'dsv41 " + command_ + "' (see 'dsv41 " + command_ + " --help')");
    }
  }
}

bool Args::has(const std::string& flag) const { return values_.count(flag) > 0; }

std::string Args::get(const std::string& flag, const std::string& fallback) const {
  auto it = values_.find(flag);
  return it == values_.end() ? fallback : it->second;
}

std::string Args::required(const std::string& flag) const {
  auto it = values_.find(flag);
  if (it == values_.end()) fail(flag, "is required for 'dsv41 " + command_ + "'");
  return it->second;
}

int64_t Args::get_int(const std::string& flag, int64_t fallback, int64_t min, int64_t max) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return fallback;
  const std::string& s = it->second;
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) fail(flag, "expects an integer, got \"" + s + "\"");
  if (v < min || v > max) {
    fail(flag, "must be between " + std::to_string(min) + " and " + std::to_string(max) + ", got " + s);
  }
  return v;
}

uint64_t Args::get_u64(const std::string& flag, uint64_t fallback) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return fallback;
  const std::string& s = it->second;
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) {
    fail(flag, "expects a non-negative integer, got \"" + s + "\"");
  }
  return v;
}

uint64_t Args::get_size(const std::string& flag, uint64_t fallback) const {
  auto it = values_.find(flag);
  return it == values_.end() ? fallback : parse_byte_size(it->second, flag);
}

double Args::get_number(const std::string& flag, double fallback) const {
  auto it = values_.find(flag);
  if (it == values_.end()) return fallback;
  const std::string& s = it->second;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != s.size() || !std::isfinite(v)) fail(flag, "expects a number, got \"" + s + "\"");
  return v;
}

uint64_t ram_flag(const Args& args) {
  const uint64_t asked = args.get_size("--ram", 0);
  if (asked != 0) read_host_memory().ram_budget(asked);
  return asked;
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path, "cannot be opened");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("is not valid JSON: ") + e.what());
  }
}

}  // namespace dsv41::cli
