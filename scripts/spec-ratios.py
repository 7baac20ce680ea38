#!/usr/bin/env python3
"""Speculative decoding against plain decoding on one model, as docs/speculative.md reports it.

usage: scripts/spec-ratios.py MODEL_DIR TOKENS REPETITIONS PROMPT_LENGTH [DSV41_BINARY]

Per repetition: plain greedy `dsv41 generate`, then `--speculative dspark` with the plain run's own
continuation as --oracle-drafts (every draft accepted), with --acceptance-guard off and with the
guard. All four must give the same tokens; each speculative decode rate is divided by the plain rate
of the same repetition, since a shared machine's speed drifts between repetitions.
"""
import json
import statistics
import subprocess
import sys


def main():
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    model, tokens, reps, prompt_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    binary = sys.argv[5] if len(sys.argv) == 6 else "build/dsv41"
    prompt = ",".join(str(i) for i in range(1, prompt_len + 1))

    def run(extra):
        out = subprocess.run([binary, "generate", "-m", model, "--prompt-ids", prompt, "-n", tokens, "--json"] + extra,
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    ratios = {"oracle": [], "off": [], "on": []}
    last = {}
    for rep in range(reps):
        plain = run([])
        oracle = ",".join(map(str, plain["tokens"]))
        runs = {"oracle": run(["--speculative", "dspark", "--oracle-drafts", oracle]),
                "off": run(["--speculative", "dspark", "--acceptance-guard", "off"]),
                "on": run(["--speculative", "dspark"])}
        for name, r in runs.items():
            if r["tokens"] != plain["tokens"]:
                sys.exit(f"{name}: the tokens differ from plain decoding")
            ratios[name].append(r["timings"]["decode_tok_s"] / plain["timings"]["decode_tok_s"])
            last[name] = r
        print(f"repetition {rep}: plain {plain['timings']['decode_tok_s']:.2f} tok/s,",
              ", ".join(f"{k} {v[-1]:.2f}x" for k, v in ratios.items()), flush=True)
    for name, v in ratios.items():
        s = last[name]["spec"]
        print(f"{name}: median {statistics.median(v):.2f}x (min {min(v):.2f}, max {max(v):.2f}); "
              f"proposed {s['proposed']}, accepted {s['accepted']}, verifications {s['verify_steps']}, "
              f"plain steps {s['plain_steps']}, guard pauses {s['guard_pauses']}, "
              f"target forwards per token {s['target_forwards_per_token']:.2f}")


if __name__ == "__main__":
    main()
