#!/usr/bin/env bash
# The main job on the built-in tiny model: install, build, make a tiny checkpoint, inspect it, generate.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
model=build/models/tiny
[ -f "$model/model.safetensors.index.json" ] || build/dsv41 make-tiny --out "$model" --preset tiny --seed 0
build/dsv41 inspect "$model"
build/dsv41 generate -m "$model" -p "The engine reads the model" -n 32
