#!/usr/bin/env bash
# Run the GPU stages of a device session in order, each under its own time limit, writing as it goes.
#
#   bash benchmarks/device_run.sh [--stage 1,2,3,4,5,6,7|all] [--ortgpu .ortgpu/pK] [--sets dense,attention,conv]
#                                 [--suites mlp,bert,resnet50] [--profile bert,mlp] [--budget N] [--deadline S]
#                                 [--limit S] [--cap STAGE=S,...] [--out DIR] [--work DIR] [--dry-run]
#
# Stages (docs/device.md gives the calls that make a session, with their time budgets):
#   (--ortgpu DIR) one part of onnxruntime-gpu (made by scripts/prepare_device.sh): parts 1..N-1 are stashed
#       in /tmp, the last one reassembles and installs the wheel (pip --target /tmp/ortgpu); every later call
#       on the same (warm) machine finds it there and sets PYTHONPATH / LD_LIBRARY_PATH for it.
#   1  onnxruntime-gpu's own check (MatMul, Conv, Relu on the CUDA EP), `dietcode_ort doctor`, and
#      `pytest -m gpu -rs` over the test files that hold GPU tests.
#   2  the measurement table (benchmarks/record_table.py, fp16, sm_90 space): --sets, sampled to fit the
#      stage's time (record_table --budget-s), then benchmarks/report_table.py on it.
#   3  benchmarks/run_suite.py per suite: fp16 model, `optimize --measure gpu --budget N`, `bench --provider
#      cuda` against stock ORT's CUDA EP; each suite gets an equal share of the time left.
#   4  the tuning database (a consistent copy) and each optimized model's bundles + `inspect --json`.
#   5  the custom op's per-call host overhead against stock ORT's per-node overhead
#      (benchmarks/host_overhead.py --provider cuda: a chain of tiny MatMuls, stock vs optimized, I/O binding;
#      and the decision path in C). Runs before stage 4, which keeps the tuning database last.
#   6  benchmarks/torch_compile.py per suite (default bert,resnet50): PyTorch eager, torch.compile dynamic=True,
#      mark_dynamic and max-autotune (2 shapes) on a subset of the suite's sweep, then torch_report.py against
#      stage 3's bench file where there is one. Runs before stage 4 when both are asked.
#   7  benchmarks/profile_kernels.py per suite of --profile (default bert,mlp): stock ORT and the optimized model
#      under torch.profiler (CUPTI: every CUDA kernel of the process) at a few shapes, where the bench loses and
#      one where it wins; per kernel and category, device busy time against wall time; and each shape's first
#      call (after a warm-up shape, as bench) against its steady runs. The models are stage 3's
#      (built and optimized when missing, with the tuning database committed for this device as a start). Runs
#      after stage 3, before stages 5, 6 and 4.
#
# Time: the whole call ends by --deadline seconds (default 570, for a `run` with timeout_s 600); each stage
# gets what is left (capped by --limit, and by its own --cap, e.g. `--cap 1=140` so stage 1 leaves the rest
# of the call to stage 3) minus a reserve for stage 4 and the final packing; every step runs under `timeout`.
# A step cut off is recorded as timed out and the run goes on. benchmarks/device_plan.py sizes the calls of
# a session to its device time (scripts/prepare_device.sh prints them).
#
# Output, progressively: everything lands in WORK/tree/benchmarks/results/<device>/ (results of run_suite
# in their usual place, the rest under device-run/), and after every step the tree is packed into
# OUT/device-run.tar.gz (re-written atomically; split into OUT/device-run.tar.gz.partNN when over 15 MiB),
# with OUT/metadata.json and OUT/progress.log beside it. WORK (default /tmp/dietcode-device-run) lives on
# across the calls of one warm machine, so each archive holds every earlier call's results too. Unpack
# an archive at the repository root: `tar xzf device-run.tar.gz` puts them under benchmarks/results/.
#
# --dry-run rehearses the same stages on a machine without a GPU: CPU provider, analytic measurer, tiny
# models and table sizes, WORK and the onnxruntime-gpu stash/target under --work (default OUT.work).
# PYTHON (default python3) is the interpreter; the repository root goes first on PYTHONPATH.
set -uo pipefail  # not -e: a failing step is data; the run goes on

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
ARGV=("$0" "$@")

