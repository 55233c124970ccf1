"""featcache for lmdeploy 0.18's PyTorch engine: ``pipeline()`` and ``wrap()``.

    from featcache.lmdeploy import pipeline
    pipe = pipeline("OpenGVLab/InternVL2_5-2B", backend_config=PytorchEngineConfig(
        enable_prefix_caching=True))             # same arguments as lmdeploy.pipeline
    pipe(("describe", image))

Supported architectures: the declarations of ``families.SPECS`` (InternVL, InternVL-HF, Intern-S1,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE variants), on the PyTorch engine; the
Qwen3 lineage through lmdeploy's processor-level preprocessing (``ProcessorFrontend``). Anything else
passes through untouched, with one log line. See docs/lmdeploy.md's support table.

Two modes, chosen from the engine config:
- one process (tp=1, ``enable_mp_engine`` off): the frontend looks each image up, and a hit skips
  preprocessing; its lease rides to the model (``FeatRef``);
- several processes (``enable_mp_engine=True``, tp > 1, or lmdeploy's mp or ray executor asked
  for at tp=1, which also spawns the model's process): every image is tagged
  (``FeatTag``); the first time it is preprocessed and sent with its pixels, after that as its
  bytes (``rebuild`` makes its pixels again where a model process lost it); each process that
  runs the model keeps its own cache (``ranks``) and skips the vision tower for the images every
  rank holds. ``pipeline()`` turns the engine config into a ``FeatcacheEngineConfig``
  (``processes``), which carries featcache into those processes.

Each response says what its request got from the cache: ``Response.featcache``, a
``RequestReport`` (``report``; what it covers in either mode: docs/cli.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import DEFAULT_DIR, DEFAULTS, EVICTIONS
from ..core.cache import FeatureCache
from .families import PARTIAL_IMAGES, PREFIX_CACHED
from .fastprep import widen
from .pytorch.budgets import EngineSizedCache, check_budgets, chosen_budgets, default_cache
from .pytorch.engine import KeyedInputProcessor, keep_prefix_caching
from .pytorch.models import SPECS, patch_model_class
from .pytorch.prefix import install_prefix_hook
from .request.frontend import SECTION, install_frontend
from .request.identity import model_identity
from .request.media import LOCAL_FILES, MediaPolicy
from .request.refs import FeatRef
from .request.report import RequestReport, install_reports
from .request.sources import read_sources_under
from .request.sources import trust_image_ids as trust_image_ids_on
from .request.tags import FeatTag
from .turbomind import wrap_turbomind

__all__ = ["DEFAULT_DIR", "PREFIX_CACHED", "SECTION", "SPECS", "FeatRef", "FeatTag", "MediaPolicy",
           "RequestReport", "chosen_budgets", "default_cache", "model_stats", "multi_process", "pipeline",
           "wrap"]

log = logging.getLogger("featcache")


def pipeline(model_path: str, *, cache: FeatureCache | None = None, namespace: str | None = None,
             turbomind: str = "native", trust_image_ids: bool | str = False,
             media_policy: MediaPolicy | None = None, budgets: str | None = None,
             eviction: str | None = None, **pipeline_kwargs: Any) -> Any:
    """``lmdeploy.pipeline(model_path, **pipeline_kwargs)`` with featcache wrapped in.

    Same arguments and return type. ``cache=None`` builds ``default_cache(budgets=budgets)``
    once the engine is built (closed with the pipeline; ``host_only`` when the backend is
    TurboMind): ``budgets="auto"`` sizes its device tier from what the engine's KV cache left
    (``chosen_budgets(pipe.featcache)`` says what each tier got and why; docs/tuning.md), and
    ``eviction`` ("admit", "value" or "lru"; None: the config's default) is what its memory tiers evict.
    ``enable_prefix_caching=True`` in a
    ``PytorchEngineConfig`` stays on for the supported models (lmdeploy alone turns it off for
    them). ``turbomind`` ("native", "features" or "combined"), ``trust_image_ids`` and ``media_policy``: see
    ``wrap``.

    Several processes (a ``PytorchEngineConfig`` with ``enable_mp_engine=True``, ``tp > 1``, or
    an mp or ray executor, see ``multi_process``):
    the config is handed to lmdeploy as a ``FeatcacheEngineConfig`` carrying ``cache``'s
    settings (``cache=None``: ``default_cache()``'s, sized in each model process); each process
    that runs the model builds its own cache from them, over the same disk directory. ``cache``
    itself (None: a counters-only cache) then only counts this process's frontend events.
    """
    import lmdeploy

    owned = cache is None
    built = {k: v for k, v in (("budgets", budgets), ("eviction", eviction)) if v is not None}
    if built and cache is not None:
        raise ValueError(f"{' and '.join(built)} set the cache pipeline() builds (cache=None); a "
                         "cache passed in keeps its own budgets and eviction")
    if budgets is not None:
        check_budgets(budgets)
    if eviction is not None and eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {', '.join(EVICTIONS)} (None: "
                         f"{DEFAULTS['eviction']}), not {eviction!r}")
    backend_config = pipeline_kwargs.get("backend_config")
    if multi_process(backend_config):
        from .pytorch.processes import FeatcacheEngineConfig, cache_settings

        settings = (cache_settings(cache) if cache is not None  # else the config's own, if any
                    else getattr(backend_config, "featcache_cache", None))
        if built:  # each model process builds its own
            if settings is not None:
                raise ValueError(f"{' and '.join(built)} and a FeatcacheEngineConfig's own "
                                 "featcache_cache: give them in its settings instead")
            settings = {"default_cache": built}
        backend_config = FeatcacheEngineConfig.of(backend_config, settings)
        pipeline_kwargs["backend_config"] = backend_config
        if cache is None:
            cache = counters_cache()
    wanted = bool(getattr(backend_config, "enable_prefix_caching", False)) and isinstance(
        backend_config, lmdeploy.PytorchEngineConfig)
    with keep_prefix_caching(wanted, supported=PREFIX_CACHED):
        pipe = lmdeploy.pipeline(model_path, **pipeline_kwargs)
    if cache is None:  # built once the engine is (lmdeploy may choose the backend)
        try:
            engine_config = getattr(pipe.async_engine, "backend_config", None)
            cache = default_cache(host_only=not isinstance(engine_config, lmdeploy.PytorchEngineConfig),
                                  budgets=budgets, eviction=eviction, engine=engine_config)
        except BaseException:
            pipe.close()
            raise
    wrap(pipe, cache, namespace=namespace, turbomind=turbomind, trust_image_ids=trust_image_ids,
         media_policy=media_policy)
    if owned:
        close = pipe.close

        def close_both() -> None:
            close()
            cache.close()

        pipe.close = close_both
    return pipe


def _executor_outside(backend: str | None) -> bool:
    """Whether lmdeploy 0.18's executor runs the model in processes of its own, at any tp:
    ``backend`` (the engine config's ``distributed_executor_backend``) or, when None,
    ``LMDEPLOY_EXECUTOR_BACKEND`` as lmdeploy read it at import; "mp" and "ray" spawn the model's
    processes even at tp=1, only "uni" (lmdeploy's choice at tp=1) runs it in the engine's."""
    if backend is None:
        from lmdeploy.pytorch import envs

        backend = envs.executor_backend
    return backend not in (None, "uni")


def multi_process(config: Any) -> bool:
    """Whether a PyTorch engine config runs the model outside the pipeline's process: the mp
    engine, tp > 1, or an executor asked for that spawns the model's processes (``mp`` or
    ``ray``, also at tp=1)."""
    from lmdeploy import PytorchEngineConfig

    return isinstance(config, PytorchEngineConfig) and (
        bool(config.enable_mp_engine) or config.tp > 1
        or _executor_outside(config.distributed_executor_backend))


def counters_cache() -> FeatureCache:
    """A cache that holds nothing (no tier has a budget): the frontend's counters in a process
    that does not run the model (several processes)."""
    return FeatureCache(device="cpu", device_bytes=0, host_bytes=0)


def model_stats(pipe: Any) -> list[dict[str, Any]]:
    """featcache's counters of every process that runs the pipeline's model, rank order: each a
    dict with ``rank``, ``pid`` and ``stats`` (that process's ``FeatureCache.stats()``). In one
    process: the pipeline's cache. Every rank makes the same vision calls, so each rank's
    ``stats["lmdeploy"]["vision_images"]`` counts the images whose features were computed."""
    engine = pipe.async_engine.engine
    if getattr(engine, "input_processor", None) is None:  # the mp engine: ask its process
        stats: list[dict[str, Any]] = engine._collective_rpc("featcache_stats")
        return stats
    if isinstance(engine.input_processor, KeyedInputProcessor) and multi_process(
            engine.engine_config):  # tp > 1 or an mp/ray executor, the driver here
        from .pytorch.processes import engine_stats

        return engine_stats(engine)
    return [{"rank": 0, "pid": os.getpid(), "stats": pipe.featcache.stats()}]


def wrap(pipe: Any, cache: FeatureCache, *, namespace: str | None = None,
         turbomind: str = "native", trust_image_ids: bool | str = False,
         media_policy: MediaPolicy | None = None) -> Any:
    """Install featcache on a pipeline built by ``lmdeploy.pipeline``; returns ``pipe``.

    A pipeline built without featcache has had prefix caching switched off by lmdeploy for these
    models; build it with ``featcache.lmdeploy.pipeline`` to keep it on. On TurboMind (a cache
    whose device is "cpu"), ``turbomind="native"`` caches engine-ready pixels, ``"features"``
    (InternVL) vision features, ``"combined"`` both, routed per request: see
    ``featcache.lmdeploy.turbomind``.
    ``trust_image_ids``: honour the ids clients give their images (``"uuid"``, see
    ``featcache.lmdeploy.request.sources``); only where every client may read every image.
    ``media_policy``: where local image files may lie and how many bytes any image source may
    have (``featcache.lmdeploy.request.media.MediaPolicy``); default ``media.LOCAL_FILES``, any file of
    the caller's, at most ``MEDIA_DEFAULTS["max_image_bytes"]``. featcache reads every image
    source under it, for an architecture it does not cache too (lmdeploy reads none). Each
    request of a model it caches is reported (``report.install_reports``: each ``Response``'s
    ``featcache``, a ``RequestReport``; the server's ``X-Featcache`` header). An
    ``EngineSizedCache`` (``default_cache(budgets="auto", before_engine=True)``) is sized here,
    from what this pipeline's engine left.
    """
    from lmdeploy import PytorchEngineConfig

    media = LOCAL_FILES if media_policy is None else media_policy
    engine = pipe.async_engine
    if isinstance(cache, EngineSizedCache):  # built before this engine: sized from what it left
        cache.size_after(getattr(engine, "backend_config", None))
    encoder = getattr(engine, "vl_encoder", None)
    if encoder is None or encoder.model is None:
        log.info("featcache: %s is not a vision-language pipeline; nothing to cache", pipe)
        return pipe
    hf_config = encoder.model.hf_config
    arch = hf_config.architectures[0]
    spec = SPECS.get(arch)
    if not isinstance(engine.backend_config, PytorchEngineConfig):  # TurboMind: turbomind.py
        return wrap_turbomind(pipe, cache, arch, namespace, turbomind, trust_image_ids, media)
    if spec is None or getattr(hf_config, "flash_mode", None):
        log.warning("featcache: architecture %s is not cached; it passes through untouched (its "
                    "image sources read under the media policy)", arch)
        read_sources_under(getattr(engine, "prompt_processor", None), media)
        return pipe
    widen(encoder)  # the preprocessing of different requests overlaps (``fastprep``)
    namespace = namespace or model_identity(
        encoder.model.model_path, arch, encoder.mm_feature_dtype, extra={})
    if getattr(engine.backend_config, "dp", 1) > 1:
        raise ValueError("featcache does not serve dp > 1 (one engine per data-parallel rank, "
                         "each in its own process group); run one pipeline per GPU instead")
    inner = getattr(engine.engine, "input_processor", None)
    if inner is None or multi_process(engine.backend_config):  # the model in other processes
        from .pytorch.processes import FeatcacheEngineConfig

        if not isinstance(engine.backend_config, FeatcacheEngineConfig):
            raise ValueError(
                "this pipeline's model runs in other processes (enable_mp_engine, tp > 1, or "
                "an mp or ray executor), "
                "which featcache reaches only through the engine config it was built with: "
                "build it with featcache.lmdeploy.pipeline(), or pass backend_config="
                "featcache.lmdeploy.pytorch.processes.FeatcacheEngineConfig.of(config, settings)")
        from .pytorch.processes import settings_hasher

        install_frontend(encoder.model, cache, namespace, engine.prompt_processor, tags=True,
                         hasher=settings_hasher(engine.backend_config.featcache_cache),
                         pack=inner is None)  # (the engine's input processor in another process)
        trust_image_ids_on(engine.prompt_processor, trust_image_ids)
        read_sources_under(engine.prompt_processor, media)
        install_reports(engine, "mp")
        pipe.featcache = cache
        log.info("featcache: caching %s image features in the model processes (namespace %s)",
                 arch, namespace)
        return pipe
    patch_model_class(spec)
    install_frontend(encoder.model, cache, namespace, engine.prompt_processor)
    trust_image_ids_on(engine.prompt_processor, trust_image_ids)
    read_sources_under(engine.prompt_processor, media)
    engine.engine.input_processor = KeyedInputProcessor(inner, spec.items, spec.token_rows)
    install_reports(engine, "in")
    if engine.backend_config.enable_prefix_caching and arch in PARTIAL_IMAGES:  # matches may end
        # inside held images
        remove_prefix_hook = install_prefix_hook()
        close = getattr(pipe, "close", None)
        if close is not None:  # else a server's engine (featcache serve): hooked for the process

            def close_and_unhook() -> None:
                try:
                    close()
                finally:
                    remove_prefix_hook()

            pipe.close = close_and_unhook
    pipe.featcache = cache
    log.info("featcache: caching %s image features (namespace %s)", arch, namespace)
    return pipe
