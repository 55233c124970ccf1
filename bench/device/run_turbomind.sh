#!/usr/bin/env bash
# Device side of the TurboMind ferry (docs/benchmarks.md, "TurboMind on the H200"). Runs in the
# repo root on the GPU machine; everything it keeps lives in /tmp, which survives between calls
# only while the machine stays warm (30 s after a call returns): the calls follow each other.
#
#   bash bench/device/run_turbomind.sh recv DIR...    # keep carried dirs: .devbundle, .tmx, .tmNN
#   bash bench/device/run_turbomind.sh final DIR...   # recv, assemble in /tmp/lmd, then test
#   bash bench/device/run_turbomind.sh test           # only the checks (assembled earlier)
#
# Env: TM_MODELS (default "internvl_hf_tiny qwen2vl_tiny internvl_chat_tiny"), TM_PATHS (default:
# what bench/turbomind_check.py paths says per model), TM_TIMEOUT (s per check process, 150),
# TM_BUDGET (s for the whole call, 540: later checks are skipped, rerun them with `test`).
# $OUT gets final.log, run.log (the checks' whole output), results.jsonl, summary.json.
set -uo pipefail
R=$PWD; P=/tmp/tmparts; T0=$(date +%s)
mode=${1:-recv}; shift || true
mkdir -p $P
for d in "$@"; do
  case "$d" in
    .devbundle) rm -rf /tmp/devbundle && cp -r .devbundle /tmp/devbundle ;;
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

# the wheel's .so wants nvidia-nccl-cu12's libnccl.so.2; the device's own (cu13, torch's) serves
NCCL=$(python3 -c "import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null)
[ -e "$NCCL/libnccl.so.2" ] || NCCL=$(dirname "$(find / -name libnccl.so.2 2>/dev/null | head -1)")
mkdir -p /tmp/lmd/nvidia/nccl && ln -sfn "$NCCL" /tmp/lmd/nvidia/nccl/lib
export LD_LIBRARY_PATH=/tmp/lmd/nvidia/cublas/lib:/tmp/lmd/nvidia/cuda_runtime/lib:$NCCL${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=/tmp/site:/tmp/lmd:$R PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
echo "[env] $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); NCCL=$NCCL"
ldd /tmp/lmd/lmdeploy/turbomind/_turbomind*.so | grep -E 'cublas|cudart|nccl|libcuda\.|not found'

C="python3 bench/turbomind_check.py"
$C import || exit 5
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
echo "[done] $(($(date +%s)-T0)) s"
