#!/usr/bin/env bash
# The main job on the built-in trained model (models/brown-tiny, docs/training.md: a small V4.1 with
# every layer role, trained on the Brown corpus): install, build, inspect it, generate text.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh dsv41  # the command alone, not the test suite
model=models/brown-tiny
build/dsv41 inspect "$model"
build/dsv41 generate -m "$model" -p "The jury said that" -n 48 --temp 0.7 --top-p 0.9 --seed 1
