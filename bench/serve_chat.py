"""`featcache serve` end to end on a GPU: the OpenAI client, multi-turn, against plain lmdeploy.

    python bench/serve_chat.py --model DIR [--out DIR] [--eager]

1. plain `lmdeploy serve api_server` (PyTorch engine): examples/chat.py, 4 turns resending a
   1344x1008 image, twice (two images);
2. `featcache warm MODEL warmed.png` into a fresh store;
3. `featcache serve` over that store (prefix caching on): the chat with the warmed image (its
   turn 1 is a disk hit) and with a new image (turn 1 computes it); then `/metrics` and
   `featcache stats`.
Prints each server's per-turn time to first token and writes everything under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError("server not ready")


def start(cmd: list[str], port: int, log: str) -> subprocess.Popen:
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    t = time.monotonic()
    wait_ready(port, proc)
    print(f"[serve] ready in {time.monotonic() - t:.0f} s: {' '.join(cmd[:4])} ...", flush=True)
    return proc


def stop(proc: subprocess.Popen) -> int:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def chat(port: int, image: str, turns: int = 4) -> dict[str, list]:
    """examples/chat.py against the server: time to first token (ms) and cached prompt tokens per
    turn."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "chat.py"),
                          "--base-url", f"http://127.0.0.1:{port}/v1", "--image", image,
                          "--turns", str(turns), "--max-tokens", "1"],  # the first chunk is the answer
                         capture_output=True, text=True, timeout=300)
    print(out.stdout, out.stderr[-2000:], flush=True)
    out.check_returncode()
    return {"ttft_ms": [float(m) for m in re.findall(r"time to first token ([\d.]+) ms", out.stdout)],
            "cached_tokens": [int(m) for m in re.findall(r"\((\d+) cached\)", out.stdout)]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", default="serve_out")
    p.add_argument("--eager", action="store_true", help="--eager-mode (faster start, no CUDA graphs)")
    p.add_argument("--skip-warm", action="store_true",
                   help="no `featcache warm` step (the first image is then computed on its turn 1)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import base64

    from chat import data_url  # examples/chat.py

    images = {}
    for name, seed in [("warmed", 1), ("other", 2), ("plain_a", 1), ("plain_b", 2), ("warmup", 3)]:
        path = os.path.join(args.out, f"{name}.png")
        with open(path, "wb") as f:
            f.write(base64.b64decode(data_url(None, seed).split(",", 1)[1]))
        images[name] = path
    common = ["--backend", "pytorch", "--session-len", "8192", "--cache-max-entry-count", "0.05",
              "--log-level", "WARNING"] + (["--eager-mode"] if args.eager else [])
    py = sys.executable
    result: dict = {"model": args.model, "eager": args.eager}

    plain = start([py, "-m", "lmdeploy", "serve", "api_server", args.model, "--server-port", "23400",
                   "--enable-prefix-caching", *common], 23400, os.path.join(args.out, "plain.log"))
    try:
        chat(23400, images["warmup"], turns=1)  # the server's first request pays one-time costs
        result["plain_ttft_ms"] = {"image_a": chat(23400, images["plain_a"]),
                                   "image_b": chat(23400, images["plain_b"])}
    finally:
        stop(plain)

    store = os.path.join(args.out, "store")
    if not args.skip_warm:
        t = time.monotonic()
        warm = subprocess.run([py, "-m", "featcache", "warm", args.model, images["warmed"], "--cache-dir",
                               store], capture_output=True, text=True, timeout=400)
        print(warm.stdout, warm.stderr[-3000:], flush=True)
        result["warm"] = {"rc": warm.returncode, "stdout": warm.stdout.strip(),
                          "seconds": round(time.monotonic() - t, 1)}
    fc = start([py, "-m", "featcache", "serve", args.model, "--cache-dir", store, "--server-port",
                "23401", "--enable-prefix-caching", *common], 23401, os.path.join(args.out, "featcache.log"))
    try:
        chat(23401, images["warmup"], turns=1)
        result["featcache_ttft_ms"] = {"warmed_image": chat(23401, images["warmed"]),
                                       "new_image": chat(23401, images["other"])}
        metrics = urllib.request.urlopen("http://127.0.0.1:23401/metrics", timeout=5).read().decode()
        result["metrics_featcache_lines"] = [line for line in metrics.splitlines()
                                             if line.startswith("featcache_") and " 0.0" not in line][:60]
    finally:
        result["featcache_server_rc"] = stop(fc)
    stats = subprocess.run([py, "-m", "featcache", "stats", store, "--json"], capture_output=True,
                           text=True, timeout=60)
    result["stats"] = json.loads(stats.stdout) if stats.returncode == 0 else stats.stderr
    with open(os.path.join(args.out, "serve_chat.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("[serve] RESULT", json.dumps({k: v for k, v in result.items() if k != "metrics_featcache_lines"}),
          flush=True)
    print("\n".join(result.get("metrics_featcache_lines", [])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
