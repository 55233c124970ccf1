"""lmdeploy pipelines for the benchmarks, plain and with featcache, built alike so that a run
compares like with like; closing them without hanging a run.

PyTorch engine, kinds (``build``): ``plain`` (``lmdeploy.pipeline``: 0.18 switches prefix caching
off for the models featcache supports), ``plain_prefix`` (lmdeploy alone with its prefix caching
kept on: its own pixel hashes key the images), ``fc`` (``featcache.lmdeploy.pipeline``).

TurboMind, paths (``build_turbomind``): ``plain`` (``lmdeploy.pipeline``) or featcache's
``turbomind=`` ``native``, ``features``, ``combined``; always bfloat16 (``turbomind_config``), with
featcache's cache in host memory (``host_cache``: TurboMind's paths serve from the host).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from bench.lib.models import remote_code


def build(kind: str, model: str, prefix: bool, cache: Any = None, eager: bool = True,
          kv_fraction: float = 0.05, session_len: int = 8192, tp: int = 1,
          mp_engine: bool = False, cache_settings: dict[str, Any] | None = None) -> Any:
    """``kv_fraction``: ``cache_max_entry_count``, the share of free GPU memory for the KV cache
    (0.05 fits the 2B's series; the 26B's 32 clients need ~0.3). ``tp`` and ``mp_engine``
    (lmdeploy's engine in a second process): the same for every engine of a run; featcache then
    runs in its multi-process mode (one cache per model process, ``cache``'s settings, or
    ``cache_settings``: ``FeatcacheEngineConfig``'s ``{"feature_cache": {...}}``)."""
    from lmdeploy import PytorchEngineConfig
    from lmdeploy import pipeline as plain_pipeline

    cfg = PytorchEngineConfig(session_len=session_len, cache_max_entry_count=kv_fraction,
                              eager_mode=eager, enable_prefix_caching=prefix, tp=tp,
                              enable_mp_engine=mp_engine)
    kw = dict(backend_config=cfg, log_level="ERROR", trust_remote_code=remote_code(model))
    if kind == "plain":
        return plain_pipeline(model, **kw)
    if kind == "plain_prefix":
        from featcache.lmdeploy.pytorch.engine import keep_prefix_caching
        from featcache.lmdeploy.pytorch.models import SPECS

        with keep_prefix_caching(True, supported=set(SPECS)):
            return plain_pipeline(model, **kw)
    if kind != "fc":
        raise ValueError(f"unknown pipeline kind {kind!r}: plain, plain_prefix or fc")
    from featcache.lmdeploy import pipeline

    if cache_settings is not None:
        from featcache.lmdeploy.pytorch.processes import FeatcacheEngineConfig

        kw["backend_config"] = FeatcacheEngineConfig.of(cfg, cache_settings)
    return pipeline(model, cache=cache, **kw)


def bench_cache(device: str, disk_path: str) -> Any:
    """The cache the speed benches give featcache: 2 GiB device, 4 GiB host, 8 GiB disk."""
    from featcache import FeatureCache

    return FeatureCache(device=device, device_bytes="2GiB", host_bytes="4GiB", disk_path=disk_path,
                        disk_bytes="8GiB")


def turbomind_config(prefix: bool, session_len: int = 8192, kv_fraction: float = 0.2) -> Any:
    """TurboMind in bfloat16, prefix caching on or off; ``kv_fraction``: cache_max_entry_count."""
    from lmdeploy import TurbomindEngineConfig

    return TurbomindEngineConfig(session_len=session_len, cache_max_entry_count=kv_fraction,
                                 dtype="bfloat16", enable_prefix_caching=prefix)


def build_turbomind(path: str, model: str, config: Any, cache: Any = None,
                    log_level: str = "WARNING") -> Any:
    """Plain TurboMind (``path`` "plain") or featcache's ``turbomind=path`` over ``cache``, with
    the engine ``config`` (``turbomind_config``); the checkpoint's own config classes trusted
    where it brings them (``remote_code``). Whether featcache went in: ``pipe.featcache``."""
    kw = dict(backend_config=config, log_level=log_level, trust_remote_code=remote_code(model))
    if path == "plain":
        from lmdeploy import pipeline as plain_pipeline

        return plain_pipeline(model, **kw)
    from featcache.lmdeploy import pipeline

    return pipeline(model, cache=cache, turbomind=path, **kw)


def host_cache(host_bytes: int, disk_path: str | None = None, disk_bytes: int = 0) -> Any:
    """featcache's cache as the TurboMind paths run it: one tier of ``host_bytes`` in host memory
    (``device="cpu"``), a disk tier of ``disk_bytes`` at ``disk_path`` where one is given."""
    from featcache import FeatureCache

    return FeatureCache(device="cpu", device_bytes=host_bytes, host_bytes=0, disk_path=disk_path,
                        disk_bytes=disk_bytes if disk_path else 0)


def greedy(new_tokens: int, ignore_eos: bool = False, logits: str | None = None,
           hidden: bool = False) -> Any:
    """lmdeploy's GenerationConfig for greedy decoding of ``new_tokens`` tokens; ``ignore_eos``:
    every answer that long; ``logits``: ``output_logits`` ("all": the prompt's too, "generation");
    ``hidden``: every position's last hidden state."""
    from lmdeploy import GenerationConfig

    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, ignore_eos=ignore_eos,
                            output_logits=logits, output_last_hidden_state="all" if hidden else None)


def ask(pipe: Any, prompt: Any, gen: Any) -> list[Any]:
    """One prompt through the pipeline, its responses as a list: a list of (text, image(s))
    tuples is one batch, another list one conversation (OpenAI-style messages), a tuple one
    request."""
    if isinstance(prompt, list) and isinstance(prompt[0], tuple):
        return list(pipe(prompt, gen_config=gen))
    if isinstance(prompt, list):
        return [pipe([prompt], gen_config=gen)[0]]
    return [pipe(prompt, gen_config=gen)]


CLOSE_LEFT_BEHIND: list[str] = []  # pipelines whose close() never returned (see close_pipeline)


def close_pipeline(pipe: Any, grace: float = 10.0, limit: float = 60.0) -> None:
    """``pipe.close()`` that cannot hang a benchmark: lmdeploy 0.18's ``Pipeline.close`` at tp > 1
    on its mp executor never returned on the nvidia-h200-x2 (2026-12-01; plain lmdeploy, no
    featcache in the pipeline). A likely cause, not confirmed: that executor's output prefetch
    waits for rank 0's reply on a ``multiprocessing.Event`` in a thread of the event loop's
    pool, which nothing wakes once the loop stops.

    When ``close`` has not returned within ``grace`` seconds, every thread's stack goes to
    stderr (where it hangs, for the log), the executor's return-buffer events are set (what its
    own ``release`` does) and ``close`` gets ``limit`` more seconds. If it still hangs, the
    engine's model processes are terminated (their GPU memory freed for the next engine) and
    the pipeline is recorded in ``CLOSE_LEFT_BEHIND``: the script must then leave with
    ``os._exit`` (``exit_after_close``), as the pipeline's event-loop thread would block the
    interpreter's exit."""
    closer = threading.Thread(target=pipe.close, daemon=True, name="close-pipeline")
    closer.start()
    closer.join(grace)
    if not closer.is_alive():
        return
    import faulthandler

    print(f"[bench] pipeline close hangs after {grace:.0f} s; threads:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    engine = getattr(getattr(pipe, "async_engine", None), "engine", None)
    executor = getattr(engine, "executor", None)
    for buf in getattr(executor, "ret_bufs", ()):
        for event in buf.notifier.events:
            event.set()
    closer.join(limit)
    if not closer.is_alive():
        print("[bench] pipeline closed once the executor's events were set", flush=True)
        return
    print("[bench] pipeline close still hangs; its model processes are terminated", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    for proc in getattr(executor, "procs", ()):
        proc.close()
    for proc in getattr(executor, "procs", ()):
        proc.join()
    CLOSE_LEFT_BEHIND.append(type(pipe).__name__)


def exit_after_close(rc: int) -> None:
    """Leave a benchmark script with ``rc``: through ``os._exit`` when a pipeline's close was
    left behind (``close_pipeline``), whose event-loop thread would block the interpreter's exit."""
    if CLOSE_LEFT_BEHIND:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


def free_gpu() -> None:
    """After a pipeline is closed and dropped: collect it and give its GPU memory back."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
