#!/usr/bin/env python3
"""Speculation through a running `dsv41 serve`: speed against plain decoding, request after request.

usage: scripts/server-spec-ratios.py PORT TEXT_FILE PAIRS TOKENS

For each of PAIRS prompts (the paragraphs of TEXT_FILE with at least 24 words, cut to 24, in turn):
the same greedy completion streamed twice, `"speculative": "off"` then `"dspark"`, TOKENS tokens each
(ignore_eos). A request's decode rate is (TOKENS - 1) over the time from its first streamed token to
its last; each pair's ratio is speculative over plain (ratios within a pair hold on a machine whose
speed drifts). Prints every pair, the median ratio, whether the texts agree, and the server's
speculation counters from /metrics.
"""
import json
import statistics
import sys
import time
import urllib.request


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    port, text_file, pairs, tokens = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with open(text_file) as f:
        prompts = [" ".join(line.split()[:24]) for line in f if len(line.split()) >= 24]
    base = f"http://127.0.0.1:{port}"

    def run(prompt, speculative):
        body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                           "ignore_eos": True, "speculative": speculative}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        times, text = [], []
        with urllib.request.urlopen(req) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                piece = json.loads(line[6:])["choices"][0].get("text", "")
                if piece:
                    times.append(time.perf_counter())
                    text.append(piece)
        return (tokens - 1) / (times[-1] - times[0]), "".join(text)

    ratios = []
    for i in range(pairs):
        prompt = prompts[i % len(prompts)]
        plain, plain_text = run(prompt, "off")
        spec, spec_text = run(prompt, "dspark")
        ratios.append(spec / plain)
        print(f"pair {i}: plain {plain:.0f} tok/s, dspark {spec:.0f} tok/s, ratio {spec / plain:.2f}, "
              f"same text {plain_text == spec_text}")
    print(f"median ratio {statistics.median(ratios):.2f}")
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    print("\n".join(l for l in metrics.splitlines() if "spec_decode" in l and not l.startswith("#")))


if __name__ == "__main__":
    main()
