#!/usr/bin/env bash
# Device side of the TurboMind ferry (docs/benchmarks.md, "TurboMind on the H200"). Runs in the
# repo root on the GPU machine; everything it keeps lives in /tmp, which survives between calls
# only while the machine stays warm (30 s after a call returns): the calls follow each other.
#
#   bash bench/device/run_turbomind.sh recv DIR...    # keep carried dirs: .devbundle, .tmx, .tmNN
#                                                     # (.srv: the server's wheels, installed into
#                                                     # /tmp/srvsite, first on PYTHONPATH)
#   bash bench/device/run_turbomind.sh final DIR...   # recv, assemble in /tmp/lmd, then test
#   bash bench/device/run_turbomind.sh test           # only the checks (assembled earlier)
#   bash bench/device/run_turbomind.sh bench          # only the speed bench (assembled earlier)
#   bash bench/device/run_turbomind.sh exec CMD ARG...  # CMD in the assembled environment
#                                                       # (assembled earlier); output to exec.log
#
# Env: TM_MODELS (default "internvl_hf_tiny qwen2vl_tiny internvl_chat_tiny"), TM_PATHS (default:
# what bench/turbomind_check.py paths says per model), TM_TIMEOUT (s per check process, 150),
# TM_BUDGET (s for the whole call, 540: later checks are skipped, rerun them with `test`; the bench
# gets what is left), TM_SKIP_CHECKS=1 (`final` assembles without the tiny checks), TM_BENCH=1
# (`final` then runs the bench too, in the same call), TM_BENCH_ARGS (more arguments for
# bench/turbomind_bench.py run, e.g. "--n 5 --reps 3 --d-requests 96").
# $OUT gets final.log, run.log (the checks' whole output), results.jsonl, summary.json; the bench
# adds bench.json (rewritten after each engine) and bench.log (its whole output).
set -uo pipefail
R=$PWD; P=/tmp/tmparts; T0=$(date +%s)
mode=${1:-recv}; shift || true
mkdir -p $P
EXEC=(); [ "$mode" = exec ] && { EXEC=("$@"); set --; }
for d in "$@"; do
  case "$d" in
    .devbundle) rm -rf /tmp/devbundle && cp -r .devbundle /tmp/devbundle ;;
    .srv) rm -rf /tmp/srvsite && python3 -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --target /tmp/srvsite .srv/*.whl && echo "[recv] .srv: $(ls .srv | wc -l) wheels in /tmp/srvsite" ;;
    *) [ -d "$d" ] && cp "$d"/* $P/ || echo "MISSING $d" ;;
  esac
done
echo "[recv] $(ls $P | tr '\n' ' ')| $(du -sb $P | cut -f1) bytes; devbundle: $([ -d /tmp/devbundle ] && echo yes || echo no)"
[ "$mode" = recv ] && exit 0

O=${OUT:-/tmp/out}; mkdir -p $O
exec > >(tee -a $O/final.log) 2>&1
if [ "$mode" = final ]; then
  (cd $P && sha256sum -c --quiet pieces.sha256) && echo "[final] pieces sha256 OK" || { echo "[final] PIECES BAD"; exit 3; }
  rm -rf /tmp/lmd /tmp/lmd.sha256
  if command -v zstd >/dev/null; then
    cat $P/part.* | zstd -d -q --long=31 -c | tar -x -C /tmp
  else  # the GPU image has no zstd CLI: the carried zstandard wheel (window up to 2 GiB for --long=31)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/zst $P/zstandard-*.whl
    cat $P/part.* | PYTHONPATH=/tmp/zst python3 -c "import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=2**31).copy_stream(sys.stdin.buffer, sys.stdout.buffer)" | tar -x -C /tmp
  fi
  (cd /tmp && sha256sum -c --quiet lmd.sha256) && echo "[final] binaries sha256 OK" || { echo "[final] EXTRACT BAD"; exit 4; }
  cp -r /tmp/devbundle/src/. /tmp/lmd/   # lmdeploy's Python around the binaries (+ dist-info)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/devbundle/whl/*.whl
  echo "[final] assembled in $(($(date +%s)-T0)) s: $(du -sh /tmp/lmd | cut -f1) in /tmp/lmd"
fi

[ -d /tmp/lmd/lmdeploy/turbomind ] || { echo "[$mode] /tmp/lmd is not assembled: run final first, on the same warm machine"; exit 8; }
# the wheel's .so wants nvidia-nccl-cu12's libnccl.so.2; the device's own (cu13, torch's) serves
NCCL=$(python3 -c "import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null)
[ -e "$NCCL/libnccl.so.2" ] || NCCL=$(dirname "$(find / -name libnccl.so.2 2>/dev/null | head -1)")
mkdir -p /tmp/lmd/nvidia/nccl && ln -sfn "$NCCL" /tmp/lmd/nvidia/nccl/lib
export LD_LIBRARY_PATH=/tmp/lmd/nvidia/cublas/lib:/tmp/lmd/nvidia/cuda_runtime/lib:$NCCL${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SRV=; [ -d /tmp/srvsite ] && SRV=/tmp/srvsite:   # the server's wheels (.srv), when carried
export PYTHONPATH=$SRV/tmp/site:/tmp/lmd:$R PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "[env] $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); NCCL=$NCCL"
ldd /tmp/lmd/lmdeploy/turbomind/_turbomind*.so | grep -E 'cublas|cudart|nccl|libcuda\.|not found'

if [ "$mode" = exec ]; then
  "${EXEC[@]}" > >(tee -a $O/exec.log) 2>&1; rc=$?
  echo "[exec] rc=$rc: ${EXEC[*]}"; echo "[done] $(($(date +%s)-T0)) s"; exit $rc
fi
C="python3 bench/turbomind_check.py"
$C import || exit 5

run_bench() {  # the real-shape checkpoint (built here, never carried), then the speed bench
  local t=$(date +%s) left lim rc
  python3 bench/device/make_real_shape.py /tmp/models >> $O/bench.log 2>&1 \
    || { echo "[bench] make_real_shape.py failed (bench.log)"; tail -5 $O/bench.log; return 6; }
  echo "[bench] checkpoint ready in $(($(date +%s)-t)) s: $(du -sh /tmp/models/internvl3_2b_shape | cut -f1)"
  left=$(( ${TM_BUDGET:-540} - ($(date +%s) - T0) ))
  [ $left -gt 120 ] || { echo "[bench] SKIPPED: $left s left (run it with: bench)"; return 7; }
  lim=$(( left - 10 ))
  timeout -k 10 $lim python3 bench/turbomind_bench.py run --model /tmp/models/internvl3_2b_shape \
    --out $O/bench.json --budget $(( lim - 40 )) ${TM_BENCH_ARGS:-} >> $O/bench.log 2>&1
  rc=$?
  echo "[bench] rc=$rc in $(($(date +%s)-t)) s"
  sed -n '/^\[bench\] series/,$p' $O/bench.log | cut -c1-400
  return $rc
}

if [ "$mode" = bench ]; then run_bench; rc=$?; echo "[done] $(($(date +%s)-T0)) s"; exit $rc; fi
if [ "${TM_SKIP_CHECKS:-0}" = 1 ]; then
  echo "[test] tiny checks skipped (TM_SKIP_CHECKS=1)"
  rc=0; [ "${TM_BENCH:-0}" = 1 ] && { run_bench; rc=$?; }
  echo "[done] $(($(date +%s)-T0)) s"; exit $rc
fi
[ -f /tmp/models/internvl_chat_tiny/model.safetensors ] \
  || python3 bench/device/make_tiny_vlm.py /tmp/models --arch all 2>&1 | grep -v -i deprecat
for m in ${TM_MODELS:-internvl_hf_tiny qwen2vl_tiny internvl_chat_tiny}; do
  for p in ${TM_PATHS:-$($C paths /tmp/models/$m)}; do
    left=$(( ${TM_BUDGET:-540} - ($(date +%s) - T0) ))
    [ $left -gt 40 ] || { echo "[test] SKIPPED $m $p: out of time (rerun with test)"; continue; }
    lim=$(( left < ${TM_TIMEOUT:-150} ? left : ${TM_TIMEOUT:-150} ))
    t=$(date +%s)
    timeout -k 5 $lim $C run --model /tmp/models/$m --path $p --out $O/results.jsonl --save /tmp/tmcheck \
      >> $O/run.log 2>&1
    echo "[test] $m $p: rc=$? in $(($(date +%s)-t)) s"
  done
done
$C compare $O/results.jsonl --save /tmp/tmcheck --out $O/summary.json
rc=0; [ "${TM_BENCH:-0}" = 1 ] && { run_bench; rc=$?; }
echo "[done] $(($(date +%s)-T0)) s"
exit $rc
