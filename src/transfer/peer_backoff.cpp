#include "transfer/peer_backoff.h"

#include <algorithm>
#include <cstdio>

namespace dsv41 {

PeerBackoff::PeerBackoff(std::chrono::seconds first, std::chrono::seconds longest)
    : first_(first), longest_(std::max(first, longest)) {}

std::string PeerBackoff::refusal(Clock::time_point now, bool* trying) {
  std::lock_guard<std::mutex> lock(mu_);
  *trying = false;
  if (pause_.count() == 0) return "";
  if (now < until_) {
    char left[32];
    std::snprintf(left, sizeof left, "%.1f", std::chrono::duration<double>(until_ - now).count());
    return "not asked: it let a handover time out; asked again in " + std::string(left) + " s";
  }
  if (try_out_) return "not asked: it let a handover time out; another prompt is trying it again";
  try_out_ = *trying = true;
  return "";
}

void PeerBackoff::answered() {
  std::lock_guard<std::mutex> lock(mu_);
  pause_ = std::chrono::seconds(0);
  try_out_ = false;
}

void PeerBackoff::timed_out(Clock::time_point now, bool trying) {
  std::lock_guard<std::mutex> lock(mu_);
  if (trying) {
    pause_ = std::min(longest_, pause_ * 2);  // still not answering after a pause: a longer one
    try_out_ = false;
  } else if (pause_.count() == 0) {
    pause_ = first_;
  }
  until_ = std::max(until_, now + pause_);  // prompts that were asking when it froze time out together
}

void PeerBackoff::failed(bool trying) {
  std::lock_guard<std::mutex> lock(mu_);
  if (trying) try_out_ = false;
}

}  // namespace dsv41
