#!/usr/bin/env bash
# The device check (docs/gpu.md): one command on the GPU machine, at most 8 minutes, results as JSON in OUT.
#
#   bash scripts/gpu_check.sh [OUT] [--quick] [--device cuda|cpu|auto] [--dataset D] [--python PY] [--no-install]
#
# OUT defaults to ./gpu-check-out. First installs .whl/ (scripts/gpu_wheels.sh made it; TORCHPS_WHEELS names another
# folder) into a fresh target folder put first on PYTHONPATH, so every process the checks start (ps-server,
# ps-worker, the benchmarks) imports the same torchps with the same interpreter; --no-install uses what PY
# imports already (this machine's .venv). Then scripts/gpu_check.py runs the checks from inside OUT (never the
# repository root, whose torchps/ folder would hide the installed package). Exit code: 0 if every check that
# ran passed.
set -uo pipefail
started=$(date +%s)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=./gpu-check-out
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then OUT=$1; shift; fi
PY=python3
INSTALL=1
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PY=$2; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
say() { echo "[gpu-check $(date +%H:%M:%S)] $*"; }
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # the checks run from OUT
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/commit.txt"  # written below only when this run installs the wheels (gpu_check.py reads it)
WHEELS=${TORCHPS_WHEELS:-$ROOT/.whl}
if [ "$INSTALL" = 1 ]; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        say "no wheels in $WHEELS: run scripts/gpu_wheels.sh where the package registry is reachable (or --no-install)"
        exit 1
    fi
    SITE=${TORCHPS_SITE:-/tmp/torchps-site}
    rm -rf "$SITE"
    say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
    if "$PY" -m pip --version > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl \
            > "$OUT/install.log" 2>&1
    else  # no pip in that interpreter: a wheel is a zip of what goes into site-packages
        say "no pip for $PY: unpacking the wheels instead"
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$SITE" "$WHEELS"/*.whl > "$OUT/install.log" 2>&1
    fi
    if [ $? != 0 ]; then cat "$OUT/install.log"; say "FAILED: the wheels did not install"; exit 1; fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    [ -f "$WHEELS/COMMIT" ] && cp "$WHEELS/COMMIT" "$OUT/commit.txt"
fi
cd "$OUT" || exit 1
if ! "$PY" -c "import torch, torchps.client, torchps.worker.launch" > "$OUT/import.log" 2>&1; then
    cat "$OUT/import.log"; say "FAILED: $PY cannot import torchps (PYTHONPATH=${PYTHONPATH:-})"; exit 1
fi
"$PY" -c "import grpc, google.protobuf as pb, torchps; print('grpc', grpc.__version__, grpc.__file__); \
print('protobuf', pb.__version__, pb.__file__); print('torchps', torchps.__file__)" | tee "$OUT/imports.txt"
command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
left=$((470 - ($(date +%s) - started)))
say "running the checks with $PY ($left s left of 8 minutes)"
timeout -k 5 "$left" "$PY" "$ROOT/scripts/gpu_check.py" "$OUT" --budget $((left - 15)) ${ARGS[@]+"${ARGS[@]}"}
code=$?
[ $code = 124 ] && say "FAILED: the checks ran past 8 minutes"
exit $code
