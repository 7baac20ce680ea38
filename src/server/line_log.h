// Lines for the operator, written to a descriptor nobody may be reading (stderr into a pipe that is
// never drained): a line is written only when the descriptor can take it without blocking, and is
// otherwise dropped and counted, the count reported with the next line that gets through. So a
// thread that logs (the I/O thread with --log-requests, the scheduler) never stalls on its log.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

namespace dsv41::server {

class LineLog {
 public:
  explicit LineLog(int fd = 2, std::string prefix = "") : fd_(fd), prefix_(std::move(prefix)) {}
  // Writes `line` and a newline, or drops it; safe from any thread.
  void write(const std::string& line);
  uint64_t dropped() const;

 private:
  int fd_;
  std::string prefix_;
  mutable std::mutex mu_;
  uint64_t dropped_ = 0, unreported_ = 0;
};

}  // namespace dsv41::server
