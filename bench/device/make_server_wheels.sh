#!/usr/bin/env bash
# CPU side: build .srv/ (ignored), the cp312 wheels `lmdeploy serve api_server` / `featcache serve`
# and the `openai` client need on the GPU machine beyond its image and .devbundle (pydantic,
# typing-extensions, shortuuid, pyzmq come with .devbundle; click, certifi, prometheus-client,
# uvloop are in the image: /work/.library/device/KINDS.md). Pinned to requirements/lmdeploy-cpu.txt,
# the versions the CPU serve tests run with. Carried with the last ferry call (`final .tm08 .srv`):
# run_turbomind.sh installs it into /tmp/srvsite, first on PYTHONPATH (docs/benchmarks.md).
#
#   bash bench/device/make_server_wheels.sh     # ~3-4 MB; prints the size
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel); S=$ROOT/.srv
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  anyio==4.16.0 sniffio==1.3.1 h11==0.16.0 idna==3.20
  openai==3.57.0 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  py-spy==0.4.3  # a sampling profiler: bench/serve_latency.py --profile (where a loaded server's time goes)
)
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
rm -rf "$S"; mkdir -p "$S"
python3 -m pip download -q "${PLAT[@]}" -d "$S" "${WHEELS[@]}" 2>&1 | grep -v '^WARNING: Location' || true
n=$(ls "$S"/*.whl | wc -l)
[ "$n" = ${#WHEELS[@]} ] || { echo "expected ${#WHEELS[@]} wheels, got $n"; ls "$S"; exit 1; }
echo ".srv: $n wheels, $(du -sb "$S" | cut -f1) bytes"
