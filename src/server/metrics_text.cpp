#include "server/metrics_text.h"

#include <charconv>
#include <cstdio>

namespace dsv41::server {
namespace {

void metric(std::string& out, const char* name, const char* type, const char* help, uint64_t value,
            const char* labels = "") {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
  out += name;
  out += labels;
  out += ' ';
  out += std::to_string(value);
  out += '\n';
}

void metric(std::string& out, const char* name, const char* type, const char* help, double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.9g", value);
  out += std::string("# HELP ") + name + ' ' + help + "\n# TYPE " + name + ' ' + type + '\n' + name + ' ' + text + '\n';
}

// Bounds as Prometheus clients write them: the shortest text that reads back the same ("0.001",
// "10", "2560").
std::string bound_text(double b) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, b);
  return std::string(buf, r.ptr);
}

}  // namespace

std::string LatencyHistogram::render(const std::string& name, const std::string& help) const {
  std::string out = "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    cumulative += counts_[i];
    const std::string le = i < bounds_.size() ? bound_text(bounds_[i]) : "+Inf";
    out += name + "_bucket{le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  char sum[64];
  std::snprintf(sum, sizeof sum, "%.9g", sum_);
  out += name + "_sum " + sum + "\n" + name + "_count " + std::to_string(count_) + "\n";
  return out;
}

