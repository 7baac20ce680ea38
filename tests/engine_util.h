// Helpers for tests that drive an Engine directly: a sink that collects a request's events (tokens,
// text, logits rows, the final event) and a wait for its end, and seeded random prompts.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "runtime/engine.h"

namespace dsv41 {

struct Collected {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<float> rows;  // the logits rows, when the request returns them
  TokenEvent last;
  bool done = false;
};

inline EventSink collect(Collected& c) {
  return [&c](const TokenEvent& e) {
    std::lock_guard<std::mutex> lock(c.mu);
    if (e.token >= 0) c.tokens.push_back(e.token);
    c.text += e.text;
    c.rows.insert(c.rows.end(), e.logits.begin(), e.logits.end());
    if (e.done) {
      c.last = e;
      c.done = true;
      c.cv.notify_all();
    }
  };
}

inline void wait(Collected& c) {
  std::unique_lock<std::mutex> lock(c.mu);
  c.cv.wait(lock, [&] { return c.done; });
}

// n token ids in 3..992 from `seed` (clear of the tiny vocabulary's special ids).
inline std::vector<int32_t> ids(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(3 + rng() % 990);
  return v;
}

}  // namespace dsv41
