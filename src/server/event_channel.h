// Hands one request's TokenEvents from the engine's scheduler thread to the connection thread that
// writes them. The engine's sink must never block (a slow client would stall every sequence in the
// batch), so push() only appends under a short lock; the queue is unbounded, which is fine because a
// request produces at most max_tokens small events and a client that stops reading is detected by
// its failing writes and cancelled.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>

#include "runtime/engine.h"

namespace dsv41::server {

class EventChannel {
 public:
  void push(const TokenEvent& event);
  // Waits up to `timeout` for events and takes all that are there (empty on timeout).
  std::vector<TokenEvent> pop_all(std::chrono::milliseconds timeout);
  // True once the final event has been pushed (it may not have been popped yet).
  bool finished() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<TokenEvent> events_;
  bool finished_ = false;
};

}  // namespace dsv41::server
