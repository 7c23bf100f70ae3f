#!/usr/bin/env bash
# Deployment smoke test: install dietcode-ort as a serving machine does and run an optimized model.
#
#   scripts/wheel_smoke.sh [MODEL.onnx OPTIMIZED.onnx]      (after ./dev.sh setup; CI runs it after the demo)
#
# 1. the model: MODEL and its optimized form OPTIMIZED as given, else tiny BERT built and optimized here by
#    the checkout's tuner (.venv);
# 2. the wheel: `pip wheel` of a clean copy of the tree (git's tracked and untracked, not ignored, files), in
#    pip's isolated build environment, with the ORT headers from .deps/ through DIETCODE_ORT_INCLUDE;
# 3. a new virtual environment with the wheel and the dependencies it declares (the runtime's: onnxruntime-gpu,
#    onnx, numpy, rich; the first three at .venv's versions, so pip's cache serves them), checked to hold none
#    of the tuner's (triton, scikit-learn, sympy, torch);
# 4. in it, with PATH holding nothing but that environment's bin/ (no compiler), CXX unset, HOME empty, a
#    custom-op library cache that cannot be created (so any build attempt fails) and the working folder outside
#    the checkout: scripts/wheel_smoke.py imports dietcode_ort (no tuner module may load), checks that the
#    packaged library is the one used, runs the model through dietcode_ort.InferenceSession and with the
#    library registered on the CPU EP against stock onnxruntime, and runs `dietcode-ort doctor`.
# Prints the wheel's tag and size and the seconds each step took; exits non-zero at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "wheel smoke: no .venv here: run ./dev.sh setup first" >&2
  exit 2
fi
if [ $# -ne 0 ] && [ $# -ne 2 ]; then
  echo "usage: scripts/wheel_smoke.sh [MODEL.onnx OPTIMIZED.onnx]" >&2
  exit 2
fi
work=$(mktemp -d -t dietcode-wheel-smoke.XXXXXX)
trap 'rm -rf "$work"' EXIT
t0=$SECONDS
step() { echo "wheel smoke: == $1 ($((SECONDS - t0)) s so far)" >&2; }

if [ $# -eq 2 ]; then
  model=$(realpath "$1")
  optimized=$(realpath "$2")
else
  step "building and optimizing tiny BERT with the checkout's tuner"
  model=$work/bert-tiny.onnx
  optimized=$work/bert-tiny.dietcode.onnx
  # this checkout's code (PYTHONPATH), whichever checkout .venv was installed from
  PYTHONPATH=$repo .venv/bin/python -m models bert --preset tiny -o "$model"
  PYTHONPATH=$repo .venv/bin/python -m dietcode_ort optimize "$model" -o "$optimized" --dim batch=1,4 \
    --dim seq=16:128:16 --target sm_90 --budget 32 --quiet
fi

step "building the wheel"
bash scripts/fetch_ort_headers.sh .deps/onnxruntime
mkdir -p "$work/src" "$work/dist"
git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - \
  | tar -xf - -C "$work/src"
start=$SECONDS
DIETCODE_ORT_INCLUDE=$repo/.deps/onnxruntime/include/onnxruntime \
  .venv/bin/python -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheels=("$work"/dist/dietcode_ort-*.whl)
wheel=${wheels[0]}
echo "wheel smoke: built $(basename "$wheel") ($(stat -c %s "$wheel") bytes) in $((SECONDS - start)) s" >&2
case $(basename "$wheel") in
  *-py3-none-manylinux_*) ;;
  *) echo "wheel smoke: FAIL  $(basename "$wheel") is not a py3-none-manylinux platform wheel" >&2; exit 1 ;;
esac
# the top-level names the wheel claims in site-packages: the package and its tuner, nothing else (no models/)
tops=$(.venv/bin/python -c 'import sys, zipfile
names = {n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()}
print(" ".join(sorted(n for n in names if not n.endswith((".dist-info", ".data")))))' "$wheel")
if [ "$tops" != "dietcode_ort tuner" ]; then
  echo "wheel smoke: FAIL  the wheel installs the top-level names '$tops' (expected: dietcode_ort tuner)" >&2
  exit 1
fi

step "installing it into a new virtual environment, as a serving machine does (no extra)"
start=$SECONDS
# the wheel pulls its own runtime dependencies; onnxruntime-gpu, onnx and numpy are pinned to .venv's versions
# (those the model was optimized with, and in pip's cache)
versions=$(.venv/bin/python -c 'import importlib.metadata as m
print(" ".join(f"{p}=={m.version(p)}" for p in ("onnxruntime-gpu", "onnx", "numpy")))')
"$PYTHON" -m venv "$work/venv"
# shellcheck disable=SC2086  # the pins are separate words
"$work/venv/bin/python" -m pip install -q "$wheel" $versions
echo "wheel smoke: installed the wheel with its dependencies ($versions) in $((SECONDS - start)) s" >&2
tuner_deps=$("$work/venv/bin/python" -c 'import importlib.util as u
print(" ".join(m for m in ("triton", "sklearn", "sympy", "torch") if u.find_spec(m)))')
if [ -n "$tuner_deps" ]; then
  echo "wheel smoke: FAIL  installing the wheel without the tune extra brought the tuner's $tuner_deps" >&2
  exit 1
fi
echo "wheel smoke: ok    no tuner dependency installed (triton, scikit-learn, sympy, torch)" >&2

step "running the deployment checks with no compiler on PATH"
mkdir -p "$work/home" "$work/run"
touch "$work/no-build"  # a file: DIETCODE_ORT_BUILD_DIR below it cannot be created, even by root
cp scripts/wheel_smoke.py "$work/run/"
rc=0
(cd "$work/run" && env -i HOME="$work/home" PATH="$work/venv/bin" LANG=C.UTF-8 \
   DIETCODE_ORT_BUILD_DIR="$work/no-build/library" \
   "$work/venv/bin/python" wheel_smoke.py --model "$model" --optimized "$optimized") || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "wheel smoke: FAIL  (the deployment checks above) after $((SECONDS - t0)) s" >&2
  exit "$rc"
fi
echo "wheel smoke: passed in $((SECONDS - t0)) s ($(basename "$wheel"), $(stat -c %s "$wheel") bytes)" >&2
