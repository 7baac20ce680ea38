#!/usr/bin/env python3
"""A streamed answer's gaps between tokens while another client's long prompt is read, through `serve`.

usage: scripts/stream-gaps.py MODEL_DIR PROMPT_TOKENS [DSV41_BINARY] [-- SERVE_FLAGS...]

Starts `dsv41 serve` on MODEL_DIR (port 0, the flags after --), then, as two clients would:
  1. the long prompt alone: PROMPT_TOKENS random token ids, max_tokens 1, timed from request to answer;
  2. a greedy stream (a short prompt, tokens until told to stop), whose gaps between tokens are timed
     alone over its first 64 tokens;
  3. while it streams, another long prompt of PROMPT_TOKENS (other ids, so no prompt-cache hit), timed.
Prints one JSON object: the stream's gap alone (p50) and while the prompt is read (p50, p99, max, and
the tokens it got), the prompt's time alone and beside the stream, and their ratio.
"""
import json
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request


def post(port, body, stream=False):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=3600)


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def main():
    args = sys.argv[1:]
    flags = args[args.index("--") + 1:] if "--" in args else []
    args = args[:args.index("--")] if "--" in args else args
    if len(args) not in (2, 3):
        sys.exit(__doc__)
    model, length = args[0], int(args[1])
    binary = args[2] if len(args) == 3 else "build/dsv41"
    with open(model + "/config.json") as f:
        config = json.load(f)
    config = config.get("text_config", config)  # the released layout nests the language model's
    vocab, context = config["vocab_size"], config["max_position_embeddings"]
    # the stream outlasts the prompt beside it (it is cancelled then) and stays within the context
    stream_tokens = min(4 * length + 4096, context - 16)
    server = subprocess.Popen([binary, "serve", "-m", model, "--port", "0", "--parallel", "2"] + flags,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        if "listening on" not in line:
            sys.exit(f"serve did not start: {line!r}")
        port = int(line.split("listening on http://")[1].split()[0].rsplit(":", 1)[1])
        rng = random.Random(7)

        def prompt_ids():
            return [rng.randrange(3, vocab - 3) for _ in range(length)]

        def timed_prompt(ids):
            began = time.monotonic()
            post(port, {"prompt": ids, "max_tokens": 1, "temperature": 0}).read()
            return time.monotonic() - began

        alone = timed_prompt(prompt_ids())
        arrivals = []
        stop = threading.Event()

        def stream():
            body = {"prompt": [rng.randrange(3, vocab - 3) for _ in range(16)], "max_tokens": stream_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with post(port, body) as r:
                for raw in r:
                    if raw.startswith(b"data: {"):
                        arrivals.append(time.monotonic())
                    if stop.is_set():
                        return  # closing the connection cancels the request

        t = threading.Thread(target=stream)
        t.start()
        while len(arrivals) < 65:
            time.sleep(0.005)
        solo = [b - a for a, b in zip(arrivals[1:65], arrivals[2:65])]
        began = time.monotonic()
        beside = timed_prompt(prompt_ids())
        ended = time.monotonic()
        stop.set()
        t.join()
        pairs = [(a, b) for a, b in zip(arrivals, arrivals[1:]) if b > began and a < ended]
        during = [b - a for a, b in pairs]
        # where in the prompt's time the largest gaps fell (0: its start, 1: its end)
        largest = sorted(pairs, key=lambda p: p[0] - p[1])[:3]
        largest_at = [round((a - began) / (ended - began), 3) for a, b in largest]
        ms = lambda s: round(s * 1e3, 2)
        print(json.dumps({
            "prompt_tokens": length, "serve_flags": flags,
            "stream_gap_alone_ms": {"p50": ms(statistics.median(solo))},
            "stream_gap_during_prompt_ms": {"p50": ms(percentile(during, 0.5)), "p99": ms(percentile(during, 0.99)),
                                            "max": ms(max(during, default=0)), "tokens": len(during),
                                            "largest_three_at": largest_at},
            "prompt_seconds_alone": round(alone, 3), "prompt_seconds_beside_stream": round(beside, 3),
            "prompt_time_ratio": round(beside / alone, 3)}, indent=2))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
