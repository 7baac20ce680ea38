#include "server/event_channel.h"

namespace dsv41::server {

void EventChannel::push(const TokenEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(event);
    if (event.done) finished_ = true;
  }
  ready_.notify_one();
}

std::vector<TokenEvent> EventChannel::pop_all(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  ready_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  std::vector<TokenEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

bool EventChannel::finished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_;
}

}  // namespace dsv41::server
