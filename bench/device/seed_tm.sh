#!/usr/bin/env bash
# The seed models (issue 13) on lmdeploy 0.18's TurboMind, and the PyTorch engine's `check` again, on
# nvidia-h200-x2, one job per GPU at once. Runs in the environment the TurboMind ferry assembled
# (docs/benchmarks.md, "TurboMind on the H200"): after the ferry's calls, on the same warm machine,
#
#   bash bench/device/run_turbomind.sh exec bash bench/device/seed_tm.sh check   # call 9
#   bash bench/device/run_turbomind.sh exec bash bench/device/seed_tm.sh bench   # call 10
#
#   check  GPU 0: build InternVL2-26B, then turbomind_check.py run --path plain, then --path native;
#          GPU 1: build InternVL2-2B, the same two runs, then e2e_lmdeploy.py check (PyTorch engine,
#          with its plain_prefix reference pass); then turbomind_check.py compare over both models.
#   bench  GPU 0: turbomind_bench.py run --paths plain,native on the 26B (--kv-fraction 0.3);
#          GPU 1: the same on the 2B, then e2e_lmdeploy.py check on the 26B.
# Each job runs under `timeout` of what is left of SEED_BUDGET (s, default 560). $OUT gets a log per
# job and the results: tmcheck-*.jsonl, tmcheck-summary.json, tmbench-{26b,2b}.json, ptcheck-*.json.
set -uo pipefail
O=${OUT:-/tmp/out}; M=${SEED_MODELS:-/tmp/models}; T0=$(date +%s); mkdir -p $O
B26=$M/internvl2_26b_shape; B2=$M/internvl2_2b_shape
left() { echo $(( ${SEED_BUDGET:-560} - ($(date +%s) - T0) )); }
# job GPU NAME CMD...: one step on one GPU, logged to $OUT/NAME.log, never past the budget
job() {
  local gpu=$1 name=$2 t=$(date +%s) l; shift 2; l=$(left)
  if [ $l -lt 30 ]; then echo "[seed] SKIPPED $name (${l} s left)"; return 9; fi
  echo "[seed] GPU $gpu: $name (${l} s left)"
  CUDA_VISIBLE_DEVICES=$gpu timeout --signal=INT --kill-after=15 $l "$@" > $O/$name.log 2>&1
  local rc=$?; echo "[seed] GPU $gpu: $name rc=$rc in $(($(date +%s)-t)) s"; return $rc
}
tmcheck() { job $1 tmcheck-$2-$3 python3 bench/turbomind_check.py run --model $M/internvl2_$2_shape \
              --path $3 --out $O/tmcheck-$2-$3.jsonl --save /tmp/tmsave; }
ptcheck() { job $1 ptcheck-$2 python3 bench/e2e_lmdeploy.py check --model $M/internvl2_$2_shape \
              --tier-bytes $3 --json $O/ptcheck-$2.json; }
tmbench() { job $1 tmbench-$2 python3 bench/turbomind_bench.py run --model $M/internvl2_$2_shape \
              --paths plain,native --out $O/tmbench-$2.json --budget $(( $(left) - 20 )) "${@:3}"; }
{ nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader; df -h /tmp | tail -1; } | sed 's/^/[seed] /'
case ${1:-} in
  check)
    ( job 0 make-26b python3 bench/device/make_seed_models.py $M --which 26b \
      && tmcheck 0 26b plain; tmcheck 0 26b native ) &
    ( job 1 make-2b python3 bench/device/make_seed_models.py $M --which 2b \
      && tmcheck 1 2b plain; tmcheck 1 2b native; ptcheck 1 2b 16777216 ) &
    wait
    cat $O/tmcheck-*.jsonl > $O/tmcheck.jsonl 2>/dev/null
    python3 bench/turbomind_check.py compare $O/tmcheck.jsonl --save /tmp/tmsave --out $O/tmcheck-summary.json \
      > $O/tmcheck-compare.log 2>&1; tail -c 6000 $O/tmcheck-compare.log ;;
  bench)
    ( tmbench 0 26b --n 5 --reps 3 --d-requests 64 --kv-fraction 0.3 ) &
    ( tmbench 1 2b --n 10 --reps 3 --d-requests 128 --kv-fraction 0.2 --budget 300; ptcheck 1 26b 50331648 ) &
    wait
    for f in $O/tmbench-*.log; do echo "== $f"; grep -E '^\[bench\] (series|ratios|targets|skipped|done)|^  ' $f | tail -20; done ;;
  *) echo "usage: seed_tm.sh check|bench"; exit 2 ;;
esac
for f in $O/ptcheck-*.log; do [ -f $f ] && { echo "== $f"; tail -5 $f; }; done
echo "[seed] done in $(($(date +%s)-T0)) s"
