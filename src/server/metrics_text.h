// The /metrics page: the engine's counters and gauges, and the HTTP layer's own, in the Prometheus
// text exposition format (version 0.0.4).
#pragma once

#include <cstdint>
#include <string>

#include "runtime/engine.h"
#include "server/latency_histogram.h"

namespace dsv41::server {

// What the HTTP layer counts itself (responses by status class, streams open) and the latencies of
// its generation requests, as histograms under vLLM's names so that dashboards made for vLLM read
// them unchanged (buckets as vLLM's, in seconds).
struct HttpCounters {
  uint64_t responses_2xx = 0, responses_4xx = 0, responses_5xx = 0;
  uint64_t streams_open = 0, client_disconnects = 0;
  uint64_t accept_failures = 0;    // accepts that failed (out of descriptors), each retried
  uint64_t turned_away = 0;        // connections and bodies refused with 503 for a cap
  uint64_t log_lines_dropped = 0;  // operator log lines dropped because the log was not being read
  // request arrival to its first token
  LatencyHistogram time_to_first_token{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                        5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}};
  // between two tokens of one request
  LatencyHistogram inter_token_latency{{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                        7.5, 10.0, 20.0, 40.0, 80.0}};
  // waiting in the engine's queue before admission
  LatencyHistogram queue_time{{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}};
  // request arrival to its last byte's hand-off
  LatencyHistogram e2e_latency{{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}};
};

std::string render_metrics(const EngineMetrics& engine, const HttpCounters& http);

}  // namespace dsv41::server
