#!/usr/bin/env bash
# One entry point for people and CI:
#   ./dev.sh demo    set everything up, then build the tiny BERT model, scan it, optimize it and benchmark
#                    it against stock onnxruntime on the CPU (outputs checked to agree for every shape)
#   ./dev.sh test    set everything up, then run the test suite
#   ./dev.sh lint    set everything up, then run ruff and mypy as pyproject.toml configures them
#   ./dev.sh setup   only set up: .venv (project-local virtual environment) and the ORT headers in .deps/
#   ./dev.sh ptx [VERSION] [pytest args]
#                    set everything up, then run the tests that assert what Triton compiles (-m ptx) under
#                    Triton VERSION (default: the lent GPU machines' Triton, which compiles the kernels there),
#                    installed on its own into .deps/triton-VERSION ahead of the .venv's own Triton
# Every command is idempotent: a second run reuses the environment (it reinstalls only when
# pyproject.toml changed).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv
OUT=${DIETCODE_OUT:-out}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
  fi
  local stamp="$VENV/.dietcode-setup" want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing dietcode-ort and its dependencies into $VENV (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch is pinned in the test extra so pip takes the local CPU build, never a CUDA one.
    "$VENV/bin/python" -m pip install -q -e '.[test]'
    echo "$want" > "$stamp"
  fi
  bash scripts/fetch_ort_headers.sh .deps/onnxruntime
}

demo() {
  mkdir -p "$OUT"
  echo "== building the tiny BERT model -> $OUT/bert-tiny.onnx" >&2
  "$VENV/bin/python" -m models bert --preset tiny -o "$OUT/bert-tiny.onnx"
  echo "== scanning it for workloads with symbolic dims" >&2
  "$VENV/bin/dietcode-ort" scan "$OUT/bert-tiny.onnx" --dim batch=1,4 --dim seq=16:128:16
  echo "== optimizing it for those shapes (no GPU here: analytic tuning, kernels compiled for sm_90)" >&2
  "$VENV/bin/dietcode-ort" optimize "$OUT/bert-tiny.onnx" -o "$OUT/bert-tiny.dietcode.onnx" \
    --dim batch=1,4 --dim seq=16:128:16 --target sm_90 --budget 128 --quiet
  "$VENV/bin/dietcode-ort" inspect "$OUT/bert-tiny.dietcode.onnx"
  echo "== running both models on the CPU EP over a sweep of shapes (outputs must agree), and timing them" >&2
  "$VENV/bin/dietcode-ort" bench "$OUT/bert-tiny.onnx" --optimized "$OUT/bert-tiny.dietcode.onnx" \
    --dim batch=1,4 --dim seq=8,16,64,100,128 --provider cpu --repeat 20 \
    --json "$OUT/bench-bert-tiny-cpu.json" --plot "$OUT/bench-bert-tiny-cpu.png"
}

run_tests() {
  "$VENV/bin/python" -m pytest -q "$@"
}

# The lent GPU machines' Triton (../shared/docs/DESIGN.md, "The lent GPU machines"; each device run's
# metadata.json records it): optimize compiles the kernels with it there, so what the compile tests claim of
# the PTX must hold under it as well as under the .venv's newer Triton.
DEVICE_TRITON=3.6.0

ptx_tests() {
  local version=$DEVICE_TRITON
  if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
    version=$1
    shift
  fi
  local dir=.deps/triton-$version
  if [ ! -f "$dir/.installed" ]; then
    echo "installing triton $version into $dir (its own folder; the .venv keeps its Triton)" >&2
    rm -rf "$dir"
    "$VENV/bin/python" -m pip install -q --no-deps --target "$dir" "triton==$version"
    touch "$dir/.installed"
  fi
  PYTHONPATH="$PWD/$dir${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest -q -m ptx "$@"
}

lint() {
  "$VENV/bin/ruff" check .
  "$VENV/bin/mypy" dietcode_ort tuner models
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; demo ;;
  test) setup; run_tests "$@" ;;
  lint) setup; lint ;;
  ptx) setup; ptx_tests "$@" ;;
  *) echo "usage: ./dev.sh demo | test [pytest args] | lint | setup | ptx [TRITON_VERSION] [pytest args]" >&2; exit 2 ;;
esac
