"""``featcache serve``: lmdeploy's OpenAI-compatible api_server with featcache wrapped in.

    featcache serve MODEL [--cache-dir DIR] [--device-bytes N] [--host-bytes N] [--disk-bytes N]
                          [--remote-url URL] [--namespace NS] [any `lmdeploy serve api_server` option]

lmdeploy's own argument parser and server code run (same flags, endpoints and behaviour), with
featcache installed on the engine the server builds. Two differences, both logged at start:

- the PyTorch engine runs in the server's process: ``lmdeploy serve api_server`` puts it in a
  second process (``enable_mp_engine``), but featcache's model hooks and its device tier must live
  in the process that runs the model, next to the frontend that looks images up;
- ``--enable-prefix-caching`` stays on for the supported VLMs (lmdeploy alone turns it off).

featcache's counters are exported on the server's ``/metrics`` (``featcache_*``, beside lmdeploy's)
unless ``--disable-metrics`` is given. ``--dp`` > 1 and ``--tp`` > 1 are refused (one tp=1 server per
GPU over a shared ``--cache-dir`` instead).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

from .sizes import parse_bytes

log = logging.getLogger("featcache")

USAGE = "featcache serve MODEL [featcache options] [lmdeploy serve api_server options]"


def featcache_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: lmdeploy's own flags (e.g. --device) must not pass for prefixes of ours
    p = argparse.ArgumentParser(prog="featcache serve", usage=USAGE, add_help=False, allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("featcache options (the rest are lmdeploy's, listed below)")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="store directory (default: $FEATCACHE_DIR, else ~/.cache/featcache)")
    for tier, default in [("device", "4%% of free GPU memory, at most 2GiB"),
                          ("host", "10%% of RAM, at most 8GiB"),
                          ("disk", "half the free space, at most 32GiB")]:
        g.add_argument(f"--{tier}-bytes", type=_bytes, metavar="N",
                       help=f"{tier} tier budget, e.g. 2GiB (default: {default})")
    g.add_argument("--remote-url", metavar="URL",
                   help="a shared remote tier: redis://[:password@]host:6379/0, rediss://..., "
                   "redis-cluster://node:port (default: none; docs/tuning.md)")
    g.add_argument("--namespace", metavar="NS",
                   help="key namespace (default: derived from the model, its dtype and version)")
    return p


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def lmdeploy_parser() -> argparse.ArgumentParser:
    """lmdeploy's own ``serve api_server`` parser (built once per process)."""
    from lmdeploy.cli.serve import SubCliServe

    parsers = SubCliServe.subparsers.choices
    if "api_server" not in parsers:
        SubCliServe.add_parser_api_server()
    return parsers["api_server"]


def main(argv: list[str]) -> int:
    ours, rest = featcache_parser().parse_known_args(argv)
    if not rest or "-h" in rest or "--help" in rest:
        featcache_parser().print_help()
        print("\nlmdeploy serve api_server options:\n")
        lmdeploy_parser().print_help()
        return 0 if rest else 2
    args = lmdeploy_parser().parse_args(rest)
    refusal = _refusal(args)
    if refusal:
        print(f"featcache serve: error: {refusal}", file=sys.stderr)
        return 2
    from lmdeploy.archs import autoget_backend
    from lmdeploy.cli.serve import SubCliServe

    from .errors import FeatCacheError
    from .lmdeploy import default_cache

    backend = args.backend  # as lmdeploy's handler decides it
    if backend != "pytorch":
        backend = autoget_backend(args.model_path, trust_remote_code=args.trust_remote_code)
    try:
        cache = default_cache(path=ours.cache_dir, device_bytes=ours.device_bytes,
                              host_bytes=ours.host_bytes, disk_bytes=ours.disk_bytes,
                              host_only=backend == "turbomind",  # TurboMind takes host tensors
                              remote_url=ours.remote_url)
    except (FeatCacheError, TypeError, ValueError) as e:  # e.g. a --disk-bytes it cannot map
        print(f"featcache serve: error: {e}", file=sys.stderr)
        return 1
    collector = _export_metrics(cache) if not args.disable_metrics else None
    try:
        with featcache_engine(cache, ours.namespace):
            SubCliServe.api_server(args)  # lmdeploy's handler: builds the server, runs uvicorn
    finally:
        if collector is not None:
            import prometheus_client

            prometheus_client.REGISTRY.unregister(collector)
        cache.close()
    return 0


def _refusal(args: argparse.Namespace) -> str | None:
    if args.dp > 1:
        return "--dp > 1 starts one engine per process; run one `featcache serve` per GPU instead"
    if args.tp > 1:
        return ("featcache supports tp=1 (one GPU per engine, run in process); run one "
                "`featcache serve` per GPU over a shared --cache-dir")
    return None


def _export_metrics(cache: Any) -> Any:
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
def featcache_engine(cache: Any, namespace: str | None) -> Iterator[None]:
    """While active, the engine lmdeploy's api_server builds runs in process with featcache.

    The hook is ``get_task`` as imported by ``lmdeploy.serve.openai.api_server``: its second value
    is the class the server instantiates; featcache hands back a factory that builds it with
    ``enable_mp_engine`` off (prefix caching kept as asked) and installs featcache on it.
    """
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai import api_server

    from .lmdeploy import SPECS, keep_prefix_caching, wrap

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
            wrap(types.SimpleNamespace(async_engine=engine), cache, namespace=namespace)
            engine.featcache = cache
            return engine

        return task, build

    api_server.get_task = get_task
    try:
        yield
    finally:
        api_server.get_task = original
