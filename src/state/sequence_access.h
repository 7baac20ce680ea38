// The writable contents of a SequenceState (state/sequence_state.h), for the code that owns them: the
// forward pass (src/model: attention, the Engram history, the drafter's rings) and state/ itself.
// cmake/check_layers.cmake refuses this header anywhere else, so the runtime, the server and the
// tools see a sequence only through SequenceState's public face and state/'s functions.
#pragma once

#include "state/sequence_state.h"

namespace dsv41 {

class SequenceAccess {
 public:
  static SequenceParts& parts(SequenceState& s) { return s.parts_; }
  static const SequenceParts& parts(const SequenceState& s) { return s.parts_; }
};

inline SequenceParts& parts_of(SequenceState& s) { return SequenceAccess::parts(s); }
inline const SequenceParts& parts_of(const SequenceState& s) { return SequenceAccess::parts(s); }

}  // namespace dsv41
