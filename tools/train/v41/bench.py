"""Time one forward + backward of V41 on random weights (the training-speed target).

usage: python3 -m v41.bench [--golden-dir tests/golden | --model DIR] [--batch 8] [--seq 256] [--mode float|qat|exact]
The geometry is tiny-dense's config (hidden 256, 6 layers + 1 DSpark block, vocab 512), or the model
folder's (--model, e.g. models/brown-tiny, with its tokenizer's Engram map), with max_seq_len raised
to the sequence length; the loss is LM cross-entropy + the indexer losses + the DSpark losses, as a
training step would compute it.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from v41 import V41, engram_token_map, load_config  # noqa: E402
from v41.train_loss import training_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "golden"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--model", help="a model folder whose geometry to time instead of tiny-dense's")
    ap.add_argument("--mode", default="float", choices=["float", "qat", "exact"])
    ap.add_argument("--dspark-weight", type=float, default=1.0, help="0: a step without the DSpark stages")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = dict(load_config(a.model or os.path.join(a.golden_dir, "tiny-dense")))
    cfg["max_seq_len"] = max(cfg.get("max_seq_len", 0), a.seq)
    exact = a.mode != "float"
    m = V41(cfg, exact_numerics=exact, exact_order=a.mode == "exact", fake_quant_weights=a.mode == "qat")
    m.init_weights(0)
    if a.model:
        tokenizer = os.path.join(a.model, "tokenizer.json")
        m.set_token_map(torch.as_tensor(engram_token_map(tokenizer, cfg["vocab_size"]), dtype=torch.int64))
    else:
        m.set_token_map(torch.arange(cfg["vocab_size"]) // 2)  # tiny-dense's map: ids 2k, 2k+1 -> k
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (a.batch, a.seq), generator=g)
    times = []
    for _ in range(a.repeat):
        m.zero_grad(set_to_none=True)
        t = time.time()
        loss, parts = training_loss(m, ids, dspark_weight=a.dspark_weight, confidence_weight=0.1 * a.dspark_weight)
        t_fwd = time.time() - t
        loss.backward()
        times.append((t_fwd, time.time() - t))
    for f, tot in times:
        print(f"mode {a.mode}: batch {a.batch} x {a.seq} tokens: forward {f:.2f} s, forward+backward {tot:.2f} s")
    print("loss parts:", {k: round(float(v), 4) for k, v in parts.items()})


if __name__ == "__main__":
    main()
