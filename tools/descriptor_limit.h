// How many connections a server can hold without running out of file descriptors. Every socket is a
// descriptor, and so are the model's shards, cache files and the accept itself: a connection cap
// above what the descriptor limit leaves makes accept fail with EMFILE, where no client, not even a
// health probe, is answered. So `serve` raises its soft limit to the hard one and derives the cap.
#pragma once

#include <cstddef>
#include <string>

namespace dsv41::cli {

struct DescriptorBudget {
  size_t soft_limit = 0;   // RLIMIT_NOFILE after raising it to the hard limit
  size_t in_use = 0;       // descriptors open now (the model's files, the engine's)
  size_t headroom = 0;     // kept for files opened later (cache entries, expert reads, logs)
  size_t connections() const { return soft_limit > in_use + headroom ? soft_limit - in_use - headroom : 0; }
};

// Raises the soft descriptor limit to the hard one (a process-wide setting: the command's to make)
// and counts what is open now.
DescriptorBudget raise_descriptor_limit();

// The connection cap: `asked` when the flag gave one (an Error naming it when the descriptors cannot
// hold that many plus `probes`), else `fallback` lowered to what they can hold.
size_t connection_cap(const DescriptorBudget& budget, bool given, size_t asked, size_t fallback, size_t probes);

}  // namespace dsv41::cli
