// When a decode server asks its prefill server again after the prefill server let a handover run
// out its timeout (frozen, wedged, paused): not for a while, so that the prompts meanwhile are
// prefilled here at once instead of each paying the timeout, and then by one prompt at a time until
// one is answered. The pause starts at the handover timeout and doubles each time such a try times
// out too, up to `longest`; a handover that comes back ends it.
#pragma once

#include <chrono>
#include <mutex>
#include <string>

namespace dsv41 {

class PeerBackoff {
 public:
  using Clock = std::chrono::steady_clock;
  PeerBackoff(std::chrono::seconds first, std::chrono::seconds longest);

  // "" when a prompt may ask the peer now, otherwise why it is not asked (for the log). `*trying`
  // is set when the prompt let through is the one try after a pause, which the others wait out
  // (they are refused until it reports).
  std::string refusal(Clock::time_point now, bool* trying);
  // How a prompt's handover ended: it came back (the peer answers), it ran out the timeout, or it
  // failed otherwise (a refusal, a dead peer, a stop: nothing paid, nothing learned). `trying`:
  // what refusal() said.
  void answered();
  void timed_out(Clock::time_point now, bool trying);
  void failed(bool trying);

 private:
  std::mutex mu_;
  std::chrono::seconds first_, longest_;
  std::chrono::seconds pause_{0};  // 0: the peer has not timed out since it last answered
  Clock::time_point until_{};      // the end of the pause
  bool try_out_ = false;           // a prompt is trying the peer after a pause
};

}  // namespace dsv41
