"""Trains a small DeepSeek-V4.1 on the prepared corpus, seeded, for a number of steps.

The model starts from a checkpoint in the released layout (`dsv41 make-tiny --tokenizer`, which
fixes the geometry, the vocabulary and the Engram tables) and ends as full-precision weights that
`dsv41 pack` quantizes back into that layout. What is trained:

  * the backbone on next-token cross-entropy over windows of --seq tokens (BOS first, as
    `dsv41 ppl` scores), every layer on every token (exact mode), the sparse path included: the
    contexts are many times the top-k, so attention runs over what the indexers select;
  * the indexers on the auxiliary loss DeepSeek trains its lightning indexers with (v41/attention.py:
    KL divergence from the main attention's mass over the compressed rows, attention side detached);
  * the DSpark stages on drafting blocks from the target's taps, teacher-forced, with no gradient
    into the backbone (the tech report trains DSpark on a frozen backbone);
  * for the last --qat-fraction of the budget, quantization-aware: the forward pass rounds as the
    engine does (bf16 activations, FP8 activation QDQ, FP4/FP8 KV, FP8 weights with 32x32 UE8M0
    tiles, FP4 experts), each rounding a straight-through estimator.

The budget is a step count (--steps): the learning-rate schedule and the switch to quantization-aware
training follow the step, so one command gives the same weights, bit for bit, however busy the machine
is (the same torch build and --threads; the summary records the weights' SHA-256). --minutes instead
gives a wall-clock budget for exploration, whose result depends on the machine's speed.

usage: /usr/bin/python3 tools/train/train.py --init DIR --data DIR --out DIR (--steps N | --minutes M) [--seed S]
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

# torch runs its own threads (--threads) and calls OpenBLAS from each; OpenBLAS's own pool on top of
# them oversubscribes the cores and its threads spin: one BLAS thread per caller made a step of
# brown-tiny's geometry 1.3-1.9x faster (docs/training.md). Set before numpy or torch loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from v41 import V41, engram_token_map, load_config, load_weights, save_float_checkpoint  # noqa: E402
from v41.train_loss import training_loss  # noqa: E402

BOS = 0


def log(f, msg):
    print(msg, flush=True)
    f.write(msg + "\n")
    f.flush()


def load_ids(path):
    ids = np.fromfile(path, dtype="<u4").astype(np.int64)
    if ids.size == 0:
        sys.exit(f"{path}: no tokens")
    return torch.from_numpy(ids)


def batch(ids, rng, b, s):
    """b windows of s tokens: BOS, then s-1 tokens from a random start; targets are the next tokens."""
    starts = rng.integers(0, ids.numel() - s, size=b)
    rows = torch.stack([ids[int(i): int(i) + s] for i in starts])  # s tokens; the last is a target only
    x = torch.cat([torch.full((b, 1), BOS, dtype=torch.int64), rows[:, :-1]], dim=1)
    return x, rows


def heldout_nll(model, ids, s, stride, max_windows):
    """Mean NLL per scored token with dsv41 ppl's protocol: windows of s tokens (BOS first) every
    `stride` tokens, each scoring its last `stride` tokens (the first window scores all)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for w, start in enumerate(range(0, ids.numel() - (s - 1) + 1, stride)):
            if w >= max_windows:
                break
            seg = ids[start: start + s - 1]
            x = torch.cat([torch.tensor([BOS]), seg[:-1]]).unsqueeze(0)
            logits = model(x)[0]
            lp = torch.log_softmax(logits.float(), dim=-1)
            nll = -lp.gather(1, seg.view(-1, 1)).squeeze(1)
            first = 0 if start == 0 else (s - 1) - stride
            total += float(nll[first:].sum())
            count += nll.numel() - first
    return total / max(count, 1), count


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", required=True, help="model folder to start from (dsv41 make-tiny --tokenizer)")
    ap.add_argument("--data", required=True, help="folder with train.u32, heldout.u32, engram_map.i32")
    ap.add_argument("--out", required=True)
    budget = ap.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="training steps (repeatable: the schedule follows the step)")
    budget.add_argument("--minutes", type=float, help="wall-clock budget (exploration: depends on the machine's speed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--qat-fraction", type=float, default=0.2)
    ap.add_argument("--indexer-weight", type=float, default=0.1, help="per index-source layer")
    ap.add_argument("--dspark-weight", type=float, default=0.5)
    ap.add_argument("--dspark-every", type=int, default=4, help="train the DSpark stages every N-th step")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    if (args.steps is not None and args.steps < 1) or (args.minutes is not None and args.minutes <= 0):
        ap.error("the budget (--steps or --minutes) must be positive")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "train.log"), "w")
    log(logf, "command: " + " ".join(sys.argv))
    log(logf, f"torch {torch.__version__}, {args.threads} threads")

    cfg = load_config(args.init)
    weights = {k: v for k, v in load_weights(args.init).items() if not k.endswith(".scale")}
    engine_map = torch.from_numpy(np.fromfile(os.path.join(args.data, "engram_map.i32"), dtype="<i4").astype(np.int64))
    own_map = engram_token_map(os.path.join(args.init, "tokenizer.json"), cfg["vocab_size"])
    if not torch.equal(engine_map, torch.as_tensor(own_map, dtype=torch.int64)):
        diff = int((engine_map != torch.as_tensor(own_map)).sum())
        sys.exit(f"the Engram token map of tools/train differs from the engine's at {diff} ids")
    model = V41(cfg, exact_numerics=False, fake_quant_weights=False, token_map=engine_map)
    model.load_state_dict(weights, strict=True)
    train_ids = load_ids(os.path.join(args.data, "train.u32"))
    held_ids = load_ids(os.path.join(args.data, "heldout.u32"))
    n_params = sum(p.numel() for p in model.parameters())
    log(logf, f"model: {n_params / 1e6:.2f} M parameters; train {train_ids.numel()} tokens, "
              f"held-out {held_ids.numel()} tokens")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and ".hc_" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and ".hc_" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    t0 = time.time()
    step, qat, tokens = 0, False, 0
    ema = None

    def progress():
        """The fraction of the budget spent: by step (repeatable) or by the clock."""
        if args.steps is not None:
            return step / args.steps
        return (time.time() - t0) / (args.minutes * 60)

    while True:
        frac = progress()
        if frac >= 1:
            break
        if not qat and frac >= 1 - args.qat_fraction:
            qat = True
            model.set_numerics(exact=True, exact_order=False, fake_quant_weights=True)
            log(logf, f"step {step}: quantization-aware from here ({(time.time() - t0) / 60:.1f} min)")
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train_ids, rng, args.batch, args.seq)
        dspark_weight = args.dspark_weight if step % args.dspark_every == 0 else 0.0
        loss, parts = training_loss(model, torch.cat([x, y[:, -1:]], dim=1), indexer_weight=args.indexer_weight,
                                    dspark_weight=dspark_weight, confidence_weight=0.1 * dspark_weight)
        ce = parts["lm"]
        idx_parts = [v for k, v in parts.items() if k.startswith("indexer")]
        idx = sum(idx_parts) / max(len(idx_parts), 1)
        ds = parts.get("dspark")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        ema = float(ce) if ema is None else 0.95 * ema + 0.05 * float(ce)
        if step % 25 == 0 or step == 1:
            el = time.time() - t0
            log(logf, f"step {step:5d}  {el / 60:5.1f} min  lr {lr:.2e}  ce {float(ce):.3f} (ema {ema:.3f}, "
                      f"ppl {math.exp(ema):.1f})  indexer {float(idx):.3f}  dspark "
                      f"{float(ds) if ds is not None else float('nan'):.3f}  {tokens / el:.0f} tok/s"
                      + ("  qat" if qat else ""))
    log(logf, f"trained {step} steps, {tokens} tokens in {(time.time() - t0) / 60:.1f} min")

    model.set_numerics(exact=True, exact_order=False, fake_quant_weights=True)
    model.eval()
    nll, n = heldout_nll(model, held_ids, args.seq, args.seq // 2, args.eval_windows)
    log(logf, f"held-out (quantized as exported, ctx {args.seq}, stride {args.seq // 2}, {n} tokens): "
              f"nll {nll:.4f}, ppl {math.exp(nll):.2f}")
    weights_path = os.path.join(args.out, "weights.safetensors")
    save_float_checkpoint(weights_path, model.state_dict(), {"steps": step, "seed": args.seed})
    with open(weights_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"steps": step, "tokens": tokens, "heldout_nll": nll, "heldout_tokens": n,
                   "minutes": (time.time() - t0) / 60, "weights_sha256": digest, "args": vars(args)}, f, indent=2)
    log(logf, f"wrote {weights_path} (sha256 {digest})")


if __name__ == "__main__":
    main()
