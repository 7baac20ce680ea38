#include "server/line_log.h"

#include <limits.h>
#include <poll.h>
#include <unistd.h>

namespace dsv41::server {

void LineLog::write(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string text = prefix_;
  if (unreported_ > 0) {
    text += "(" + std::to_string(unreported_) + " earlier lines dropped: the log was not being read) ";
  }
  text += line;
  // A pipe with room for PIPE_BUF bytes takes a write of at most that many whole, without blocking.
  if (text.size() >= PIPE_BUF) text = text.substr(0, PIPE_BUF - 5) + "...";
  text += '\n';
  pollfd p{fd_, POLLOUT, 0};
  if (poll(&p, 1, 0) != 1 || (p.revents & POLLOUT) == 0 || ::write(fd_, text.data(), text.size()) < 0) {
    ++dropped_;
    ++unreported_;
    return;
  }
  unreported_ = 0;
}

uint64_t LineLog::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

}  // namespace dsv41::server