std::string render_metrics(const EngineMetrics& m, const HttpCounters& h) {
  std::string out;
  metric(out, "dsv41_requests_total", "counter", "Requests submitted to the engine.", m.requests_total);
  metric(out, "dsv41_requests_finished_total", "counter", "Requests that ended with stop or length.", m.requests_finished);
  metric(out, "dsv41_requests_cancelled_total", "counter", "Requests cancelled (client gone, shutdown).", m.requests_cancelled);
  metric(out, "dsv41_requests_failed_total", "counter", "Requests the engine failed on.", m.requests_failed);
  metric(out, "dsv41_requests_running", "gauge", "Requests in the running batch.", m.requests_running);
  metric(out, "dsv41_requests_queued", "gauge", "Requests waiting for a slot or KV memory.", m.requests_queued);
  metric(out, "dsv41_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", m.prompt_tokens_total);
  metric(out, "dsv41_generation_tokens_total", "counter", "Tokens generated.", m.generation_tokens_total);
  metric(out, "dsv41_cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache.", m.cached_tokens_total);
  metric(out, "dsv41_steps_total", "counter", "Scheduler steps run.", m.steps_total);
  metric(out, "dsv41_step_running_seconds", "gauge", "How long the step now running has run (0 between steps).",
         m.step_running_seconds);
  metric(out, "dsv41_batch_size", "gauge", "Sequences in the last scheduler step.", m.last_batch_size);
  metric(out, "dsv41_kv_pages_in_use", "gauge", "KV pages allocated (running sequences and the prefix cache).", m.kv_pages_in_use);
  metric(out, "dsv41_prefix_cache_pages", "gauge", "KV pages the prefix cache holds (part of kv_pages_in_use).", m.cache_pages_in_use);
  metric(out, "dsv41_prefix_cache_blocks", "gauge", "64-token blocks the prefix cache holds in RAM (what KV events report).", m.prompt_cache_ram_blocks);
  metric(out, "dsv41_prompt_cache_disk_files", "gauge", "Entries in the prompt-cache folder.", m.prompt_cache_disk_files);
  metric(out, "dsv41_prompt_cache_disk_bytes", "gauge", "Bytes of the prompt-cache folder's entries.", m.prompt_cache_disk_bytes);
  metric(out, "dsv41_prompt_cache_evictions_total", "counter", "Prompt-cache files removed to stay within the disk budget or to make room on a full disk.", m.prompt_cache_evictions);
  metric(out, "dsv41_prompt_cache_write_failures_total", "counter", "Prompt-cache writes that failed (the requests went on without caching).", m.prompt_cache_write_failures);
  metric(out, "dsv41_prompt_cache_disk_full_total", "counter", "Prompt-cache writes that found the disk full (ENOSPC, EDQUOT); each removed the least recently used entries and tried once more.", m.prompt_cache_disk_full);
  metric(out, "dsv41_expert_cache_capacity_bytes", "gauge", "Size of the routed experts' cache (0: the experts are resident).", m.expert_cache_capacity_bytes);
  metric(out, "dsv41_expert_cache_resident_bytes", "gauge", "Packed experts the cache holds.", m.expert_cache_resident_bytes);
  metric(out, "dsv41_expert_cache_hits_total", "counter", "Routed experts found in the cache.", m.expert_cache_hits);
  metric(out, "dsv41_expert_cache_misses_total", "counter", "Routed experts read from the checkpoint.", m.expert_cache_misses);
  metric(out, "dsv41_expert_cache_evictions_total", "counter", "Experts evicted from the cache.", m.expert_cache_evictions);
  metric(out, "dsv41_expert_cache_read_bytes_total", "counter", "Bytes of experts read from the checkpoint.", m.expert_cache_bytes_read);
  metric(out, "dsv41_expert_cache_read_seconds_total", "counter", "Wall time of those reads.", m.expert_cache_read_seconds);
  metric(out, "dsv41_handovers_total", "counter", "Prompts a prefill server prefilled for this decode server.", m.handovers);
  metric(out, "dsv41_handover_tokens_total", "counter", "Prompt tokens whose state came from the prefill server.", m.handover_tokens);
  metric(out, "dsv41_handover_bytes_total", "counter", "Bytes of state received from the prefill server.", m.handover_bytes);
  metric(out, "dsv41_handover_fallbacks_total", "counter", "Handovers that failed or were refused (prefilled here instead).", m.handover_fallbacks);
  metric(out, "dsv41_kv_event_batches_total", "counter", "KV event batches handed to the publisher (serve --kv-events).", m.kv_event_batches);
  metric(out, "dsv41_kv_event_batches_dropped_total", "counter", "KV event batches the publisher gave up (its queue was full).", m.kv_event_batches_dropped);
  metric(out, "dsv41_decode_forwards_total", "counter", "Batched decode forwards (plain and speculative sequences together).", m.decode_forwards_total);
  metric(out, "dsv41_mixed_forwards_total", "counter", "Decode forwards that also ran prompt rows (one forward per step).", m.mixed_forwards_total);
  metric(out, "dsv41_step_budget_seconds", "gauge", "The time budget of a step with decoders beside a prompt (0 before the first step).", m.step_budget_seconds);
  // speculative decoding, under vLLM's names
  metric(out, "vllm:spec_decode_num_drafts_total", "counter", "Speculative verifications run.", m.spec_verify_steps);
  metric(out, "vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", m.spec_draft_tokens);
  metric(out, "vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", m.spec_accepted_tokens);
  if (!m.spec_accepted_per_position.empty()) {
    out += "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Draft tokens accepted, by position in the draft.\n"
           "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n";
    for (size_t k = 0; k < m.spec_accepted_per_position.size(); ++k) {
      out += "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"" + std::to_string(k) + "\"} " +
             std::to_string(m.spec_accepted_per_position[k]) + "\n";
    }
  }
  metric(out, "dsv41_spec_decode_guard_pauses_total", "counter", "Times the acceptance guard stopped a sequence's drafting.", m.spec_guard_pauses);
  metric(out, "dsv41_kv_bytes_in_use", "gauge", "Bytes of the KV pages allocated.", m.kv_bytes_in_use);
  metric(out, "dsv41_kv_budget_bytes", "gauge", "The KV memory budget admission works within.", m.kv_budget_bytes);
  out += "# HELP dsv41_http_responses_total HTTP responses sent, by status class.\n"
         "# TYPE dsv41_http_responses_total counter\n";
  out += "dsv41_http_responses_total{code=\"2xx\"} " + std::to_string(h.responses_2xx) + "\n";
  out += "dsv41_http_responses_total{code=\"4xx\"} " + std::to_string(h.responses_4xx) + "\n";
  out += "dsv41_http_responses_total{code=\"5xx\"} " + std::to_string(h.responses_5xx) + "\n";
  metric(out, "dsv41_http_streams_open", "gauge", "Streaming responses being written.", h.streams_open);
  metric(out, "dsv41_http_client_disconnects_total", "counter", "Requests (streamed or not) ended by the client going away.",
         h.client_disconnects);
  metric(out, "dsv41_http_accept_failures_total", "counter", "Accepts that failed (out of file descriptors), each retried.",
         h.accept_failures);
  metric(out, "dsv41_http_turned_away_total", "counter",
         "Connections and request bodies refused with 503 for a connection cap or the body budget.", h.turned_away);
  metric(out, "dsv41_log_lines_dropped_total", "counter", "Log lines dropped because the log (stderr) was not being read.",
         h.log_lines_dropped);
  out += h.time_to_first_token.render("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.");
  out += h.inter_token_latency.render("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.");
  out += h.queue_time.render("vllm:request_queue_time_seconds", "Histogram of time spent in the waiting queue in seconds.");
  out += h.e2e_latency.render("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.");
  return out;
}

}  // namespace dsv41::server
