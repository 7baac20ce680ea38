#!/usr/bin/env bash
# Configures and builds dsv41 in Release into build/ (warnings are errors when DSV41_WERROR=ON or CI=true):
# every target, or only the targets named (scripts/build.sh dsv41 builds the command alone).
set -euo pipefail
cd "$(dirname "$0")/.."
werror=${DSV41_WERROR:-OFF}
[ "${CI:-}" = "true" ] && werror=ON
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV41_WERROR="$werror" >/dev/null
targets=()
for target in "$@"; do targets+=(--target "$target"); done
cmake --build build -j "$(nproc)" "${targets[@]}"
