// bench --scenario agent-fleet: the workload this model was made for, as a server meets it. N agent
// sessions share a system prompt with their tools; each turn appends a tool's output to the
// session's history and asks for an answer, and the next turn follows at once. Sessions start a
// little apart, run at once through one engine as the server drives it, and then the same sessions
// run one after another for comparison.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "runtime/engine.h"

namespace dsv41 {

struct FleetOptions {
  int sessions = 8;
  int turns = 4;
  int64_t system_tokens = 8192;                 // the system prompt and tools every session starts with
  int64_t tool_min = 1024, tool_max = 4096;     // each turn's tool output, drawn between these
  int64_t answer_tokens = 300;                  // each turn's answer: between half this and this
  double stagger_seconds = 0.25;                // between the sessions' first turns
};

// The report: per run (all at once, one after another) the time to first token and turn latency,
// the gaps between streamed tokens, prompt tokens served from the prompt cache (after each
// session's first turn too), aggregate prompt and generated tokens per second, and the wall time.
// `engine` carries the loaded model; parallel, the KV budget and the cache's RAM are set here.
nlohmann::json bench_agent_fleet(EngineOptions engine, const FleetOptions& fleet);

}  // namespace dsv41