dry=0 stages="" ortgpu="" sets="" suites="" profile="" budget=${DEVICE_BUDGET:-64} deadline=570 limit="" out=${OUT:-} work=""
declare -A cap=()
while [ $# -gt 0 ]; do
  case $1 in
    --stage|--stages) stages=$2; shift 2 ;;
    --ortgpu) ortgpu=$2; shift 2 ;;
    --sets) sets=$2; shift 2 ;;
    --suites) suites=$2; shift 2 ;;
    --profile) profile=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --deadline) deadline=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --cap|--caps)
      for kv in ${2//,/ }; do
        case $kv in
          [0-7]=[0-9]*) case ${kv#*=} in *[!0-9]*) ;; *) cap[${kv%%=*}]=${kv#*=}; continue ;; esac ;;
        esac
        echo "device_run: --cap takes STAGE=SECONDS[,STAGE=SECONDS] with a stage 0-7 (got '$kv')" >&2; exit 2
      done
      shift 2 ;;
    --out) out=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n 2,46p "$0"; exit 0 ;;
    *) echo "device_run: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "device_run: no output folder: set OUT or pass --out DIR" >&2; exit 2; }
case $stages in all) stages=1,2,3,4,5,6,7 ;; esac
for s in ${stages//,/ }; do
  case $s in 1|2|3|4|5|6|7) ;; *) echo "device_run: unknown stage '$s' (1 to 7 or all)" >&2; exit 2 ;; esac
done
[ -n "$stages" ] || [ -n "$ortgpu" ] || { echo "device_run: nothing to do: give --stage and/or --ortgpu" >&2; exit 2; }
for n in "$budget" "$deadline" ${limit:+"$limit"}; do
  case $n in ''|*[!0-9]*) echo "device_run: --budget, --deadline and --limit take whole numbers (got '$n')" >&2
                          exit 2 ;; esac
done
if [ -n "$ortgpu" ] && [ ! -f "$ortgpu/MANIFEST" ]; then
  echo "device_run: --ortgpu $ortgpu holds no MANIFEST (carry the part folder scripts/prepare_device.sh made)" >&2
  exit 2
fi

mkdir -p "$out"; out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}
if [ "$dry" = 1 ]; then
  work=${work:-$out.work}
  export ORTGPU_STASH=${ORTGPU_STASH:-$work/ortgpu_parts} ORTGPU_TARGET=${ORTGPU_TARGET:-$work/ortgpu}
  provider=cpu
else
  work=${work:-${DEVICE_RUN_WORK:-/tmp/dietcode-device-run}}
  provider=cuda
