#!/usr/bin/env python3
"""Checks the PyTorch port of DeepSeek-V4.1 (tools/train/v41) against the official reference's
goldens (tests/golden/README.md), with the engine's thresholds (tests/golden_test.cpp), then that one
training step gives every parameter a finite, non-zero gradient.

usage: /usr/bin/python3 tools/train/check_golden.py [--golden-dir tests/golden] [--skip-grad]

One line per comparison; exit status 1 if any fails.
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from v41 import V41, engram_token_map, load_config, load_weights, save_float_checkpoint  # noqa: E402
from v41.checkpoint import read_safetensors, dequantize  # noqa: E402
from v41.numerics import fake_quant  # noqa: E402
from v41.train_loss import training_loss  # noqa: E402

FAILURES = []


def report(ok, line):
    print(("ok    " if ok else "FAIL  ") + line, flush=True)
    if not ok:
        FAILURES.append(line)


def arr(d, name, dtype="<f4"):
    return torch.from_numpy(np.fromfile(os.path.join(d, name), dtype=dtype).copy())


def agreement(ours, ref):
    """Relative L2 of all rows, median and worst per-row max |Δ|, argmax agreement (golden_util.h)."""
    ours, ref = ours.double(), ref.double()
    rel = ((ours - ref).norm() / ref.norm()).item()
    mx = (ours - ref).abs().amax(dim=-1)
    med = mx.sort().values[len(mx) // 2].item()
    arg = (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()
    return rel, med, mx.max().item(), arg


def expect_rows(what, ours, ref):
    rows = ref.shape[0]
    rel, med, worst, arg = agreement(ours, ref)
    need = (rows - 1) / rows if rows < 50 else 0.98
    ok = rel <= 0.01 and med <= 0.01 and arg >= need - 1e-9
    report(ok, f"{what:44s} rows {rows:3d}  rel L2 {rel:.2e}  median max|d| {med:.2e}  worst {worst:.2e}  "
               f"argmax {100 * arg:.1f}% (need rel<=1%, median<=0.01, argmax>={100 * need:.1f}%)")


def load_model(d, **kw):
    cfg = load_config(d)
    m = V41(cfg, **kw)
    m.load_state_dict(load_weights(d), strict=True)
    m.set_token_map(engram_token_map(os.path.join(d, "tokenizer.json"), cfg["vocab_size"]))
    m.eval()
    return m, cfg


def teacher_of(d, meta):
    sel, pools = {}, {}
    for k, info in meta["index_selection"]["layers"].items():
        sel[int(k)] = arr(d, info["selected_file"], "<i4").view(*info["selected_shape"])
        if "candidates_file" in info:
            pools[int(k)] = arr(d, info["candidates_file"], np.uint8).view(*info["candidates_shape"])
    shape = meta["block_outputs"]["shape"]
    return {"streams": arr(d, meta["block_outputs"]["file"]).view(*shape), "selections": sel, "pools": pools}


def kth(row, k):
    return row.sort(descending=True).values[k - 1].item()


def check_index(name, d, meta, cfg, captured, strict):
    """Scores equal to bf16 rounding; selections equal as sets except entries tied with the k-th
    score; candidate pools equal except blocks tied with the weakest kept block."""
    for key, info in meta["index_selection"]["layers"].items():
        L = int(key)
        cap = captured[L]
        ref_s = arr(d, info["scores_file"]).view(*info["scores_shape"])
        ref_k = arr(d, info["selected_file"], "<i4").view(*info["selected_shape"])
        ours_s, ours_k = cap["scores"][0], cap["selected"][0]
        n, k = ref_s.shape[1], ref_k.shape[1]
        if ours_s.shape != ref_s.shape or ours_k.shape != ref_k.shape:
            report(False, f"{name} indexer layer {L}: shapes {tuple(ours_s.shape)}/{tuple(ours_k.shape)} vs "
                          f"{tuple(ref_s.shape)}/{tuple(ref_k.shape)}")
            continue
        same_inf = torch.isinf(ours_s) == torch.isinf(ref_s)
        fin = torch.isfinite(ref_s) & torch.isfinite(ours_s)
        ulp = torch.ldexp(torch.ones_like(ref_s), torch.frexp(ref_s.abs().clamp_min(1e-30))[1] - 8)
        exact = int(((ours_s != ref_s) & fin).sum() + (~same_inf).sum())
        beyond = int(((ours_s - ref_s).abs() > ulp)[fin].sum() + (~same_inf).sum())
        sel_bad, ties = 0, 0
        for q in range(ref_s.shape[0]):
            ko, kr = kth(ours_s[q], k), kth(ref_s[q], k)
            a = {int(t) for t in ours_k[q] if t >= 0 and ours_s[q, t] != ko}
            b = {int(t) for t in ref_k[q] if t >= 0 and ref_s[q, t] != kr}
            sel_bad += a != b
            raw_a = {int(t) for t in ours_k[q] if t >= 0}
            raw_b = {int(t) for t in ref_k[q] if t >= 0}
            ties += (a == b) and raw_a != raw_b
        pool_bad = 0
        if "candidates_file" in info:
            ref_c = arr(d, info["candidates_file"], np.uint8).view(*info["candidates_shape"]).bool()
            ours_c = cap["candidates"][0]
            bs, r = cfg["candidate_block_size"], cfg["compress_ratios"][L]
            nb = (n + bs - 1) // bs
            for q in range(ref_s.shape[0]):
                row = torch.nn.functional.pad(ours_s[q], (0, nb * bs - n), value=float("-inf"))
                block = row.view(nb, bs).amax(-1)
                vis = (q + 1) // r
                if vis > 0:
                    block[(vis - 1) // bs] = float("inf")
                kept = ours_c[q][::bs][:nb]
                weakest = block[kept].min().item() if kept.any() else float("inf")
                diff = (ours_c[q] != ref_c[q])[::bs][:nb]
                pool_bad += bool((diff & (block != weakest)).any())
        ok = sel_bad == 0 and pool_bad == 0 and (beyond == 0 or not strict)
        report(ok, f"{name} indexer layer {L}: {exact} of {ref_s.numel()} scores not bit-equal, {beyond} beyond "
                   f"1 bf16 ulp; {sel_bad} selections and {pool_bad} pools differ beyond ties "
                   f"({ties} ties broken otherwise)")


def block_lines(name, streams, ref, strict=True):
    for L in range(ref.shape[0]):
        a, r = streams[L, 0], ref[L]
        rel = ((a - r).double().norm() / r.double().norm()).item()
        vals = int((a != r).sum())
        pos = int((a != r).flatten(1).any(1).sum())
        report(rel <= 0.01 or not strict, f"{name} block {L} output: rel L2 {rel:.2e} ({vals} of {a.numel()} values "
                                          f"differ, at {pos} positions) (need <= 1%)")


def dense_checks(gdir):
    d = os.path.join(gdir, "tiny-dense")
    meta = json.load(open(os.path.join(d, "golden.json")))
    m, cfg = load_model(d)
    ids = torch.tensor([meta["input_ids"]])
    V = cfg["vocab_size"]
    with torch.no_grad():
        out = m(ids, streams=True, index=True)
    expect_rows("tiny-dense prefill, all positions", out["logits"][0],
                arr(d, meta["prefill_all_positions"]["file"]).view(-1, V))
    block_lines("tiny-dense", out["streams"], arr(d, meta["block_outputs"]["file"]).view(*meta["block_outputs"]["shape"]))
    check_index("tiny-dense", d, meta, cfg, out["index"], strict=True)

    lens = meta["prefill_last"]["prompt_lengths"]
    rows = []
    with torch.no_grad():
        for L in lens:
            rows.append(m(ids[:, :L])[0, -1])
    expect_rows("tiny-dense prefill, last rows (9 lengths)", torch.stack(rows),
                arr(d, meta["prefill_last"]["file"]).view(-1, V))

    # decode rows: the reference's prefill of 76 then one token at a time; exact-mode prefill equals
    # decode (to 1e-3 in the reference itself), so they are the prefill's rows 75..150
    pre, n = meta["decode_teacher"]["prefill"], meta["decode_teacher"]["rows"]
    expect_rows("tiny-dense decode rows (via prefill)", out["logits"][0, pre - 1: pre - 1 + n],
                arr(d, meta["decode_teacher"]["file"]).view(-1, V))

    # greedy + DSpark: one prefill over the prompt and the greedy tokens gives every step's target
    # logits and the drafter's taps (positions are causal, so later tokens change nothing before)
    pre, toks = meta["greedy"]["prefill"], meta["greedy"]["tokens"]
    drafts = meta["dspark"]["draft_ids"]
    seq = torch.tensor([meta["input_ids"][:pre] + toks[: len(drafts)]])
    with torch.no_grad():
        g = m(seq, taps=True)
    gl = g["logits"][0, pre - 1: pre - 1 + len(toks)]
    expect_rows("tiny-dense greedy rows (teacher-forced)", gl, arr(d, meta["greedy"]["file"]).view(-1, V))
    same = int((gl.argmax(-1) == torch.tensor(toks)).sum())
    report(same >= len(toks) - 1, f"tiny-dense greedy tokens: {same} of {len(toks)} equal (need >= {len(toks) - 1})")

    B = meta["dspark"]["block_size"]
    p_idx = torch.arange(len(drafts)) + pre          # step k at target position pre + k - 1
    first = torch.tensor([toks[1: len(drafts) + 1]])
    t = time.time()
    with torch.no_grad():
        ids_d, lg, conf = m.dspark.draft(g["taps"], p_idx, first)
    ref_l = arr(d, meta["dspark"]["logits_file"]).view(len(drafts), B, V)
    ref_c = arr(d, meta["dspark"]["confidence_file"]).view(len(drafts), B)
    expect_rows(f"tiny-dense DSpark block logits ({len(drafts)} steps)", lg[0].reshape(-1, V), ref_l.reshape(-1, V))
    first_step = agreement(lg[0, 0], ref_l[0])
    report(first_step[0] <= 0.01 and first_step[3] == 1.0,
           f"tiny-dense DSpark first step alone: rel L2 {first_step[0]:.2e}, argmax {100 * first_step[3]:.0f}%")
    cd = (conf[0] - ref_c).abs().max().item()
    report(cd <= 0.005, f"tiny-dense DSpark confidence: max |d| {cd:.2e} over {ref_c.numel()} slots (need <= 0.005)")
    want = torch.tensor(drafts)
    same = int((ids_d[0][:, 1:] == want[:, 1:]).sum())
    report(same >= want[:, 1:].numel() - 1, f"tiny-dense DSpark drafted ids: {same} of {want[:, 1:].numel()} equal")

    # the loaded weights are exactly representable: fake quantization must be the identity on them
    fmts = m.weight_formats()
    moved = [n for n, p in m.named_parameters() if not torch.equal(fake_quant(p.detach(), fmts[n]), p.detach())]
    report(not moved, f"weight fake-quant is the identity on the checkpoint's {len(fmts)} tensors"
                      + (f" (moved: {moved[:5]})" if moved else ""))
    # export round trip
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        sd = m.state_dict()
        save_float_checkpoint(path, sd, {"format": "v41-float"})
        back = {k: dequantize(*v) for k, v in read_safetensors(path).items()}
        ok = set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
        report(ok, f"save_float_checkpoint round trip: {len(back)} F32 tensors, names = state_dict keys")
    return m


def sparse_checks(gdir):
    d = os.path.join(gdir, "tiny-sparse")
    meta = json.load(open(os.path.join(d, "golden.json")))
    m, cfg = load_model(d)
    ids = torch.tensor([meta["input_ids"]])
    V = cfg["vocab_size"]
    teacher = teacher_of(d, meta)
    with torch.no_grad():
        tf = m(ids, streams=True, index=True, teacher=teacher)
        free = m(ids, streams=True, index=True)
    # teacher-forced (every block on the reference's input stream, downstream of each index source
    # the reference's selection): the selection check the README asks for
    check_index("tiny-sparse teacher-forced", d, meta, cfg, tf["index"], strict=True)
    block_lines("tiny-sparse teacher-forced", tf["streams"], teacher["streams"])
    # free-running: one tie broken otherwise in an early layer would change everything after it
    # (README), so these are reported but only the teacher-forced ones are held to thresholds
    print("info  free-running tiny-sparse below (held to no threshold: selection ties may legitimately diverge)")
    check_index("tiny-sparse free-running", d, meta, cfg, free["index"], strict=False)
    rel, med, worst, arg = agreement(free["logits"][0], arr(d, meta["prefill_all_positions"]["file"]).view(-1, V))
    print(f"info  tiny-sparse free-running prefill, all positions: rel L2 {rel:.2e}  median max|d| {med:.2e}  "
          f"argmax {100 * arg:.1f}%")


def grad_check(gdir):
    """One backward pass of the training loss (LM + indexer losses + DSpark) on a random batch with
    random weights: every parameter must get a finite, non-zero gradient, except by design:
      * ffn.gate.bias (every MoE layer): the noaux_tc correction bias only steers the top-k selection,
        so no gradient can reach it; it is updated by the auxiliary-loss-free balancing rule outside
        autograd (requires_grad=False)."""
    cfg = dict(load_config(os.path.join(gdir, "tiny-dense")))
    by_design = lambda n: n.endswith("ffn.gate.bias")  # noqa: E731
    for mode, kw in (("float", dict(exact_numerics=False)),
                     ("qat", dict(exact_numerics=True, exact_order=False, fake_quant_weights=True))):
        m = V41(cfg, **kw).init_weights(seed=1)
        m.set_token_map(torch.arange(cfg["vocab_size"]) // 2)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, cfg["vocab_size"], (2, 96), generator=g)
        loss, parts = training_loss(m, ids)
        loss.backward()
        none, zero, bad = [], [], []
        for n, p in m.named_parameters():
            if by_design(n):
                continue
            if p.grad is None:
                none.append(n)
            elif not torch.isfinite(p.grad).all():
                bad.append(n)
            elif p.grad.abs().max() == 0:
                zero.append(n)
        skipped = sum(1 for n, _ in m.named_parameters() if by_design(n))
        total = sum(1 for _ in m.named_parameters())
        ok = not none and not zero and not bad and math.isfinite(loss.item())
        report(ok, f"gradients ({mode}): loss {loss.item():.3f} "
                   f"({', '.join(f'{k} {float(v):.3f}' for k, v in parts.items())}); "
                   f"{total - skipped} of {total} parameters with finite non-zero gradients; "
                   f"no gradient {none[:5]}, zero {zero[:5]}, non-finite {bad[:5]}; "
                   f"{skipped} gate biases excluded by design")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden-dir", default=os.path.join(here, "..", "..", "tests", "golden"))
    ap.add_argument("--skip-grad", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t = time.time()
    dense_checks(a.golden_dir)
    sparse_checks(a.golden_dir)
    if not a.skip_grad:
        grad_check(a.golden_dir)
    print(f"{len(FAILURES)} failed ({time.time() - t:.0f} s)")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
