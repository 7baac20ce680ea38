#!/usr/bin/env python3
"""Bytes a prefill server hands a decode server (docs/distributed.md, "Bytes on the wire").

usage: scripts/handover-bytes.py MODEL_DIR WORDS

Starts a single server, a prefill server and a decode server per handover mode (exact, replay) on
loopback, sends each the same greedy chat prompt (WORDS repetitions of a short phrase), and prints
one JSON line per mode: prompt tokens, tokens handed over, bytes received, bytes per handed token
(the decode server's /metrics), and whether the answer is the single server's.
"""
import json
import re
import subprocess
import sys
import urllib.request

BINARY = "build/dsv41"


def start(model, args):
    p = subprocess.Popen([BINARY, "serve", "-m", model, "--port", "0", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    return p, int(re.search(r"http://[^:]+:(\d+)", line).group(1)), line


def chat(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))


def handover_metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l.startswith("dsv41_handover")}


def main():
    model, words = sys.argv[1], int(sys.argv[2])
    text = " ".join(f"word{i} river stone" for i in range(words))
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    servers = []
    try:
        single, port, _ = start(model, [])
        servers.append(single)
        want = chat(port, body)["choices"][0]["message"]["content"]
        prefill, _, line = start(model, ["--role", "prefill"])
        servers.append(prefill)
        peer = re.search(r"handover on ucx (\S+)\)", line).group(1)
        for mode in ["exact", "replay"]:
            decode, port, _ = start(model, ["--role", "decode", "--prefill-peer", peer, "--handover", mode])
            servers.append(decode)
            r = chat(port, body)
            m = handover_metrics(port)
            print(json.dumps({"mode": mode, "prompt_tokens": r["usage"]["prompt_tokens"],
                              "handover_tokens": m["dsv41_handover_tokens_total"],
                              "handover_bytes": m["dsv41_handover_bytes_total"],
                              "bytes_per_token": m["dsv41_handover_bytes_total"] / max(1, m["dsv41_handover_tokens_total"]),
                              "same_answer": r["choices"][0]["message"]["content"] == want}))
    finally:
        for p in servers:
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
