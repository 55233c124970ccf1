"""lmdeploy's OpenAI-compatible api_server, run with featcache wrapped in (``featcache serve``).

lmdeploy's own argument parser and server code run (same flags, endpoints and behaviour), with
featcache installed on the engine the server builds. Two differences, both logged at start:

- the PyTorch engine runs in the server's process: ``lmdeploy serve api_server`` puts it in a
  second process (``enable_mp_engine``), but featcache's model hooks and its device tier must live
  in the process that runs the model, next to the frontend that looks images up;
- ``--enable-prefix-caching`` stays on for the supported VLMs (lmdeploy alone turns it off).

featcache's counters are exported on the server's ``/metrics`` (``featcache_*``, beside lmdeploy's)
unless ``--disable-metrics`` is given. ``--dp`` > 1 and ``--tp`` > 1 are refused (one tp=1 server per
GPU over a shared cache directory instead). The command line is ``featcache.cli.serving``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any

from .cache import FeatureCache
from .lmdeploy import SPECS, keep_prefix_caching, wrap

log = logging.getLogger("featcache")


def lmdeploy_parser() -> argparse.ArgumentParser:
    """lmdeploy's own ``serve api_server`` parser (built once per process)."""
    from lmdeploy.cli.serve import SubCliServe

    parsers = SubCliServe.subparsers.choices
    if "api_server" not in parsers:
        SubCliServe.add_parser_api_server()
    return parsers["api_server"]


def refusal(args: argparse.Namespace) -> str | None:
    """Why lmdeploy's parsed ``args`` cannot be served with featcache, or None."""
    if args.dp > 1:
        return "--dp > 1 starts one engine per process; run one `featcache serve` per GPU instead"
    if args.tp > 1:
        return ("featcache supports tp=1 (one GPU per engine, run in process); run one "
                "`featcache serve` per GPU over a shared --cache-dir")
    return None


def backend_of(args: argparse.Namespace) -> str:
    """The backend lmdeploy's handler will run ``args`` on ("pytorch" or "turbomind")."""
    from lmdeploy.archs import autoget_backend

    if args.backend == "pytorch":
        return "pytorch"
    backend: str = autoget_backend(args.model_path, trust_remote_code=args.trust_remote_code)
    return backend


def run_server(args: argparse.Namespace, cache: FeatureCache, namespace: str | None,
               trust_image_ids: bool = False) -> None:
    """Run lmdeploy's ``api_server`` handler for ``args`` (parsed by ``lmdeploy_parser``) until it
    stops, with featcache on its engine and, unless ``--disable-metrics``, on its ``/metrics``.
    The caller owns ``cache`` (and closes it)."""
    from lmdeploy.cli.serve import SubCliServe

    collector = export_metrics(cache) if not args.disable_metrics else None
    try:
        with featcache_engine(cache, namespace, trust_image_ids):
            SubCliServe.api_server(args)  # lmdeploy's handler: builds the server, runs uvicorn
    finally:
        if collector is not None:
            import prometheus_client

            prometheus_client.REGISTRY.unregister(collector)


def export_metrics(cache: FeatureCache) -> Any:
    """featcache's families on prometheus_client's registry (what lmdeploy serves on /metrics),
    with the hit-latency histogram recorded; the collector, or None without prometheus_client."""
    from .metrics import instrument, register

    try:
        collector = register(cache)
    except ImportError:
        log.warning("featcache: prometheus_client is not installed; /metrics has no featcache_* "
                    "counters (pip install 'featcache[metrics]')")
        return None
    instrument(cache)
    return collector


@contextlib.contextmanager
def featcache_engine(cache: FeatureCache, namespace: str | None,
                     trust_image_ids: bool = False) -> Iterator[None]:
    """While active, the engine lmdeploy's api_server builds runs in process with featcache.

    The hook is ``get_task`` as imported by ``lmdeploy.serve.openai.api_server``: its second value
    is the class the server instantiates; featcache hands back a factory that builds it with
    ``enable_mp_engine`` off (prefix caching kept as asked) and installs featcache on it.
    """
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai import api_server

    original = api_server.get_task

    def get_task(*a: Any, **k: Any) -> tuple[str, Any]:
        task, engine_class = original(*a, **k)

        def build(**kwargs: Any) -> Any:
            config = kwargs.get("backend_config")
            wanted = False
            if isinstance(config, PytorchEngineConfig):
                if config.enable_mp_engine:
                    log.warning("featcache serve: the PyTorch engine runs in the server's process "
                                "(featcache's hooks live with the model), not in a second one")
                config.enable_mp_engine = False
                wanted = bool(config.enable_prefix_caching)
            with keep_prefix_caching(wanted, supported=set(SPECS)):
                engine = engine_class(**kwargs)
            wrap(types.SimpleNamespace(async_engine=engine), cache, namespace=namespace,
                 trust_image_ids=trust_image_ids)
            engine.featcache = cache
            return engine

        return task, build

    api_server.get_task = get_task
    try:
        yield
    finally:
        api_server.get_task = original
