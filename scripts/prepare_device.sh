#!/usr/bin/env bash
# Make everything a GPU (device) session needs, on this machine, into git-ignored folders of the checkout,
# then print the exact `run` calls to make, in order (command, carry, timeout_s), sized to the session's device
# time (benchmarks/device_plan.py) and to the 64 MiB that one call may carry. docs/device.md says how a
# session uses them.
#
#   scripts/prepare_device.sh [--ort sm90|full] [--version V] [--session auto|bringup|followup|compare]
#                             [--device-minutes 15] [--kit DIR] [--cache DIR] [--limit-mib 64] [--check-only]
#
# --ort sm90 (the default): onnxruntime-gpu 1.31.1 with only its sm_90 cubins kept (the kit's --sm90-only):
#   one part, so the session's first call installs it; it runs on H100/H200 and nowhere else.
# --ort full: onnxruntime-gpu 1.30.0 whole, 3 parts (two stash calls before the install): the fallback when
#   the sm_90-only build fails its check on the device. --version picks another release of either.
# --session: what the session is for (device_plan.py); auto takes the first whose results are not committed.
#
# Makes, in the checkout this script sits in (or the one it is run from):
#   .ortgpu/p1..pN   onnxruntime-gpu in parts (the ortgpu kit, ../shared/tools/ortgpu, about 7 minutes of xz
#                    on 2 cores the first time; the parts are kept in --cache, default
#                    ~/.cache/dietcode-ort/device, and re-split here when the working tree leaves less room)
#   .device/deps     a real copy of the ONNX Runtime headers (a worktree's .deps is a symbolic link, which
#                    travels only as a link); device_run.sh points DIETCODE_ORT_INCLUDE at it
#   .device/source.json   the commit and state of the working tree the calls carry, and which onnxruntime-gpu
#   .device/plan.json, .device/plan.md   the calls, also printed
# Both folders are ignored (.gitignore, else .git/info/exclude). --check-only makes nothing and checks sizes.
set -euo pipefail

ort=sm90 version="" session=auto minutes=15 kit="" cache=${XDG_CACHE_HOME:-$HOME/.cache}/dietcode-ort/device
limit_mib=64 check_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --ort) ort=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --session) session=$2; shift 2 ;;
    --device-minutes) minutes=$2; shift 2 ;;
    --kit) kit=$2; shift 2 ;;
    --cache) cache=$2; shift 2 ;;
    --limit-mib) limit_mib=$2; shift 2 ;;
    --check-only) check_only=1; shift ;;
    -h|--help) sed -n 2,27p "$0"; exit 0 ;;
    *) echo "prepare_device: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case $ort in
  sm90) version=${version:-1.31.1} sm90=true kit_args=(--sm90-only) stock_name=ortgpu-${version:-1.31.1}-sm90 ;;
  full) version=${version:-1.30.0} sm90=false kit_args=() stock_name=ortgpu-${version:-1.30.0} ;;
  *) echo "prepare_device: --ort takes sm90 or full (got '$ort')" >&2; exit 2 ;;
esac

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel 2>/dev/null) || {
  echo "prepare_device: not inside a git checkout" >&2; exit 2; }
cd "$root"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

# --- 1. the folders are ignored, so they travel only when carried ---
for d in .ortgpu .device; do
  if ! git check-ignore -q "$d/x"; then
    echo "/$d/" >> "$(git rev-parse --git-path info/exclude)"
    echo "prepare_device: added /$d/ to .git/info/exclude"
  fi
done

# --- 2. what every call carries anyway: the working tree (tracked + untracked files git does not ignore) ---
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -L -c %s 2>/dev/null \
             | awk '{ s += $1 } END { print s + 0 }')
if [ -d shared ]; then tree_bytes=$((tree_bytes + $(du -sbL shared | cut -f1))); fi
echo "prepare_device: the working tree carries $(mib "$tree_bytes") MiB in every call"

# --- 3. .device: headers, source state ---
hdr=onnxruntime/include/onnxruntime/onnxruntime_cxx_api.h
if [ "$check_only" = 0 ]; then
  mkdir -p .device
  if [ ! -f ".device/deps/$hdr" ]; then
    src=""
    for c in .deps "${DIETCODE_ORT_INCLUDE:+$DIETCODE_ORT_INCLUDE/../../..}"; do
      if [ -n "$c" ] && [ -f "$c/$hdr" ]; then src=$c; break; fi
    done
    [ -n "$src" ] || { echo "prepare_device: no ONNX Runtime headers in .deps: run ./dev.sh test or" \
                            "scripts/fetch_ort_headers.sh .deps/onnxruntime first" >&2; exit 1; }
    rm -rf .device/deps; mkdir -p .device/deps
    cp -rL "$src/onnxruntime" .device/deps/
  fi
  dirty=$(git status --porcelain --untracked-files=no | wc -l)
  cat > .device/source.json <<EOF
{"commit": "$(git rev-parse HEAD)", "branch": "$(git rev-parse --abbrev-ref HEAD)", "modified_files": $dirty,
 "prepared": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "onnxruntime_gpu": "$version", "sm90_only": $sm90}
