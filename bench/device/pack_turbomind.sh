#!/usr/bin/env bash
# CPU side of the TurboMind ferry (docs/benchmarks.md, "TurboMind on the H200"): stage lmdeploy
# 0.18.0's compiled TurboMind module and the CUDA 12 libraries it links (genuine, unmodified
# NVIDIA wheels), compress them into one zstd --long=31 stream, cut it into pieces that each fit
# one device call (64 MiB of working tree per call, the repo's own files included).
#
#   bash bench/device/make_bundle.sh           # first: .devbundle travels with piece 1
#   bash bench/device/pack_turbomind.sh        # -> .tmx/ .tm01/ ... .tmNN/ (ignored by .gitignore)
#
# Env: STAGE (default /tmp/tmstage: downloads in STAGE/dl, reuses STAGE/all.tar.zst when its
# recorded inputs match), PIECE_MIB (default 56: 8 MiB of each call left for the repository itself), CALL_MIB (default 64: the device tool's limit).
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel); cd "$ROOT"
W=${STAGE:-/tmp/tmstage}; DL=$W/dl; mkdir -p "$DL"
PIECE_MIB=${PIECE_MIB:-56}; CALL_MIB=${CALL_MIB:-64}
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64)
get() {  # get GLOB SPEC: the wheel in DL matching GLOB, downloaded first if missing
  ls "$DL"/$1 >/dev/null 2>&1 || python3 -m pip download -q "${PLAT[@]}" -d "$DL" "$2" >&2
  ls "$DL"/$1 | head -1
}
LMW=$(get 'lmdeploy-0.18.0-cp312-*.whl' lmdeploy==0.18.0)
CUBLAS=$(get 'nvidia_cublas_cu12-12.9.1.4-*.whl' nvidia-cublas-cu12==12.9.1.4)
CUDART=$(get 'nvidia_cuda_runtime_cu12-12.9.79-*.whl' nvidia-cuda-runtime-cu12==12.9.79)
ZWHL=$(get 'zstandard-0.25.0-cp312-*.whl' zstandard==0.25.0)

# the stream: lmd/ laid out as the .so's RUNPATH ($ORIGIN/../../nvidia/...) expects, plus lmd.sha256
(cd "$DL" && sha256sum "$(basename "$LMW")" "$(basename "$CUBLAS")" "$(basename "$CUDART")") > "$W/inputs.new"
if [ -s "$W/all.tar.zst" ] && cmp -s "$W/inputs.new" "$W/inputs.sha256"; then
  echo "reusing $W/all.tar.zst (same input wheels)"
else
  rm -rf "$W/lmd" "$W/all.tar.zst"
  mkdir -p "$W"/lmd/lmdeploy/turbomind/lib "$W"/lmd/nvidia/cublas/lib "$W"/lmd/nvidia/cuda_runtime/lib
  unzip -o -q -j "$LMW" 'lmdeploy/turbomind/_turbomind.cpython-312-x86_64-linux-gnu.so' -d "$W/lmd/lmdeploy/turbomind/"
  unzip -o -q -j "$LMW" 'lmdeploy/turbomind/lib/libturbomind_nccl_stub.so' -d "$W/lmd/lmdeploy/turbomind/lib/"
  unzip -o -q -j "$CUBLAS" 'nvidia/cublas/lib/libcublas.so.12' 'nvidia/cublas/lib/libcublasLt.so.12' -d "$W/lmd/nvidia/cublas/lib/"
  unzip -o -q -j "$CUDART" 'nvidia/cuda_runtime/lib/libcudart.so.12' -d "$W/lmd/nvidia/cuda_runtime/lib/"
  (cd "$W" && sha256sum $(find lmd -type f | sort) > lmd.sha256)
  if command -v zstd >/dev/null; then   # ~5 minutes on 2 cores
    tar -C "$W" -cf - --owner=0 --group=0 lmd lmd.sha256 | zstd -19 --long=31 -T0 -q -o "$W/all.tar.zst"
  else                                  # same stream format through the zstandard wheel
    python3 -m pip install -q --no-deps --target "$W/zst" "$ZWHL"
    tar -C "$W" -cf - --owner=0 --group=0 lmd lmd.sha256 | PYTHONPATH=$W/zst python3 -c "
import sys, zstandard
p = zstandard.ZstdCompressionParameters.from_level(19, window_log=31, enable_ldm=True)
zstandard.ZstdCompressor(compression_params=p).copy_stream(sys.stdin.buffer, open(sys.argv[1], 'wb'))" "$W/all.tar.zst"
  fi
  mv "$W/inputs.new" "$W/inputs.sha256"
fi

# cut: piece 1 shares its call with .devbundle and .tmx, so it is smaller
[ -d .devbundle/whl ] || { echo "run bench/device/make_bundle.sh first"; exit 1; }
rm -rf .tm[0-9][0-9] .tmx; mkdir .tmx; cp "$ZWHL" .tmx/
extra=$(du -scb .devbundle .tmx | tail -1 | cut -f1)
python3 - "$W/all.tar.zst" "$PIECE_MIB" "$extra" <<'PY'
import os, sys
src, piece, extra = sys.argv[1], int(sys.argv[2]) << 20, int(sys.argv[3])
sizes = [piece - extra - (64 << 10)]  # room for .tmx/pieces.sha256 too
with open(src, 'rb') as f:
    n = 1
    while buf := f.read(sizes[-1]):
        os.makedirs(f'.tm{n:02d}')
        with open(f'.tm{n:02d}/part.{n:02d}', 'wb') as g:
            g.write(buf)
        n += 1
        sizes.append(piece)
PY
sha256sum .tm[0-9][0-9]/part.* | sed 's#  .tm[0-9]*/#  #' > .tmx/pieces.sha256

# every call: the tree that travels (tracked + untracked-not-ignored files) plus what it carries
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r du -cb 2>/dev/null | awk '$2=="total"{s+=$1} END{print s+0}')
echo "working tree that travels: $tree bytes"
ok=1; n=0
last=$(ls -d .tm[0-9][0-9] | tail -1)
for d in .tm[0-9][0-9]; do
  n=$((n+1)); carry=$d; [ $n = 1 ] && carry=".devbundle .tmx $d"
  [ $d = $last ] && [ -d .srv ] && carry="$carry .srv"   # the server's wheels ride with `final`
  total=$(( tree + $(du -scb $carry | tail -1 | cut -f1) ))
  printf 'call %d: carry %-28s %10d bytes (%.2f MiB)\n' $n "$carry" $total "$(echo "$total/1048576" | bc -l)"
  [ $total -le $((CALL_MIB << 20)) ] || { echo "  OVER ${CALL_MIB} MiB"; ok=0; }
done
git status --porcelain --ignored=no | grep -E '\.tm|\.devbundle|\.srv' && { echo "pieces are not ignored"; ok=0; }
[ $ok = 1 ] && echo "OK: $n pieces, each call <= ${CALL_MIB} MiB"
