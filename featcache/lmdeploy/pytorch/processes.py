"""The multi-process mode's engine side: how featcache reaches lmdeploy's engine process and ranks.

lmdeploy 0.18 starts its engine in a spawned child (``enable_mp_engine``, what ``api_server``
uses) and, with tp > 1, the model in one spawned process per rank; patches made in the
pipeline's process are not there. Two channels carry featcache (docs/multi-gpu.md):

- ``FeatcacheEngineConfig``, a ``PytorchEngineConfig`` subclass defined here. The mp engine
  pickles the config to its child, which unpickles it (importing this module, which installs the
  hooks below) before it builds the ``Engine``;
- the model config's ``custom_module_map``: lmdeploy's model agent runs that file in every rank
  before building the model (``model_agent/agent.py`` ``_build_model`` ->
  ``models/patch.py`` ``update_custom_module_map``). Nothing in lmdeploy 0.18 sets it (the
  engine config's ``custom_module_map`` goes to ``MiscConfig`` only), so while an ``Engine`` is
  built with a ``FeatcacheEngineConfig`` the driver's ``ModelConfig.from_pretrained`` gets it set
  to a small generated file that calls ``install_in_rank`` with the cache settings. The model
  config is pickled to every rank (uni, mp and ray executors alike).

Hooks installed on import (class level; they act only for an ``Engine`` built with a
``FeatcacheEngineConfig`` and ``enable_mp_engine`` off, i.e. in the process that holds the
scheduler): the engine's input processor is wrapped (``KeyedInputProcessor``: the tag rides in
``MultiModalData.meta``, the key in ``content_hash``); with prefix caching on, the prefix hook
(``prefix``) is installed for the engine's life; ``EngineWorkerBase.featcache_stats`` (an RPC
method of the mp engine) returns every model process's counters.

A user-set ``custom_module_map`` is kept (lmdeploy 0.18 never applies it anyway: see above).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from lmdeploy.messages import PytorchEngineConfig, ResponseType

from ...keys import KeyHasher
from ..families import PARTIAL_IMAGES, TOKEN_ROWS
from ..request.frontend import SECTION
from . import ranks, rankstats
from .engine import KeyedInputProcessor, unservable
from .models import SPECS, patch_model_class
from .prefix import install_prefix_hook

log = logging.getLogger("featcache")

RANK_HOOK = "featcache_rank_hook.py"  # the generated module-map file's name


@dataclasses.dataclass
class FeatcacheEngineConfig(PytorchEngineConfig):
    """lmdeploy's ``PytorchEngineConfig`` plus the cache settings of the processes that run the
    model (JSON-able; the device is each process's own GPU): ``{"feature_cache": kwargs}`` (a
    ``FeatureCache``'s, see ``cache_settings``), ``{"default_cache": kwargs}``
    (``featcache.lmdeploy.default_cache()``'s: budgets sized from each process's machine), or
    None (``default_cache()``)."""

    featcache_cache: dict[str, Any] | None = None

    @classmethod
    def of(cls, config: PytorchEngineConfig | None,
           cache: dict[str, Any] | None) -> FeatcacheEngineConfig:
        """``config``'s settings (None: lmdeploy's defaults) with ``cache`` added."""
        if config is None:
            return cls(featcache_cache=cache)
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        values["featcache_cache"] = cache
        return cls(**values)


def cache_settings(cache: Any) -> dict[str, Any]:
    """The ``featcache_cache`` settings that rebuild ``cache``'s tiers in a model process (its
    device left to that process)."""
    values = dataclasses.asdict(cache.config)
    values.pop("device", None)
    return {"feature_cache": values}


def settings_hasher(settings: dict[str, Any] | None) -> KeyHasher:
    """The ``KeyHasher`` of the caches built from ``featcache_cache`` settings (``ranks``): the
    frontend of the multi-process mode keys with the model processes' store's secret, so that
    its keys are theirs across restarts (``featcache.keysecret``)."""
    from ...config import CacheConfig, default_store_dir
    from ...keysecret import hasher_for

    if settings is not None and "feature_cache" in settings:
        values = dict(settings["feature_cache"])
    else:
        options = dict((settings or {}).get("default_cache", {}))
        values = {"disk_path": options.get("path") or default_store_dir(),
                  "remote_url": options.get("remote_url")}
        values.update({k: options[k] for k in ("key_algorithm", "key_secret_file") if k in options})
    keep = {"disk_path", "remote_url", "remote_prefix", "remote_timeout_ms", "remote_tls_ca_file",
            "remote_tls_cert_file", "remote_tls_key_file", "key_algorithm", "key_secret_file"}
    disk_path = values.pop("disk_path", None)
    options = {k: v for k, v in values.items() if k in keep}
    return hasher_for(CacheConfig.create("cpu", 0, 0, disk_path, **options))


# -- the rank hook file --------------------------------------------------------------------------
def rank_settings(config: FeatcacheEngineConfig, model_path: str,
                  trust_remote_code: bool) -> dict[str, Any]:
    """The model processes' settings: the cache's (``featcache_cache``), under ``rebuild`` what
    rebuilds an image's pixels as the frontend's process makes them (``rebuild``), and under
    ``engine`` the engine's KV-cache reservation (the reason of budgets sized after it)."""
    settings = dict(config.featcache_cache or {})
    settings["engine"] = {"cache_max_entry_count": config.cache_max_entry_count,
                          "num_gpu_blocks": config.num_gpu_blocks}
    settings["rebuild"] = {"model_path": model_path, "dtype": config.dtype,
                           "device_type": config.device_type,
                           "trust_remote_code": bool(trust_remote_code)}
    return settings


