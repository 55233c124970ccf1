#!/usr/bin/env bash
# CPU side: build .devbundle/ (ignored), what the GPU image lacks to run lmdeploy 0.18:
#   .devbundle/whl/         cp312 / py3 wheels of lmdeploy's import-time deps missing there
#   .devbundle/src/lmdeploy pure-Python lmdeploy 0.18.0 (TurboMind .so, lib, lib64, include removed;
#                           the TurboMind binaries travel separately: pack_turbomind.sh)
#
#   bash bench/device/make_bundle.sh       # from anywhere in the repo; ~17 MB
#
# Env: STAGE (default /tmp/tmstage: the lmdeploy wheel is downloaded to / reused from STAGE/dl),
#      EXTRA_WHEELS="name==version ..." (more wheels).
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel); B=$ROOT/.devbundle
DL=${STAGE:-/tmp/tmstage}/dl; mkdir -p "$DL"
# What `import lmdeploy` and its engines import at module level and the GPU image (python 3.12,
# torch 2.11, transformers 5.17) lacks; pinned.
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 mmengine-lite==0.10.7 addict==2.4.0 yapf==0.43.0 platformdirs==4.14.8
  termcolor==3.3.0 pybase64==1.5.1 pyzmq==27.3.0 shortuuid==1.0.13
  xgrammar==0.2.9 apache-tvm-ffi==0.1.11     # lmdeploy/pytorch/engine/guided_process.py
  lmdb==3.0.0                                # featcache's disk tier
  blake3==1.0.11                             # featcache's keys
  flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.1  # lmdeploy's Qwen3.5 (gated delta) on CUDA
  ${EXTRA_WHEELS:-}
)
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
rm -rf "$B"; mkdir -p "$B"/whl "$B"/src
python3 -m pip download -q "${PLAT[@]}" -d "$B/whl" "${WHEELS[@]}" 2>&1 | grep -v '^WARNING: Location' || true
ls "$DL"/lmdeploy-0.18.0-cp312-*.whl >/dev/null 2>&1 \
  || python3 -m pip download -q "${PLAT[@]}" -d "$DL" lmdeploy==0.18.0 2>&1 | grep -v '^WARNING: Location' || true
WHL=$(ls "$DL"/lmdeploy-0.18.0-cp312-*.whl | head -1)
X=$(mktemp -d); trap 'rm -rf "$X"' EXIT
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$WHL" "$X"
rm -rf "$X"/lmdeploy/turbomind/*.so "$X"/lmdeploy/turbomind/{lib,lib64,include}
find "$X" -name __pycache__ -prune -exec rm -rf {} +
if find "$X/lmdeploy" \( -name '*.so' -o -name '*.so.*' -o -name '*.a' \) | grep .; then
  echo "unexpected binaries left in lmdeploy"; exit 1
fi
cp -r "$X"/lmdeploy "$X"/lmdeploy-*.dist-info "$B/src/"
du -sh --apparent-size "$B"/whl "$B"/src "$B"; ls "$B/whl" | wc -l
