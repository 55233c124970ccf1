"""lmdeploy's OpenAI-compatible api_server, run with featcache wrapped in (``featcache serve``).

lmdeploy's own argument parser and server code run (same flags, endpoints and behaviour), with
featcache installed on the engine the server builds. Differences, logged at start:

- where the PyTorch engine runs (``engine_process``): ``"mp"`` (the default) keeps lmdeploy's
  own process model (``enable_mp_engine``: the engine in a second process), where the engine
  process serves the features (featcache's multi-process mode, ``featcache.lmdeploy.pytorch.processes``;
  an image sent before travels without pixels); ``"in"`` runs it in the server's process, so the
  frontend that looks images up sits next to the model (the default with client image ids,
  ``engine_process_for``). ``--tp`` > 1 always runs in the multi-process mode (the ranks are
  processes of their own), in either engine process;
- ``--enable-prefix-caching`` stays on for the supported VLMs (lmdeploy alone turns it off);
- featcache reads every image source a request names, under a ``MediaPolicy``
  (``featcache.lmdeploy.request.media``): local files only under ``--allowed-local-media-path`` (none
  without it), regular files only, at most ``--max-image-bytes`` of any source; lmdeploy reads
  none itself;
- each response says what its request got from the cache: the ``X-Featcache`` header, and with
  ``--featcache-report usage`` the ``featcache`` member of its ``usage`` object
  (``featcache.server.report``).

featcache's counters are exported on the server's ``/metrics`` (``featcache_*``, beside lmdeploy's)
unless ``--disable-metrics`` is given; in the multi-process mode those are the frontend's, and
each model process's own cache is exported beside them as ``featcache_model_*{rank}`` (read
from the engine at every scrape: ``featcache.lmdeploy.model_stats``). ``--dp`` > 1 is
refused (one server per GPU over a shared cache directory instead); ``--tp`` > 1 on TurboMind is
served with a warning (``caveat``: not yet run on GPUs). ``--turbomind features|combined`` picks
featcache's TurboMind path (``wrap``'s ``turbomind``; native by default), refused at start on the
PyTorch engine or for an architecture the features path cannot serve (``turbomind_refusal``).
The command line is ``featcache.cli.serving``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

from ..config import ENGINE_PROCESSES, REPORTS
from ..core.cache import FeatureCache
from ..lmdeploy import PREFIX_CACHED, keep_prefix_caching, multi_process, wrap
from ..lmdeploy.request.media import MediaPolicy
from ..lmdeploy.turbomind import PATHS
from ..warm import loading

TURBOMIND_PATHS = tuple(PATHS)  # "native" (the default), "features", "combined"

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
        return ("--dp > 1: lmdeploy then launches one api_server process per data-parallel rank "
                "(launch_server) over the ray executor, where featcache's server hooks, installed "
                "in this process, do not reach; run one `featcache serve` per GPU over a shared "
                "--cache-dir (behind lmdeploy's proxy) instead")
    return None


def caveat(args: argparse.Namespace, backend: str) -> str | None:
    """What the server should say at start about ``args`` on ``backend``, or None. TurboMind at
    tp > 1: featcache's part (the prompt path, before the engine) does not depend on TurboMind's
    tensor parallelism, which stays inside its one process, but it has run at tp=1 only."""
    if args.tp > 1 and backend == "turbomind":
        return ("featcache's TurboMind path has run on GPUs at --tp 1 only; at --tp "
                f"{args.tp} it works the same way (before the engine) but is not verified yet")
    return None


def turbomind_refusal(path: str, backend: str, args: argparse.Namespace) -> str | None:
    """Why ``--turbomind path`` cannot serve lmdeploy's parsed ``args`` on ``backend``, or None:
    a path other than "native" on the PyTorch engine (the paths are TurboMind's), or features and
    combined for an architecture the features path cannot serve (``wrap``'s own message,
    ``turbomind.features.check_features_arch``, said before the engine is built rather than when it is).
    """
    if path == "native":
        return None
    if path not in TURBOMIND_PATHS:
        return f"--turbomind is one of {', '.join(TURBOMIND_PATHS)}, not {path!r}"
    if backend != "turbomind":
        return (f"--turbomind {path} picks a path of the TurboMind backend, and this model is "
                f"served on {backend} (--backend {backend}, or lmdeploy's choice when TurboMind "
                "cannot run it here); give --backend turbomind, or leave --turbomind out")
    from lmdeploy.archs import get_model_arch

    from ..lmdeploy.turbomind.features import check_features_arch

    try:
        arch, _ = get_model_arch(args.model_path, trust_remote_code=args.trust_remote_code)
    except Exception:  # noqa: BLE001 (a config lmdeploy cannot read: wrap judges it at the build)
        return None
    try:
        check_features_arch(arch)
    except ValueError as e:
        return f"--turbomind {path}: {e}".replace("turbomind='native'", "--turbomind native")
    return None


def engine_process_for(trust_image_ids: bool) -> str:
    """``--engine-process``'s default: lmdeploy's own process model ("mp"), but the server's
    process ("in") where clients may name images by id alone: a hit on an id carries no bytes
    from which an engine process that lost the features could rebuild the image's pixels."""
    return "in" if trust_image_ids else ENGINE_PROCESSES[0]


def multi_process_args(args: argparse.Namespace, backend: str, engine_process: str) -> bool:
    """Whether ``args`` run the model outside the server's process (featcache's multi-process
    mode): the PyTorch engine with ``engine_process`` "mp", ``--tp`` > 1, or an executor that
    spawns the model's processes (``--distributed-executor-backend`` or
    ``LMDEPLOY_EXECUTOR_BACKEND`` mp or ray, also at tp=1)."""
    from lmdeploy import PytorchEngineConfig

    # the engine config's settings that decide it, judged by the one rule (``multi_process``)
    return backend == "pytorch" and multi_process(PytorchEngineConfig(
        tp=args.tp, enable_mp_engine=engine_process == "mp",
        distributed_executor_backend=getattr(args, "distributed_executor_backend", None)))


def backend_of(args: argparse.Namespace) -> str:
    """The backend lmdeploy's handler will run ``args`` on ("pytorch" or "turbomind")."""
    from lmdeploy.archs import autoget_backend

    if args.backend == "pytorch":
        return "pytorch"
    backend: str = autoget_backend(args.model_path, trust_remote_code=args.trust_remote_code)
    return backend


def run_server(args: argparse.Namespace, cache: FeatureCache, namespace: str | None,
               trust_image_ids: bool | str = False, engine_process: str = ENGINE_PROCESSES[0],
               model_cache: dict[str, Any] | None = None,
               media_policy: MediaPolicy | None = None, report: str = REPORTS[0],
               turbomind: str = TURBOMIND_PATHS[0]) -> None:
    """Run lmdeploy's ``api_server`` handler for ``args`` (parsed by ``lmdeploy_parser``) until it
    stops, with featcache on its engine and, unless ``--disable-metrics``, on its ``/metrics``.
    The caller owns ``cache`` (and closes it). ``engine_process``, ``model_cache`` (the
    multi-process mode's model-side cache settings) and ``media_policy``: see
    ``featcache_engine``. ``report``: what each response says of what its request got from the
    cache (``serve_report.REPORTS``: the ``X-Featcache`` header, also ``usage.featcache``, or
    nothing). ``turbomind``: featcache's path on a TurboMind engine (``wrap``'s; the PyTorch
    engine ignores it). SIGINT and SIGTERM stop the process within ``shutdown.DEADLINE_S``, the caller's
    close of ``cache`` included (``shutdown.bounded_shutdown``)."""
    from lmdeploy.cli.serve import SubCliServe

    from .report import reporting_app
    from .shutdown import Watchdog, bounded_shutdown, queued_writes

    engines: list[Any] = []  # the engine, once built, where the model runs in other processes
    collector = None
    if not args.disable_metrics:
        collector = export_metrics(cache, lambda: model_processes(engines))
    try:
        with bounded_shutdown(Watchdog(pending=lambda: queued_writes(cache))), \
                featcache_engine(cache, namespace, trust_image_ids, engine_process, model_cache,
                                 engines, media_policy, turbomind), reporting_app(report):
            SubCliServe.api_server(args)  # lmdeploy's handler: builds the server, runs uvicorn
    finally:
        if collector is not None:
            import prometheus_client

            prometheus_client.REGISTRY.unregister(collector)


def model_processes(engines: list[Any]) -> list[dict[str, Any]]:
    """The counters of the processes that run the model of the engine in ``engines`` (none before
    it is built, or where it runs in this process): ``featcache.lmdeploy.model_stats``."""
    if not engines:
        return []
    from ..lmdeploy import model_stats

    return model_stats(types.SimpleNamespace(async_engine=engines[-1]))


def export_metrics(cache: FeatureCache,
                   processes: Callable[[], list[dict[str, Any]]] | None = None) -> Any:
    """featcache's families on prometheus_client's registry (what lmdeploy serves on /metrics),
    with the hit-latency histogram recorded, and ``processes``' (the model processes' counters,
    ``featcache_model_*{rank}``); the collector, or None without prometheus_client."""
    from ..metrics import instrument, register

    try:
        collector = register(cache, processes=processes)
    except ImportError:
        log.warning("featcache: prometheus_client is not installed; /metrics has no featcache_* "
                    "counters (pip install 'featcache[metrics]')")
        return None
    instrument(cache)
    return collector


@contextlib.contextmanager
def featcache_engine(cache: FeatureCache, namespace: str | None,
                     trust_image_ids: bool | str = False, engine_process: str = ENGINE_PROCESSES[0],
                     model_cache: dict[str, Any] | None = None,
                     engines: list[Any] | None = None,
                     media_policy: MediaPolicy | None = None,
                     turbomind: str = TURBOMIND_PATHS[0]) -> Iterator[None]:
    """While active, the engine lmdeploy's api_server builds has featcache.

    The hook is ``get_task`` as imported by ``lmdeploy.serve.openai.api_server``: its second value
    is the class the server instantiates; featcache hands back a factory that builds it (prefix
    caching kept as asked) and installs featcache on it. ``engine_process`` "in": the PyTorch
    engine runs in this process (``enable_mp_engine`` off); "mp": where lmdeploy puts it. In the
    multi-process mode (``multi_process``) the engine config becomes a ``FeatcacheEngineConfig``
    with ``model_cache`` as its model processes' cache settings, and the engine built is appended
    to ``engines`` (``model_processes`` reads its counters). ``media_policy``: what the server
    reads of the images requests name (None: ``MediaPolicy()``, no local files, the default
    byte cap; unlike the Python API's default, which reads any file). ``turbomind``: featcache's
    path on a TurboMind engine ("native", "features" or "combined": ``wrap``'s ``turbomind``).
    """
    if engine_process not in ENGINE_PROCESSES:
        raise ValueError(f"engine_process is one of {ENGINE_PROCESSES}, not {engine_process!r}")
    if turbomind not in TURBOMIND_PATHS:
        raise ValueError(f"turbomind is one of {TURBOMIND_PATHS}, not {turbomind!r}")
    from lmdeploy import PytorchEngineConfig
    from lmdeploy.serve.openai import api_server

    from ..threads import share_cores

    original = api_server.get_task
    media = MediaPolicy() if media_policy is None else media_policy

    def get_task(*a: Any, **k: Any) -> tuple[str, Any]:
        model = str(k.get("model_path", a[1] if len(a) > 1 else "?"))
        with loading(model):  # a model lmdeploy cannot load: one line naming it (ModelLoadError)
            task, engine_class = original(*a, **k)

        def build(**kwargs: Any) -> Any:
            config = kwargs.get("backend_config")
            wanted = elsewhere = False
            if isinstance(config, PytorchEngineConfig):
                if engine_process == "in":
                    if config.enable_mp_engine:
                        log.warning("featcache serve: the PyTorch engine runs in the server's "
                                    "process (--engine-process in), not in a second one")
                    config.enable_mp_engine = False
                    share_cores()  # the engine and the preprocessing share this process's cores
                wanted = bool(config.enable_prefix_caching)
                elsewhere = multi_process(config)
                if elsewhere:
                    from ..lmdeploy.pytorch.processes import FeatcacheEngineConfig

                    kwargs["backend_config"] = FeatcacheEngineConfig.of(config, model_cache)
            with keep_prefix_caching(wanted, supported=PREFIX_CACHED), \
                    loading(str(kwargs.get("model_path", model))):
                engine = engine_class(**kwargs)
            if elsewhere and engines is not None:
                engines.append(engine)
            wrap(types.SimpleNamespace(async_engine=engine), cache, namespace=namespace,
                 trust_image_ids=trust_image_ids, media_policy=media, turbomind=turbomind)
            engine.featcache = cache
            return engine

        return task, build

    api_server.get_task = get_task
    try:
        yield
    finally:
        api_server.get_task = original