fi
export ORTGPU_PYTHON=$PY ORTGPU_TARGET=${ORTGPU_TARGET:-/tmp/ortgpu}
mkdir -p "$work"; work=$(cd "$work" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DIETCODE_CACHE=$work/kernels
hdr=onnxruntime/include/onnxruntime/onnxruntime_cxx_api.h
if [ ! -f ".deps/$hdr" ] && [ -f ".device/deps/$hdr" ]; then
  export DIETCODE_ORT_INCLUDE=$ROOT/.device/deps/${hdr%/*}  # a worktree's .deps is a link that does not travel
fi

start=$SECONDS failed=0
call=$(( $( (cat "$work/calls.jsonl" 2>/dev/null || true) | wc -l) + 1 ))
log() { echo "[device_run call $call +$((SECONDS - start))s] $*" | tee -a "$work/progress.log"; }
left() { echo $((deadline - (SECONDS - start))); }

slug=$("$PY" benchmarks/device_info.py slug --provider "$provider" 2>>"$work/progress.log") || slug=unknown-device
results=$work/tree/benchmarks/results
D=$results/$slug/device-run
mkdir -p "$D"

json_line() {  # json_line FILE KEY=VALUE... (values that parse as JSON stay JSON, the rest are strings)
  local file=$1; shift
  "$PY" - "$@" >> "$file" <<'EOF'
import json, sys
rec = {}
for kv in sys.argv[1:]:
    key, value = kv.split("=", 1)
    try:
        rec[key] = json.loads(value)
    except ValueError:
        rec[key] = value
print(json.dumps(rec))
EOF
}

pack() {  # the tree -> OUT/device-run.tar.gz (atomically), metadata.json and progress.log beside it
  "$PY" benchmarks/device_info.py metadata --work "$work" --json "$D/metadata.json" 2>>"$work/progress.log"
  cp "$work/progress.log" "$D/progress.log"
  tar -C "$work/tree" -czf "$out/device-run.tar.gz.tmp" benchmarks && mv "$out/device-run.tar.gz.tmp" "$out/device-run.tar.gz"
  rm -f "$out"/device-run.tar.gz.part*
  local size; size=$(stat -c %s "$out/device-run.tar.gz")
  if [ "$size" -gt $((15 * 1024 * 1024)) ]; then  # 16 MiB per file comes back: split
    split -b 15M -d -a 2 "$out/device-run.tar.gz" "$out/device-run.tar.gz.part" && rm -f "$out/device-run.tar.gz"
    [ "$size" -le $((60 * 1024 * 1024)) ] || log "WARNING: the archive is $size bytes: over the 64 MiB that comes back"
  fi
  cp "$D/metadata.json" "$out/metadata.json"; cp "$work/progress.log" "$out/progress.log"
}

clocks() {  # one line of clocks, power and temperature per stage boundary
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,name,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu,pstate \
      --format=csv,noheader >> "$D/clocks.csv" 2>&1
  fi
}

# step STAGE NAME LIMIT LOG -- CMD...: run CMD under `timeout LIMIT`, output to LOG, a record in steps.jsonl
step() {
  local stage=$1 name=$2 lim=$3 logf=$4; shift 5
  local t0=$SECONDS rc timed_out=false
  mkdir -p "$(dirname "$logf")"
  if [ "$lim" -lt 5 ]; then
    log "stage $stage: $name: SKIPPED (${lim}s left for it)"
    json_line "$work/steps.jsonl" call="$call" stage="$stage" step="$name" rc=null seconds=0 limit="$lim" \
      timed_out=false skipped=true command="$(printf '%q ' "$@")"
    return 0
  fi
  log "stage $stage: $name (limit ${lim}s): $(printf '%q ' "$@")"
  # a .json log stays JSON: no command line in it, and stderr (ORT's own log lines) goes to LOG.stderr
  case $logf in
    *.json) timeout --kill-after=10 "$lim" "$@" >> "$logf" 2>>"$logf.stderr" ;;
    *) echo "+ $(printf '%q ' "$@")" >> "$logf"; timeout --kill-after=10 "$lim" "$@" >> "$logf" 2>&1 ;;
  esac
  rc=$?
  case $rc in 124|137) timed_out=true ;; esac
  log "stage $stage: $name: exit $rc in $((SECONDS - t0))s$([ $timed_out = true ] && echo ' (TIMED OUT)')"
  if [ "$rc" != 0 ]; then tail -n 12 "$logf" | sed 's/^/    | /'; fi
  json_line "$work/steps.jsonl" call="$call" stage="$stage" step="$name" rc="$rc" seconds=$((SECONDS - t0)) \
    limit="$lim" timed_out=$timed_out log="${logf#"$work"/tree/}" command="$(printf '%q ' "$@")"
  [ "$rc" = 0 ] || failed=$((failed + 1))
  pack
  return "$rc"
}

has_stage() { case ",$stages," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

stage_limit() {  # stage_limit STAGE MAX: what the stage may use of the time left (MAX, or the stage's --cap)
  local reserve=20 lim max=${cap[$1]:-$2}
  if [ "$1" != 4 ] && has_stage 4; then reserve=60; fi
  lim=$(( $(left) - reserve ))
  [ "$lim" -lt "$max" ] || lim=$max
  if [ -n "$limit" ] && [ "$lim" -gt "$limit" ]; then lim=$limit; fi
  [ "$lim" -gt 0 ] || lim=0
  echo "$lim"
}

# skipped_without_ort STAGE STEP: for the stages that need onnxruntime-gpu's CUDA EP (3, 5, 7), record and say why
# they cannot run on this machine and return 0; return 1 when they can
skipped_without_ort() {
  local reason text
  if [ "$ort_gpu" = 1 ] && [ -f "$work/ortgpu-check-failed" ]; then
    reason="onnxruntime-gpu failed its check"
    text="onnxruntime-gpu failed its check on this machine ($(cut -d' ' -f2 "$work/ortgpu-check-failed"))"
  elif [ "$dry" = 0 ] && [ "$ort_gpu" = 0 ]; then
    reason="onnxruntime-gpu not installed"
    text="onnxruntime-gpu is not installed on this machine (it started fresh?): the parts calls come first"
  else
    return 1
  fi
  log "stage $1: SKIPPED: $text"
  json_line "$work/steps.jsonl" call="$call" stage="$1" step="$2" rc=null seconds=0 limit="$lim" \
    timed_out=false skipped=true reason="$reason"
}

json_line "$work/calls.jsonl" call="$call" command="$(printf '%q ' "${ARGV[@]}")" dry_run="$dry" \
  stages="$stages" ortgpu="$ortgpu" deadline="$deadline" provider="$provider" device_slug="$slug" \
  date="$(date -u +%Y-%m-%dT%H:%M:%SZ)" root="$ROOT"
log "start: stages '${stages:-none}', ortgpu '${ortgpu:-none}', dry run $dry, deadline ${deadline}s, work $work"
"$PY" benchmarks/device_info.py preflight --json "$D/preflight-call$call.json" 2>&1 | tee -a "$work/progress.log"
clocks

# --- onnxruntime-gpu: stash a part, or install from the last one; then its environment for this call ---
if [ -n "$ortgpu" ]; then
  index=$(. "$ortgpu/MANIFEST"; echo "$INDEX") nparts=$(. "$ortgpu/MANIFEST"; echo "$NPARTS")
  if [ "$index" -lt "$nparts" ]; then
    step 0 "ortgpu stash part $index of $nparts" "$(stage_limit 0 120)" "$D/stage0/ortgpu.log" -- \
      bash "$ortgpu/ondevice.sh" stash "$ortgpu"
    rc0=$?
  else
    step 0 "ortgpu install (part $index of $nparts)" "$(stage_limit 0 240)" "$D/stage0/ortgpu.log" -- \
      bash "$ortgpu/ondevice.sh" install "$ortgpu"
    rc0=$?
    [ "$rc0" != 0 ] || cp "$ortgpu/ondevice.sh" "$work/ondevice.sh"
  fi
  [ "$rc0" != 3 ] || log "ortgpu: an earlier part is gone (this machine started fresh): start again at part 1"
fi
ort_gpu=0
if [ -f "$ORTGPU_TARGET/.installed" ] && [ -f "$work/ondevice.sh" ]; then
  # shellcheck disable=SC1091
  source "$work/ondevice.sh" env >> "$work/progress.log" 2>&1
  ort_gpu=1
  log "onnxruntime-gpu from $ORTGPU_TARGET: $("$PY" -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())' 2>&1 | tail -n 1)"
fi
"$PY" benchmarks/device_info.py environment --json "$work/environment-$call.json" 2>>"$work/progress.log"
pack

# --- stage 1: onnxruntime-gpu check, doctor, GPU tests ---
if has_stage 1; then
  lim=$(stage_limit 1 480); t1=$SECONDS
  s1=$D/stage1
  mkdir -p "$s1"
  if command -v nvidia-smi >/dev/null; then nvidia-smi > "$s1/nvidia-smi.txt" 2>&1; else echo "nvidia-smi not found" > "$s1/nvidia-smi.txt"; fi
  if [ "$ort_gpu" = 1 ]; then
    if [ "$dry" = 1 ] && [ "${DEVICE_RUN_CHECK:-0}" != 1 ]; then
      log "stage 1: ortgpu check: skipped in a dry run (it needs the GPU; DEVICE_RUN_CHECK=1 runs it anyway)"
    else
      if ! step 1 "ortgpu check" "$(( lim < 90 ? lim : 90 ))" "$s1/ortgpu-check.log" -- bash "$work/ondevice.sh" check
      then
        # the CUDA EP does not work: stages 3 and 5 would only fail, so the call's time goes to the others
        echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) ${s1#"$work"/tree/}/ortgpu-check.log" > "$work/ortgpu-check-failed"
        log "ortgpu: onnxruntime-gpu failed its check: stages 3 and 5 are skipped on this machine$(
          grep -q '"sm90_only": true' .device/source.json 2>/dev/null &&
          echo "; this is the sm_90-only build: make the full parts next (scripts/prepare_device.sh --ort full)")"
      fi
    fi
  else
    log "stage 1: onnxruntime-gpu is not installed on this machine: doctor and tests use $("$PY" -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())' 2>&1 | tail -n 1)"
  fi
  step 1 "doctor" "$(( lim - (SECONDS - t1) < 180 ? lim - (SECONDS - t1) : 180 ))" "$s1/doctor.txt" -- \
    "$PY" -m dietcode_ort doctor
  step 1 "doctor --json" "$(( lim - (SECONDS - t1) < 60 ? lim - (SECONDS - t1) : 60 ))" "$s1/doctor.json" -- \
    "$PY" -m dietcode_ort doctor --json --no-build
  # the kernel-level GPU tests first (quick), then the end-to-end ones (they tune): one cut off keeps the other
  mapfile -t gpu_tests < <(grep -l "mark.gpu" tests/test_*.py | grep -v end_to_end)
  mapfile -t e2e_tests < <(grep -l "mark.gpu" tests/test_*end_to_end*.py)
  # in parallel where pytest-xdist is there: one by one, the kernel tests' Triton compiles took more than 94 s
  # for the first 35 of 194 on the first H100 machine (2026-11-27); --durations says where the time goes
  par=()
  if "$PY" -c "import xdist" 2>/dev/null; then par=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))"); fi
  step 1 "pytest -m gpu (kernels)" "$(( (lim - (SECONDS - t1)) * 2 / 3 ))" "$s1/pytest-gpu.log" -- \
    "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider "${par[@]}" --durations 25 --junitxml "$s1/pytest-gpu.xml" \
    "${gpu_tests[@]}"
  step 1 "pytest -m gpu (end to end)" "$(( lim - (SECONDS - t1) ))" "$s1/pytest-gpu-e2e.log" -- \
    "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider "${par[@]}" --durations 10 --junitxml "$s1/pytest-gpu-e2e.xml" \
    "${e2e_tests[@]}"
  clocks; pack
fi

# --- stage 2: the measurement table (sampled to fit), then the report on it ---
if has_stage 2; then
  lim=$(stage_limit 2 540); t2=$SECONDS
  s2=$D/stage2
  mkdir -p "$s2"
  sets=${sets:-dense,attention,conv}
  if [ "$dry" = 1 ]; then
    table_args=(--measure analytic --t-max 4 --conv-preset tiny --max-configs 3 --repeats 1)
    report_budget=16
  else
    table_args=(--repeats 10)
    report_budget=64
  fi
  # record_table stops measuring by itself (--budget-s, 80% of the stage less its start-up); the step's
  # limit (90%) is the hard stop behind it; the report gets the rest
  step 2 "record_table $sets" "$(( lim * 9 / 10 ))" "$s2/record.log" -- \
    "$PY" benchmarks/record_table.py --out "$s2" --sets "$sets" --budget-s $(( lim * 8 / 10 > 20 ? lim * 8 / 10 - 10 : 10 )) \
    --order mixed "${table_args[@]}"
  if [ -f "$s2/table.csv" ]; then
    plot=(); "$PY" -c "import matplotlib" 2>/dev/null && plot=(--plot "$s2/speed.png")
    step 2 "report_table" "$(( lim - (SECONDS - t2) ))" "$s2/report.txt" -- \
      "$PY" benchmarks/report_table.py "$s2/table.csv" --budget "$report_budget" --json "$s2/report.json" "${plot[@]}"
  fi
  clocks; pack
fi

# --- stage 3: the end-to-end suites, fp16, tuned on the GPU, against stock ORT's CUDA EP ---
if has_stage 3; then
  lim=$(stage_limit 3 540); t3=$SECONDS
  s3=$D/stage3
  mkdir -p "$s3"
  suites=${suites:-mlp,bert,resnet50}
  read -r -a names <<< "${suites//,/ }"
  if [ "$dry" = 1 ]; then
    suite_args=(--provider cpu --preset tiny --dtype float16 --repeat 2 --warmup 1
                --optimize-arg=--measure=analytic --optimize-arg=--budget=8 --optimize-arg=--max-kernels=2)
  else
    suite_args=(--provider cuda --dtype float16 --optimize-arg=--measure=gpu --optimize-arg=--budget="$budget")
  fi
  if ! skipped_without_ort 3 "suites $suites"; then
    for i in "${!names[@]}"; do
      share=$(( (lim - (SECONDS - t3)) / (${#names[@]} - i) ))
      step 3 "suite ${names[$i]}" "$share" "$s3/${names[$i]}.log" -- \
        "$PY" benchmarks/run_suite.py --suite "${names[$i]}" "${suite_args[@]}" --workdir "$work/models" \
        --results "$results" --optimize-arg=--db="$work/tuning.db" --optimize-arg=--quiet
    done
  fi
  clocks; pack
fi

# --- stage 7: where the time goes: per-kernel profiles of stock ORT and the optimized model at a few shapes ---
if has_stage 7; then
  lim=$(stage_limit 7 240); t7=$SECONDS
  s7=$D/stage7
  mkdir -p "$s7"
  plist=${profile:-bert,mlp}
  read -r -a pnames <<< "${plist//,/ }"
  if [ "$dry" = 1 ]; then
    profile_args=(--provider cpu --preset tiny --dtype float16 --iters 5 --warmup 2
                  --optimize-arg=--measure=analytic --optimize-arg=--budget=8 --optimize-arg=--max-kernels=2)
  else
    # a model missing here (stage 3 did not build it on this machine) is tuned as the bring-up session tuned the
    # committed bench's (budget 16), from the tuning database committed for this device where there is none yet:
    # the search then measures only what it lacks (nothing on the same GPU, driver and Triton: its records are
    # keyed by them), so the profile is of the models that bench timed
    profile_args=(--provider cuda --dtype float16 --iters 30 --warmup 10
                  --optimize-arg=--measure=gpu --optimize-arg=--budget=16)
    committed=benchmarks/results/$slug/device-run/stage4/tuning.db  # committed gzipped (docs/device.md)
    if [ ! -f "$work/tuning.db" ] && [ -f "$committed.gz" ]; then
      gzip -dc "$committed.gz" > "$work/tuning.db" && log "stage 7: tuning database from $committed.gz"
    elif [ ! -f "$work/tuning.db" ] && [ -f "$committed" ]; then
      cp "$committed" "$work/tuning.db" && log "stage 7: tuning database from $committed"
    fi
  fi
  if ! skipped_without_ort 7 "profile ${pnames[*]}"; then
    for i in "${!pnames[@]}"; do
      name=${pnames[$i]} share=$(( (lim - (SECONDS - t7)) / (${#pnames[@]} - i) ))
      if [ "$dry" = 1 ]; then  # shapes of stage 3's dry-run (cpu) sweep
        case $name in bert) shapes=(--shape batch=4,seq=32 --shape batch=1,seq=16) ;;
                      resnet50|mobilenet_v2) shapes=(--shape batch=1,height=160 --tie width=height) ;;
                      *) shapes=(--dim tokens=7,64) ;; esac
      else  # where the H100 bench lost (BERT batch >= 16 x seq >= 256; the MLP at tokens <= 256), where it won,
            # and where its first call of a new shape was slowest (BERT 4 x 256: 5.3x its steady state; MLP 1000)
        case $name in bert) shapes=(--shape batch=32,seq=256 --shape batch=16,seq=512 --shape batch=1,seq=128
                                    --shape batch=4,seq=256) ;;
                      resnet50|mobilenet_v2) shapes=(--shape batch=32,height=224 --shape batch=1,height=224
                                                     --tie width=height) ;;
                      *) shapes=(--dim tokens=1,128,1000,4096) ;; esac
      fi
      step 7 "profile $name" "$share" "$s7/$name.log" -- \
        "$PY" benchmarks/profile_kernels.py --suite "$name" "${profile_args[@]}" "${shapes[@]}" \
        --workdir "$work/models" --optimize-arg=--db="$work/tuning.db" --optimize-arg=--quiet \
        --json "$s7/$name.json" --out "$s7/$name.txt"
    done
  fi
  clocks; pack
fi

# --- stage 5: per-call host overhead of the custom op against stock ORT's per-node overhead ---
if has_stage 5; then
  lim=$(stage_limit 5 240)
  s5=$D/stage5
  mkdir -p "$s5"
  if [ "$dry" = 1 ]; then
    overhead_args=(--provider cpu --measure analytic --nodes 20 --warmup 2 --rounds 3 --runs 2 --iters 1000)
  else
    overhead_args=(--provider cuda --measure gpu --nodes 200 --warmup 50 --rounds 15 --runs 20)
  fi
  if ! skipped_without_ort 5 "host overhead"; then
    step 5 "host overhead" "$lim" "$s5/host-overhead.log" -- \
      "$PY" -m benchmarks.host_overhead --work "$work/host-overhead" --out "$s5/host-overhead.txt" \
      --label "device_run call $call" "${overhead_args[@]}"
  fi
  clocks; pack
fi

# --- stage 6: the same models under PyTorch eager and torch.compile (benchmarks/torch_compile.py) ---
if has_stage 6; then
  lim=$(stage_limit 6 240); t6=$SECONDS
  s6=$D/stage6
  mkdir -p "$s6"
  read -r -a tnames <<< "$(echo "${suites:-bert,resnet50}" | tr , ' ')"
  for i in "${!tnames[@]}"; do
    name=${tnames[$i]} share=$(( (lim - (SECONDS - t6)) / (${#tnames[@]} - i) ))
    if [ "$dry" = 1 ]; then
      # tiny, fp16 on the CPU, a subset of stage 3's dry-run sweep (run_suite's cpu one)
      preset=tiny dtype=float16 dev=cpu targs=(--modes eager,dynamic --repeat 2 --warmup 1)
      case $name in bert) dims=(--dim batch=4 --dim seq=16,32) ;; resnet50) dims=(--dim batch=1 --dim height=160 --tie width=height) ;;
                    *) dims=(--dim tokens=7,16) ;; esac
    else  # a subset of run_suite's cuda sweep, so torch_report joins it with stage 3's bench file
      dtype=float16 dev=cuda targs=(--autotune-shapes 2 --repeat 20 --warmup 3 --budget-s $(( share * 7 / 10 )))
      case $name in bert) preset=base dims=(--dim batch=1,16 --dim seq=16,128,512) ;;
                    resnet50) preset=full dims=(--dim batch=1,32 --dim height=160,224,288 --tie width=height) ;;
                    *) preset=llama-7b-layer dims=(--dim tokens=1,16,128,1000,4096) ;; esac
    fi
    tag=$name-$preset$([ "$dtype" = float16 ] && echo -fp16)-$dev
    onnx=(); [ -f "$work/models/${tag%-"$dev"}.onnx" ] && onnx=(--onnx "$work/models/${tag%-"$dev"}.onnx")
    step 6 "torch.compile $name" "$share" "$s6/$name.log" -- \
      "$PY" benchmarks/torch_compile.py "$name" --preset "$preset" --dtype "$dtype" --device "$dev" "${dims[@]}" \
      "${targs[@]}" "${onnx[@]}" --json "$results/$slug/torch-compile-$tag.json"
    if [ -f "$results/$slug/$tag.json" ] && [ -f "$results/$slug/torch-compile-$tag.json" ]; then
      step 6 "torch_report $name" 30 "$results/$slug/torch-compile-$tag.txt" -- "$PY" benchmarks/torch_report.py \
        "$results/$slug/$tag.json" "$results/$slug/torch-compile-$tag.json" --json "$s6/$name-join.json"
    fi
  done
  clocks; pack
fi

# --- stage 4: keep the tuning database and the bundles ---
if has_stage 4; then
  lim=$(stage_limit 4 120)
  s4=$D/stage4
  mkdir -p "$s4"
  if [ -f "$work/tuning.db" ]; then
    step 4 "tuning database" "$lim" "$s4/stage4.log" -- "$PY" benchmarks/device_info.py backup-db "$work/tuning.db" "$s4/tuning.db"
  else
    log "stage 4: no tuning database yet (stage 3 has not run on this machine)"
  fi
  shopt -s nullglob
  optimized=("$work"/models/*.dietcode.onnx)
  shopt -u nullglob
  if [ "${#optimized[@]}" -gt 0 ]; then
    cp "$work"/models/*.shapes.json "$s4/" 2>/dev/null
    step 4 "bundles" "$(stage_limit 4 120)" "$s4/stage4.log" -- \
      "$PY" benchmarks/device_info.py bundles --out "$s4/bundles" "${optimized[@]}"
  else
    log "stage 4: no optimized model yet"
  fi
fi

clocks
pack
log "done in $((SECONDS - start))s; archive: $(ls -l "$out" | awk 'NR>1 {print $NF": "$5" bytes"}' | paste -sd ' ')"
"$PY" - "$work/steps.jsonl" "$call" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if str(r.get("call")) == sys.argv[2]]
print(f"{'stage':<6}{'step':<40}{'exit':>6}{'s':>6}{'limit':>7}  note")
for r in rows:
    note = "TIMED OUT" if r.get("timed_out") else ("skipped" if r.get("skipped") else "")
    print(f"{r['stage']!s:<6}{r['step'][:39]:<40}{r['rc']!s:>6}{r['seconds']:>6}{r['limit']:>7}  {note}")
EOF
[ "$failed" = 0 ] || { echo "device_run: $failed step(s) failed or timed out (metadata.json lists them)"; exit 1; }