EOF
fi
[ -f ".device/deps/$hdr" ] || { echo "prepare_device: .device/deps is missing (run without --check-only)" >&2; exit 1; }
device_bytes=$(du -sbL .device | cut -f1)

# --- 4. onnxruntime-gpu parts: as large as the room left in a call allows ---
# (in KiB, a quarter MiB kept back: du and the tool may count a few folders' blocks more than stat does)
room_kib=$(( (limit_mib * 1048576 - tree_bytes - device_bytes) / 1024 - 256 ))
part_kib=$(( room_kib < 61440 ? room_kib : 61440 ))
[ "$part_kib" -ge 1024 ] || { echo "prepare_device: the working tree leaves no room for a part in a call" >&2; exit 1; }
stock=$cache/$stock_name
if [ "$check_only" = 0 ] && [ ! -f "$stock/p1/MANIFEST" ]; then
  if [ -z "$kit" ]; then
    for c in "$root/../shared/tools/ortgpu" /work/shared/tools/ortgpu; do
      if [ -x "$c/prepare_ort_gpu_parts.sh" ]; then kit=$c; break; fi
    done
  fi
  [ -n "$kit" ] && [ -x "$kit/prepare_ort_gpu_parts.sh" ] || {
    echo "prepare_device: the ortgpu kit (prepare_ort_gpu_parts.sh) is not found: pass --kit DIR" >&2; exit 1; }
  echo "prepare_device: making onnxruntime-gpu $version parts with $kit (downloads the wheel; minutes of xz)"
  mkdir -p "$cache"
  bash "$kit/prepare_ort_gpu_parts.sh" "$stock" --version "$version" --part-mib 60 "${kit_args[@]}"
fi
parts_ok() {  # the parts in .ortgpu are whole, of this version and no larger than part_kib
  [ -f .ortgpu/p1/MANIFEST ] || return 1
  [ "$(. .ortgpu/p1/MANIFEST; echo "$TOTAL_SHA256")" = "$(. "$stock/p1/MANIFEST"; echo "$TOTAL_SHA256")" ] || return 1
  local k n want
  n=$(. .ortgpu/p1/MANIFEST; echo "$NPARTS")
  for k in $(seq 1 "$n"); do
    [ -f ".ortgpu/p$k/part" ] && [ -f ".ortgpu/p$k/ondevice.sh" ] || return 1
    [ "$(stat -c %s ".ortgpu/p$k/part")" -le $((part_kib * 1024)) ] || return 1
    want=$(. ".ortgpu/p$k/MANIFEST"; echo "$PART_SHA256")
    [ "$(sha256sum ".ortgpu/p$k/part" | cut -d' ' -f1)" = "$want" ] || return 1
  done
  [ ! -d ".ortgpu/p$((n + 1))" ]
}
if [ "$check_only" = 0 ] && ! parts_ok; then
  echo "prepare_device: splitting the onnxruntime-gpu stream into parts of at most $(mib $((part_kib * 1024))) MiB in .ortgpu/"
  # shellcheck disable=SC1091
  . "$stock/p1/MANIFEST"
  stream=$(mktemp "${TMPDIR:-/tmp}/ortgpu_stream.XXXXXX")
  trap 'rm -f "$stream" "$stream".part*' EXIT
  for k in $(seq 1 "$NPARTS"); do cat "$stock/p$k/part"; done > "$stream"
  [ "$(sha256sum "$stream" | cut -d' ' -f1)" = "$TOTAL_SHA256" ] || {
    echo "prepare_device: the parts in $stock are damaged (sha256 of the stream): delete them and re-run" >&2; exit 1; }
  rm -rf .ortgpu; mkdir -p .ortgpu
  split -b "${part_kib}K" -d -a 2 "$stream" "$stream.part"
  n=$(ls "$stream".part* | wc -l) k=0
  for f in $(ls "$stream".part* | sort); do
    k=$((k + 1)); mkdir -p ".ortgpu/p$k"
    mv "$f" ".ortgpu/p$k/part"
    cp "$stock/p1/ondevice.sh" ".ortgpu/p$k/ondevice.sh"
    cat > ".ortgpu/p$k/MANIFEST" <<EOF
WHEEL=$WHEEL
WHEEL_SHA256=$WHEEL_SHA256
CODEC=$CODEC
NPARTS=$n
TOTAL_SHA256=$TOTAL_SHA256
INDEX=$k
PART_SHA256=$(sha256sum ".ortgpu/p$k/part" | cut -d' ' -f1)
EOF
  done
fi
[ -f .ortgpu/p1/MANIFEST ] || { echo "prepare_device: no parts in .ortgpu (run without --check-only)" >&2; exit 1; }
nparts=$(. .ortgpu/p1/MANIFEST; echo "$NPARTS")

# --- 5. the calls, sized to the session's device time (benchmarks/device_plan.py) ---
python3 benchmarks/device_plan.py --parts "$nparts" --session "$session" --device-minutes "$minutes" \
  --tree-bytes "$tree_bytes" --limit-mib "$limit_mib" --root . --out .device
