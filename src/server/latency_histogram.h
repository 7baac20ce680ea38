// A Prometheus histogram of durations: cumulative counts per upper bound, their sum and count.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dsv41::server {

class LatencyHistogram {
 public:
  explicit LatencyHistogram(std::vector<double> upper_bounds_s)
      : bounds_(std::move(upper_bounds_s)), counts_(bounds_.size() + 1, 0) {}
  void observe(double seconds) {
    size_t i = 0;
    while (i < bounds_.size() && seconds > bounds_[i]) ++i;
    ++counts_[i];  // the last slot is +Inf
    sum_ += seconds;
    ++count_;
  }
  // The exposition lines (HELP, TYPE, every bucket cumulatively, sum, count) for `name`.
  std::string render(const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

}  // namespace dsv41::server
