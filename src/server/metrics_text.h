// The /metrics page: the engine's counters and gauges, and the HTTP layer's own, in the Prometheus
// text exposition format (version 0.0.4).
#pragma once

#include <cstdint>
#include <string>

#include "runtime/engine.h"

namespace dsv41::server {

// What the HTTP layer counts itself (responses by status class, streams open).
struct HttpCounters {
  uint64_t responses_2xx = 0, responses_4xx = 0, responses_5xx = 0;
  uint64_t streams_open = 0, client_disconnects = 0;
};

std::string render_metrics(const EngineMetrics& engine, const HttpCounters& http);

}  // namespace dsv41::server
