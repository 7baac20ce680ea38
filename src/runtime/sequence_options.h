// How one sequence runs, chosen per request (RequestParams) and per tool: names only, so the narrow
// engine API can carry them without the model's headers.
#pragma once

namespace dsv41 {

// CED prefill (model-spec §4): exact runs every layer on every prompt token; tail runs the layers
// after the last KV source only on the prompt's last window rows (the rest can never be read again).
enum class PrefillMode { Exact, Tail };

// Speculative decoding: off, or DSpark (the model's own drafter, model-spec §3.8), verified by the
// target in the same batched forward as other sequences' plain decodes.
enum class SpeculativeMethod { Off, DSpark };

}  // namespace dsv41
