// How one sequence runs, chosen per request (RequestParams) and per tool: names only, so the narrow
// engine API can carry them without the model's headers.
#pragma once

#include <cstdint>

namespace dsv41 {

// Prompt tokens per forward call when a tool does not say: activations grow with the call, not the
// context, so this bounds a long prefill's working memory.
constexpr int64_t kDefaultPrefillChunk = 512;

// CED prefill (model-spec §4): exact runs every layer on every prompt token; tail runs the layers
// after the last KV source only on the prompt's last window rows (the rest can never be read again).
enum class PrefillMode { Exact, Tail };

// Speculative decoding: off, or DSpark (the model's own drafter, model-spec §3.8), verified by the
// target in the same batched forward as other sequences' plain decodes.
enum class SpeculativeMethod { Off, DSpark };

}  // namespace dsv41
