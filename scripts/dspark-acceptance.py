#!/usr/bin/env python3
"""DSpark on a trained model, as docs/speculative.md reports it: acceptance and speed on real text.

usage: scripts/dspark-acceptance.py MODEL_DIR TEXT_FILE PROMPTS TOKENS [DSV41_BINARY]

The first PROMPTS paragraphs (lines) of TEXT_FILE, cut to their first 24 words, are the prompts. For
each, at temperature 0 and at 0.7 (seeded): plain `dsv41 generate`, then `--speculative dspark` with a
fixed draft length of the whole block and the acceptance guard off (every step drafts, so each draft
position is measured), then with the engine's defaults (adaptive length, guard on). At temperature 0
the speculative tokens must equal the plain ones. Reported: mean tokens per verify step (accepted
drafts + the target's own token), acceptance per draft position (accepted at k / proposed at k), and
each decode rate divided by the plain rate of the same prompt (ratios within one prompt hold on a
shared machine whose speed drifts).
"""
import json
import statistics
import subprocess
import sys


def main():
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    model, text_file, n_prompts, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    binary = sys.argv[5] if len(sys.argv) == 6 else "build/dsv41"
    with open(model + "/config.json") as f:
        block = json.load(f).get("dspark_block_size", 4)
    with open(text_file) as f:
        prompts = [" ".join(line.split()[:24]) for line in f if len(line.split()) >= 24][:n_prompts]

    def run(prompt, extra):
        out = subprocess.run([binary, "generate", "-m", model, "-p", prompt, "-n", tokens, "--ignore-eos", "--json"]
                             + extra, capture_output=True, text=True, check=True).stdout
        return json.loads(out[out.index("{"):])

    for temp in ("0", "0.7"):
        sampling = ["--temp", temp, "--seed", "1"]
        ratios = {"fixed": [], "default": []}
        accepted = [0] * block
        proposed = [0] * block
        steps = drafts_acc = 0
        for prompt in prompts:
            plain = run(prompt, sampling)
            fixed = run(prompt, sampling + ["--speculative", "dspark", "--draft-length", str(block),
                                             "--acceptance-guard", "off"])
            default = run(prompt, sampling + ["--speculative", "dspark"])
            if temp == "0" and not (fixed["tokens"] == plain["tokens"] == default["tokens"]):
                sys.exit(f"greedy speculative tokens differ from plain decoding for prompt {prompt!r}")
            for name, r in (("fixed", fixed), ("default", default)):
                ratios[name].append(r["timings"]["decode_tok_s"] / plain["timings"]["decode_tok_s"])
            spec = fixed["spec"]
            steps += spec["verify_steps"]
            drafts_acc += spec["accepted"]
            for k, a in enumerate(spec["accepted_per_position"][:block]):
                accepted[k] += a
            for k in range(block):
                proposed[k] += spec["verify_steps"]  # a fixed length proposes every position every step
        per_pos = [accepted[k] / proposed[k] if proposed[k] else 0.0 for k in range(block)]
        print(f"temperature {temp}, {len(prompts)} prompts x {tokens} tokens:")
        print(f"  fixed length {block}, guard off: {(drafts_acc + steps) / max(steps, 1):.2f} tokens per verify step; "
              "acceptance by draft position " + ", ".join(f"{p:.2f}" for p in per_pos))
        for name in ("fixed", "default"):
            v = ratios[name]
            print(f"  {name:7s} decode speed / plain: median {statistics.median(v):.2f} "
                  f"(min {min(v):.2f}, max {max(v):.2f})")


if __name__ == "__main__":
    main()
