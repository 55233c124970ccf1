#!/usr/bin/env bash
# Device side of the PyTorch-engine runs (docs/benchmarks.md): runs in the repo root on the GPU
# machine, carrying .devbundle (bench/device/make_bundle.sh) and, for the servers, .srv
# (bench/device/make_server_wheels.sh: installed into /tmp/srvsite, first on PYTHONPATH). Installs the bundle's wheels into
# /tmp/site (once per machine), puts lmdeploy's pure-Python copy and this checkout on PYTHONPATH,
# then runs each argument as one shell step, in order, each under `timeout` of what is left of
# PT_BUDGET (s, default 570) so that a slow step cannot lose the call's results.
#
#   bash bench/device/run_pt.sh 'python3 bench/device/make_seed_models.py /tmp/models --which 2b' \
#       'python3 bench/e2e_lmdeploy.py check --model /tmp/models/internvl2_2b_shape --json $OUT/c.json'
#
# $OUT gets pt.log (every step's whole output) and env.txt (GPU, disk, versions).
set -uo pipefail
R=$PWD; O=${OUT:-/tmp/out}; T0=$(date +%s); mkdir -p $O
[ -d .devbundle/whl ] || { echo "[pt] no .devbundle here: carry it (bench/device/make_bundle.sh)"; exit 2; }
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .devbundle/whl/*.whl \
    && touch /tmp/site/.done
fi
SRV=  # the server's wheels (bench/device/make_server_wheels.sh), when .srv is carried too
if [ -d .srv ]; then
  [ -f /tmp/srvsite/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/srvsite .srv/*.whl && touch /tmp/srvsite/.done; }
  SRV=/tmp/srvsite:
fi
export PYTHONPATH=$SRV/tmp/site:$R/.devbundle/src:$R PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader; df -h / /tmp | tail -n +2
  python3 -c "import torch, lmdeploy; print('torch', torch.__version__, 'lmdeploy', lmdeploy.__version__)"
  git -C $R log -1 --format='commit %h %s' 2>/dev/null; } > $O/env.txt 2>&1
cat $O/env.txt
rc_all=0
for step in "$@"; do
  left=$(( ${PT_BUDGET:-570} - ($(date +%s) - T0) ))
  if [ $left -lt 20 ]; then echo "[pt] SKIPPED (${left} s left): $step" | tee -a $O/pt.log; rc_all=9; continue; fi
  echo "[pt] step (${left} s left): $step" | tee -a $O/pt.log
  t=$(date +%s)
  timeout --signal=INT --kill-after=15 $left bash -c "$step" > >(tee -a $O/pt.log) 2>&1; rc=$?
  echo "[pt] rc=$rc in $(($(date +%s)-t)) s: $step" | tee -a $O/pt.log
  [ $rc -ne 0 ] && rc_all=$rc
done
echo "[pt] done in $(($(date +%s)-T0)) s"
exit $rc_all
