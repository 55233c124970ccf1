"""``featcache warm`` for a TurboMind server: fill a store with what a TurboMind path serves, without
building TurboMind's engine.

What each path serves is made before the engine, on lmdeploy's prompt path (``ImageEncoder`` +
``MultimodalProcessor``, backend "turbomind"), so that is all warm builds, with featcache's path
installed on it exactly as ``wrap`` installs it on a server (same hooks, same namespaces):

- ``native``: engine-ready pixels (lmdeploy's own preprocessing, on the CPU), keyed under the
  native path's namespace. Needs no GPU;
- ``features``: the features path's vision features: the checkpoint's vision tower (``features_tower``)
  runs on the GPU when there is one, else on the CPU (correct, slow: minutes per 13-tile image for
  InternViT-300M on a few cores; the InternViT-6B of InternVL2-26B needs the GPU);
- ``combined``: both (every image's pixels and features: ``CombinedServer.force``).

The namespaces need TurboMind's resolved dtypes (the engine's and its vision model's), which the
engine computes from the checkpoint's config and what its GEMMs can execute
(``lmdeploy/turbomind/converter.py``: ``_resolve_dtype``, ``get_tm_config``). Without the engine
(its module cannot load without CUDA) ``resolved_dtypes`` applies the same rule, taking both
bfloat16 and float16 as executable (any GPU since Ampere, the H200 included) unless this machine's
GPU says otherwise. On a machine without CUDA, lmdeploy's prompt path asks CUDA two questions while
it is built (``torch.cuda.mem_get_info`` for a memory limit TurboMind's native-vision models never
use, and ``is_bf16_supported``); ``prompt_path`` answers them as such a server's GPU would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from ...core.cache import FeatureCache
from . import PATHS
from .combined import CombinedServer
from .route import FEATURES

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def executable_dtypes() -> set[str]:
    """The engine dtypes TurboMind can run here: both on a bfloat16-capable GPU, and where there
    is no GPU (warming for a server's: assumed Ampere or newer); float16 on an older GPU."""
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return {"float16"}
    return {"bfloat16", "float16"}


def resolve_dtype(requested: str, config: Any, executable: set[str]) -> str:
    """lmdeploy 0.18's ``converter._resolve_dtype``, the same rule: ``requested`` unless "auto",
    then the config's own (its ``text_config`` / ``llm_config`` where it has one) if executable,
    else bfloat16 if executable, else float16."""
    dtype: str | None = requested
    if dtype == "auto":
        if getattr(config, "text_config", None):
            config = config.text_config
        elif getattr(config, "llm_config", None):
            config = config.llm_config
        config_dtype = getattr(config, "dtype", None)
        if config_dtype is None:
            config_dtype = getattr(config, "torch_dtype", None)
        dtype = _DTYPE_NAMES.get(config_dtype) if isinstance(config_dtype, torch.dtype) else None
        if dtype not in executable:
            dtype = "bfloat16" if "bfloat16" in executable else "float16"
    if dtype not in executable:
        dtype = "float16"
    assert dtype is not None
    return dtype


def resolved_dtypes(model_path: str, requested: str = "auto",
                    trust_remote_code: bool = False) -> tuple[str, torch.dtype | None]:
    """The TurboMind engine's dtype name and its vision model's dtype (None without a
    ``vision_config``) for ``requested`` (``TurbomindEngineConfig.dtype``), as ``get_tm_config``
    resolves them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    executable = executable_dtypes()
    engine = resolve_dtype(requested, config, executable)
    vision = getattr(config, "vision_config", None)
    return engine, None if vision is None else getattr(torch, resolve_dtype(requested, vision,
                                                                            executable))


@contextlib.contextmanager
def _as_a_gpu_server() -> Iterator[None]:
    """Without CUDA: answer the two questions lmdeploy's TurboMind prompt path asks CUDA while it is
    built, as a GPU server's would (no memory limit is used; bfloat16 is supported)."""
    if torch.cuda.is_available():
        yield
        return
    import lmdeploy.vl.engine as vl_engine

    saved = torch.cuda.mem_get_info, vl_engine.is_bf16_supported
    torch.cuda.mem_get_info = lambda *a, **k: (0, 0)  # type: ignore[assignment]
    vl_engine.is_bf16_supported = lambda *a, **k: True
    try:
        yield
    finally:
        torch.cuda.mem_get_info, vl_engine.is_bf16_supported = saved  # type: ignore[assignment]


class PromptPath:
    """lmdeploy's TurboMind prompt path for ``model`` with featcache's ``path`` installed over
    ``cache`` (a host cache), as a server's; ``send(requests)`` runs requests through it, up to
    what TurboMind would be handed, which is dropped."""

    def __init__(self, model: str, cache: FeatureCache, path: str, dtype: str = "auto",
                 batch: int = 8) -> None:
        from lmdeploy.messages import TurbomindEngineConfig, VisionConfig
        from lmdeploy.model import get_chat_template
        from lmdeploy.serve.processors.multimodal import MultimodalProcessor
        from lmdeploy.tokenizer import Tokenizer
        from lmdeploy.vl.engine import ImageEncoder

        from . import wrap_turbomind

        if path not in PATHS:
            raise ValueError(f"turbomind path must be one of {PATHS}, not {path!r}")
        remote = _remote_code(model)
        engine_dtype, vision_dtype = resolved_dtypes(model, dtype, remote)
        config = TurbomindEngineConfig(dtype=engine_dtype)  # resolved, as get_tm_config leaves it
        with _as_a_gpu_server():
            self.encoder = ImageEncoder(model, "turbomind", VisionConfig(max_batch_size=batch),
                                        backend_config=config, trust_remote_code=remote)
        self.processor = MultimodalProcessor(Tokenizer(model), get_chat_template(
            model, None, trust_remote_code=remote), vl_encoder=self.encoder, backend="turbomind")
        vision = _VisionDtype(vision_dtype)  # what engine_vision_dtype reads off a TurboMind
        engine = _Engine(self.encoder, self.processor, config, vision)
        wrap_turbomind(_Pipe(engine), cache, self.encoder.model.hf_config.architectures[0], None, path)
        if not getattr(self.encoder.model.preprocess, "_featcache", False):
            arch = self.encoder.model.hf_config.architectures[0]
            self.close()
            raise ValueError(f"featcache does not cache {arch} on TurboMind: nothing to warm")
        server = getattr(self.encoder.model.forward, "__self__", None)
        if isinstance(server, CombinedServer):
            server.force = FEATURES  # warm both: pixels (the preprocess stage) and features
        self.path = path

    def send(self, requests: list[list[dict[str, Any]]]) -> None:
        """Each request through the prompt path (its images keyed, preprocessed or served, their
        pixels or features stored); raises what lmdeploy or featcache raised for one."""
        for messages in requests:
            asyncio.run(self.processor.get_prompt_input(messages, do_preprocess=True))

    def close(self) -> None:
        self.encoder.executor.shutdown(wait=True)


def _remote_code(model: str) -> bool:
    """Whether the checkpoint brings its own config classes (legacy InternVL2: ``auto_map``)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            return "auto_map" in json.load(f)
    except (OSError, ValueError):
        return False


class _VisionDtype:
    def __init__(self, dtype: torch.dtype | None) -> None:
        ctx = type("Ctx", (), {"dtype": dtype})() if dtype is not None else None
        self.source_model = type("Source", (), {"vision_model": type("Vision", (), {"_ctx": ctx})()})()


class _Engine:
    """What ``wrap`` reads of ``pipe.async_engine`` for TurboMind: the encoder, the prompt
    processor, the engine config and the engine (here only its vision dtype)."""

    def __init__(self, encoder: Any, processor: Any, config: Any, engine: _VisionDtype) -> None:
        self.vl_encoder = encoder
        self.prompt_processor = processor
        self.backend_config = config
        self.engine = engine


class _Pipe:
    def __init__(self, engine: _Engine) -> None:
        self.async_engine = engine