def rank_hook_file(settings: dict[str, Any] | None) -> str:
    """A new module-map file that installs featcache in a model process with ``settings``, alone
    in a new private folder (lmdeploy adds it to ``sys.path``; the model processes open their
    counters' sockets there, ``rankstats``), one per engine; removed at exit."""
    folder = tempfile.mkdtemp(prefix="featcache-rank-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, RANK_HOOK)
    with open(path, "w") as f:
        f.write(_RANK_HOOK_SOURCE.format(settings=repr(json.dumps(settings, sort_keys=True))))
    return path


_RANK_HOOK_SOURCE = '''\
# Generated by featcache (featcache.lmdeploy.pytorch.processes): lmdeploy runs this file in every model
# process before building the model (custom_module_map). It maps no modules; it installs
# featcache's model hooks. It must never stop the engine from starting.
CUSTOM_MODULE_MAP = {{}}
try:
    import os

    from featcache.lmdeploy.pytorch.processes import install_in_rank

    install_in_rank({settings}, os.path.dirname(os.path.abspath(__file__)))
except Exception:  # an engine without featcache: every image computed
    import logging

    logging.getLogger("featcache").exception("featcache: not installed in this model process")
'''


def install_in_rank(settings_json: str, folder: str | None = None) -> None:
    """Run by the rank hook file in each model process: ``folder`` is the hook file's, where this
    process answers for its counters (``rankstats``; None: it does not)."""
    ranks.configure(settings_json)
    for spec in SPECS.values():
        patch_model_class(spec)
    if folder is not None:
        try:
            rankstats.serve(folder, ranks.stats)
        except OSError:  # counters unreadable from outside; the features still served
            log.warning("featcache: this model process's counters are not readable from the "
                        "engine (socket in %s)", folder, exc_info=True)
    log.info("featcache: serving cached image features in this model process (pid %d)", os.getpid())


# -- the driver-side hooks (installed on import) -------------------------------------------------
_build_lock = threading.Lock()


@contextlib.contextmanager
def _module_map(path: str) -> Iterator[None]:
    """While building an engine: the target model's ``ModelConfig`` names ``path`` as its
    ``custom_module_map`` (so every rank runs it)."""
    from lmdeploy.pytorch.config import ModelConfig

    original = ModelConfig.__dict__["from_pretrained"]

    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        config = original.__func__(cls, *args, **kwargs)
        if not kwargs.get("is_draft_model") and config.custom_module_map is None:
            config.custom_module_map = path
        return config

    with _build_lock:
        ModelConfig.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            ModelConfig.from_pretrained = original  # type: ignore[method-assign]


def engine_stats(engine: Any) -> list[dict[str, Any]]:
    """Every model process's counters (``ranks.stats()``), rank order. Each process that ran the
    rank hook answers on its socket in the engine's hook folder (``rankstats``): the ranks of an
    mp or ray executor (at tp=1 too: the model then runs in a process of its own), or this one
    under lmdeploy's in-process executor. Never read through lmdeploy's executor, whose return
    buffers the running engine reads. Without answers (no hook folder, or no socket opened):
    this process's counters."""
    folder = getattr(engine, "featcache_folder", None)
    answers = rankstats.gather(folder) if folder is not None else []
    return answers or [ranks.stats()]


def _install() -> None:
    from lmdeploy.pytorch.engine import engine as engine_module
    from lmdeploy.pytorch.engine.mp_engine.base_worker import EngineWorkerBase

    cls = engine_module.Engine
    original = cls.__init__
    if getattr(original, "_featcache", False):
        return

    def __init__(self: Any, model_path: str, engine_config: Any = None, *args: Any,
                 **kwargs: Any) -> None:
        if not isinstance(engine_config, FeatcacheEngineConfig) or engine_config.enable_mp_engine:
            original(self, model_path, engine_config, *args, **kwargs)
            return
        hook = rank_hook_file(rank_settings(engine_config, model_path, kwargs.get(
            "trust_remote_code", args[0] if args else False)))
        self.featcache_folder = os.path.dirname(hook)
        with _module_map(hook):
            original(self, model_path, engine_config, *args, **kwargs)
        hf_config = getattr(getattr(self, "model_config", None), "hf_config", None)
        arch = (getattr(hf_config, "architectures", None) or [None])[0]
        self.input_processor = KeyedInputProcessor(self.input_processor, token_rows=arch in TOKEN_ROWS)
        if engine_config.enable_prefix_caching and arch in PARTIAL_IMAGES:
            remove = install_prefix_hook()
            close = self.close

            def close_and_unhook() -> None:
                try:
                    close()
                finally:
                    remove()

            self.close = close_and_unhook
        log.info("featcache: engine built with featcache (tags served by the model processes)")

    __init__._featcache = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]

    add_message = cls._on_add_message

    def _on_add_message(self: Any, reqs: list[Any], **kwargs: Any) -> Any:
        """lmdeploy's, for the requests whose images can be served; a request with an image
        that cannot (``unservable``) is answered with an error alone, before it is scheduled."""
        if isinstance(getattr(self, "input_processor", None), KeyedInputProcessor):
            kept = []
            for req in reqs:
                why = unservable((getattr(req, "data", None) or {}).get("input_multimodals"))
                if why is None:
                    kept.append(req)
                    continue
                log.error("%s; the request fails, the engine goes on", why)
                ranks_cache = ranks.local_cache()
                if ranks_cache is not None:
                    ranks_cache.count(SECTION, "unservable_requests")
                self._response(req.resp, ResponseType.INTERNAL_ENGINE_ERROR, err_msg=why)
            reqs = kept
        return add_message(self, reqs, **kwargs)

    _on_add_message.__wrapped__ = add_message  # type: ignore[attr-defined]
    cls._on_add_message = _on_add_message  # type: ignore[method-assign]

    def featcache_stats(self: Any) -> list[dict[str, Any]]:
        """featcache's counters of every model process (an RPC method of the mp engine)."""
        return engine_stats(self.engine)

    EngineWorkerBase.featcache_stats = featcache_stats  # type: ignore[attr-defined]


_install()
