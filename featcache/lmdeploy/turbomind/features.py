"""The TurboMind features path (opt-in, InternVL-HF): cached features as ``input_embeddings``.

``wrap(pipe, cache, turbomind="features")`` turns lmdeploy's TurboMind prompt path for an InternVL-HF
model (``InternVLForConditionalGeneration``) from "pixels to the C++ vision model" back into
"features to the LLM", lmdeploy's legacy TurboMind path (``input_embeddings`` +
``input_embedding_ranges``, ``TurboMindInstance.prepare_embeddings``), on lmdeploy's own code:

- the frontend (``frontend.py``) keys each image before preprocessing; a hit skips preprocessing;
- ``FeatureServer.forward`` (lmdeploy's ``VisionModel.forward`` hook, run by
  ``ImageEncoder.async_infer`` on the encoder's thread) serves hits from the cache, a host
  tensor in the engine's dtype, as is; the misses run through ``InternVLTower`` (the checkpoint's
  own vision tower and projector, transformers' InternVL classes, on the GPU when there is one),
  are copied once into page-locked host memory and put in the cache (demotion to disk is
  asynchronous). The tower runs in TurboMind's vision dtype and its output is cast to the engine
  dtype, as TurboMind's C++ ViT does; it computes the same function as that ViT but rounds at
  other points (docs/turbomind.md, "Features path: how it differs"), so outputs are close to, not
  identical with, plain TurboMind's;
- ``FeatureServer.to_turbomind`` packs them with lmdeploy's own ``proc_messages`` and
  ``to_turbomind_aux``. TurboMind's ``prepare_embeddings`` then copies host memory into host
  memory of the same dtype: no device copy, no synchronisation, on the request path of a hit.

Refused, with a message: models whose LLM positions depend on the image grid (Qwen2-VL and
Qwen2.5-VL use M-RoPE, which the ``input_embeddings`` path cannot carry) and architectures without
a Python tower here (legacy ``InternVLChatModel`` checkpoints: use the native path).

TurboMind's prefix caching does not cover requests that carry ``input_embeddings`` (lmdeploy
0.18), and TurboMind still loads its C++ vision model. See docs/turbomind.md for when this wins.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from ...core.cache import FeatureCache
from ..request.frontend import SECTION, install_frontend
from ..request.identity import model_identity
from ..request.messages import preprocessed
from ..request.refs import REF_KEY, FeatRef
from .common import check_host_cache, engine_vision_dtype

log = logging.getLogger("featcache")

GRID_POSITION_ARCHS = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
FEATURE_ARCHS = ("InternVLForConditionalGeneration", "InternVLChatModel")
LEGACY_ARCH = "InternVLChatModel"  # InternVL 1.5 / 2 / 2.5 checkpoints (trust_remote_code)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
             "multi_modal_projector.")


def check_features_arch(arch: str) -> None:
    """Raise ``ValueError`` unless the features path can serve ``arch``."""
    if arch in GRID_POSITION_ARCHS:
        raise ValueError(
            f"featcache: the TurboMind features path cannot serve {arch}: its LLM positions "
            "(M-RoPE) depend on each image's grid, which input_embeddings do not carry. Use "
            "turbomind='native' (cached pixels, TurboMind's own vision model).")
    if arch not in FEATURE_ARCHS:
        raise ValueError(
            f"featcache: the TurboMind features path supports {', '.join(FEATURE_ARCHS)} "
            f"(InternVL checkpoints), not {arch}. Use turbomind='native'.")


def engine_dtype(backend_config: Any, fallback: torch.dtype | None) -> torch.dtype:
    """The dtype TurboMind's ``prepare_embeddings`` copies features into."""
    dtype = _DTYPES.get(str(getattr(backend_config, "dtype", "auto")))
    if dtype is None and fallback in _DTYPES.values():
        dtype = fallback
    if dtype is None:
        raise ValueError("featcache: TurboMind's dtype is not resolved; pass "
                         "TurbomindEngineConfig(dtype='bfloat16') or 'float16'")
    return dtype


def install_features(pipe: Any, cache: FeatureCache, arch: str, namespace: str | None) -> None:
    """The features path on a TurboMind pipeline (through ``wrap``); raises ``ValueError`` for an
    architecture it cannot serve."""
    check_features_arch(arch)
    check_host_cache(cache)
    engine = pipe.async_engine
    encoder = engine.vl_encoder
    tower, dtype, own = features_tower(encoder, arch, engine.backend_config,
                                       engine_vision_dtype(getattr(engine, "engine", None)))
    namespace = namespace or own
    install_frontend(encoder.model, cache, namespace, engine.prompt_processor)
    FeatureServer(cache, tower, dtype).install(encoder.model)
    pipe.featcache = cache
    log.info("featcache: serving %s features to TurboMind (namespace %s)", arch, namespace)


def features_tower(encoder: Any, arch: str, backend_config: Any, vision_dtype: torch.dtype | None
                   ) -> tuple[InternVLTower | LegacyInternVLTower, torch.dtype, str]:
    """The checkpoint's vision tower (on the GPU when there is one, else the CPU), the engine
    dtype its features are served in, and the namespace they are keyed under. ``encoder``:
    lmdeploy's ``ImageEncoder``; ``backend_config``: the TurboMind engine config (its ``dtype``
    resolved); ``vision_dtype``: TurboMind's (``engine_vision_dtype``; None: the engine dtype).
    Raises ``ValueError`` for an architecture the features path cannot serve."""
    check_features_arch(arch)
    if encoder._uses_new_preprocess:
        raise ValueError(f"featcache: {arch} uses lmdeploy's new preprocess API; not supported")
    dtype = engine_dtype(backend_config, encoder.mm_feature_dtype)
    # TurboMind runs its C++ ViT in its own vision dtype (resolved from vision_config) and casts
    # the features to the engine dtype (internvit.cc, EnsureFloatDtype): the tower does the same
    tower_dtype = vision_dtype or dtype
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    tower: InternVLTower | LegacyInternVLTower
    if arch == LEGACY_ARCH:
        tower = LegacyInternVLTower.from_pretrained(encoder.model.model_path, tower_dtype, device)
        differences = legacy_vit_differences(tower.config)
        extra = {"turbomind": "features", "tower": "lmdeploy-pytorch"}
    else:
        tower = InternVLTower.from_pretrained(encoder.model.model_path, tower_dtype, device)
        differences = turbomind_vit_differences(tower.config)
        extra = {"turbomind": "features", "tower": "transformers"}
    for line in differences:
        log.warning("featcache: features path on %s: %s", arch, line)
    if tower_dtype != dtype:  # (equal dtypes keep the namespace features were cached under)
        extra["tower_dtype"] = str(tower_dtype).removeprefix("torch.")
    return tower, dtype, model_identity(encoder.model.model_path, arch, dtype, extra=extra)


def turbomind_vit_differences(config: Any) -> list[str]:
    """Where the checkpoint's own computation (transformers, lmdeploy's PyTorch engine, this
    tower) differs in *kind* from TurboMind's C++ ViT (lmdeploy 0.18 ``internvit.cc``), which
    always takes the last layer's output without a final norm, drops the CLS token, applies a 2x2
    pixel shuffle and erf GELUs. Empty for InternVL3 / InternVL3.5 HF checkpoints; any entry means
    features-path outputs differ from plain TurboMind by more than rounding."""
    vision = config.vision_config
    out = []
    if config.vision_feature_layer != -1:
        out.append(f"vision_feature_layer={config.vision_feature_layer}: TurboMind's ViT always "
                   "uses the last layer")
    if config.vision_feature_select_strategy != "default":
        out.append(f"vision_feature_select_strategy={config.vision_feature_select_strategy!r}: "
                   "TurboMind's ViT always drops the CLS token")
    if config.vision_feature_layer == -1 and not getattr(vision, "use_mean_pooling", True):
        out.append("use_mean_pooling=False: transformers applies a final LayerNorm to the last "
                   "layer; TurboMind's ViT does not")
    if float(config.downsample_ratio) != 0.5:
        out.append(f"downsample_ratio={config.downsample_ratio}: TurboMind's pixel shuffle is 2x2")
    for name, act in (("hidden_act", vision.hidden_act),
                      ("projector_hidden_act", config.projector_hidden_act)):
        if act != "gelu":
            out.append(f"{name}={act!r}: TurboMind's ViT uses the erf GELU")
    return out


def legacy_vit_differences(config: Any) -> list[str]:
    """``turbomind_vit_differences`` for a legacy ``InternVLChatModel`` config."""
    out = []
    if config.select_layer != -1:
        out.append(f"select_layer={config.select_layer}: TurboMind's ViT always uses the last layer")
    if float(config.downsample_ratio) != 0.5:
        out.append(f"downsample_ratio={config.downsample_ratio}: TurboMind's pixel shuffle is 2x2")
    return out


class _NoLanguageModel(torch.nn.Module):
    def load_weights(self, weights: Any) -> None:  # lmdeploy's loader hands over the LLM's: none
        return None


class LegacyInternVLTower:
    """A legacy ``InternVLChatModel`` checkpoint's InternViT and projector (``mlp1``) as lmdeploy's
    PyTorch engine computes them: its ``InternVisionModel``, its ``extract_feature`` (last layer,
    CLS dropped, pixel shuffle, ``mlp1``) and its weight loader; the language model is never
    built. Pixel tiles -> [tiles, tokens, LLM hidden]."""

    def __init__(self, module: Any, config: Any) -> None:
        self.module = module
        self.config = config
        self.device = next(module.vision_model.parameters()).device
        self.dtype = next(module.vision_model.parameters()).dtype

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype,
                        device: torch.device | str) -> LegacyInternVLTower:
        from lmdeploy.pytorch.models import internvl as lm
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        if config.select_layer != -1:
            raise ValueError(f"featcache: {path}: select_layer={config.select_layer}; lmdeploy's "
                             "InternVL computes the last layer's features only")
        vit, llm = config.vision_config.hidden_size, config.llm_config.hidden_size
        wide = vit * int(1 / config.downsample_ratio) ** 2
        module = torch.nn.Module()
        module.config = config
        module.select_layer = config.select_layer
        module.downsample_ratio = config.downsample_ratio
        module.vision_model = lm.InternVisionModel(config.vision_config, dtype=dtype, device=device)
        module.mlp1 = torch.nn.Sequential(
            torch.nn.LayerNorm(wide, dtype=dtype, device=device),
            torch.nn.Linear(wide, llm, bias=True, dtype=dtype, device=device), torch.nn.GELU(),
            torch.nn.Linear(llm, llm, bias=True, dtype=dtype, device=device))
        module.language_model = _NoLanguageModel()
        state = _vision_state_dict(path, ("vision_model.", "mlp1."))
        expected = {name for name, _ in module.named_parameters()}
        if not expected <= set(state):
            raise ValueError(f"featcache: {path} lacks vision weights {sorted(expected - set(state))[:4]}")
        lm.InternVLChatModel.load_weights(module, ((k, v.to(dtype)) for k, v in state.items()))
        object.__setattr__(module, "pixel_shuffle",  # (a plain attribute, not a submodule)
                           lambda x, scale_factor=0.5: lm.InternVLChatModel.pixel_shuffle(
                               module, x, scale_factor))
        module.eval().requires_grad_(False)
        return cls(module, config)

    @torch.inference_mode(False)
    @torch.no_grad()
    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        from lmdeploy.pytorch.models.internvl import InternVLChatModel

        out: torch.Tensor = InternVLChatModel.extract_feature(
            self.module, pixel_values.to(self.device, self.dtype))
        return out


class InternVLTower:
    """An InternVL-HF checkpoint's vision tower and projector (transformers' ``InternVLModel``,
    its language model left on the meta device): pixel tiles -> [tiles, tokens, LLM hidden]."""

    def __init__(self, model: Any, config: Any) -> None:
        self.model = model
        self.config = config
        self.device = next(model.vision_tower.parameters()).device
        self.dtype = next(model.vision_tower.parameters()).dtype

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: torch.device | str,
                        attn_implementation: str = "sdpa") -> InternVLTower:
        """Load only the vision tower and projector weights of the checkpoint at ``path``."""
        from transformers import AutoConfig, InternVLModel

        config = AutoConfig.from_pretrained(path)
        config._attn_implementation = attn_implementation
        config.vision_config._attn_implementation = attn_implementation
        with torch.device("meta"):
            model = InternVLModel(config)
        model.language_model = None  # never materialised: get_image_features does not use it
        state = _vision_state_dict(path)
        model.to_empty(device=device)
        missing, _ = model.load_state_dict(state, strict=False)
        if missing:
            raise ValueError(f"featcache: {path} lacks vision weights {missing[:4]}...")
        torch.nn.Module.to(model, dtype=dtype)  # (transformers' typed wrapper of ``to`` confuses mypy)
        model.eval().requires_grad_(False)
        return cls(model, config)

    @torch.inference_mode(False)
    @torch.no_grad()
    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model.get_image_features(
            pixel_values=pixel_values.to(self.device, self.dtype),
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy)
        return out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 4 / 5


def _vision_state_dict(path: str, prefixes: tuple[str, ...] = _PREFIXES) -> dict[str, torch.Tensor]:
    """The vision tower and projector tensors of a safetensors checkpoint (those whose names start
    with ``prefixes``; by default keyed as in ``InternVLModel``: ``vision_tower.*``,
    ``multi_modal_projector.*``)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            for key in f.keys():
                if key.startswith(prefixes):
                    state[key.removeprefix("model.")] = f.get_tensor(key)
    return state


def install_server(vision_model: Any, server: Any) -> None:
    """``server``'s ``forward`` and ``to_turbomind`` as instance attributes shadowing lmdeploy's
    on ``vision_model``, its own vision off: TurboMind then takes what ``server`` hands it (the
    features path's ``FeatureServer``, the combined configuration's ``CombinedServer``)."""
    vision_model._turbomind_native_vision = False
    vision_model.forward = server.forward
    vision_model.to_turbomind = lambda messages, chat_template, tokenizer, tools=None, \
        chat_template_kwargs=None, **kwargs: server.to_turbomind(
            vision_model, messages, chat_template, tokenizer, tools, chat_template_kwargs)


class FeatureServer:
    """lmdeploy's ``VisionModel.forward`` / ``to_turbomind`` for the features path."""

    def __init__(self, cache: FeatureCache, tower: InternVLTower | LegacyInternVLTower,
                 dtype: torch.dtype) -> None:
        self.cache = cache
        self.tower = tower
        self.dtype = dtype
        self.pin = torch.cuda.is_available()
        self.stream = torch.cuda.Stream(tower.device) if tower.device.type == "cuda" else None

    def install(self, vision_model: Any) -> None:
        """Instance attributes shadowing lmdeploy's: TurboMind then takes ``input_embeddings``."""
        install_server(vision_model, self)

    def forward(self, messages: list[dict[str, Any]], max_batch_size: int = 1) -> list[dict[str, Any]]:
        """Append ``{'role': 'forward', 'content': [features of each image, in order]}``: each a
        host tensor [image tokens, hidden] in the engine dtype."""
        items = preprocessed(messages)
        features: list[torch.Tensor | None] = [None] * len(items)
        misses = []
        for i, item in enumerate(items):
            ref = item.get(REF_KEY)
            if isinstance(ref, FeatRef) and ref.hit:
                assert ref.lease is not None
                features[i] = self.checked(ref.lease.tensor, item)
            else:
                misses.append(i)
        self.cache.count(SECTION, "tm_features_served", len(items) - len(misses))
        step = max(1, max_batch_size)
        for start in range(0, len(misses), step):
            chunk = misses[start:start + step]
            for i, host in zip(chunk, self.run([items[i] for i in chunk]), strict=True):
                ref = items[i].get(REF_KEY)
                if isinstance(ref, FeatRef):
                    self.cache.put(ref.key, host, meta=ref.meta)
                features[i] = host
        messages.append(dict(role="forward", content=features))
        return messages

    def checked(self, tensor: torch.Tensor, item: dict[str, Any]) -> torch.Tensor:
        """``tensor`` (cached features) if it is what ``item``'s image needs, else raises."""
        tokens = int(item["image_tokens"])
        if tensor.device.type != "cpu" or tensor.dtype != self.dtype or tensor.shape[0] != tokens:
            raise RuntimeError(f"cached features {tuple(tensor.shape)} {tensor.dtype} on "
                               f"{tensor.device} do not fit an image of {tokens} tokens")
        return tensor

    def run(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """The vision tower over the images of ``items`` (one call), as host tensors per image."""
        pixels = torch.cat([item["pixel_values"] for item in items])
        out = self.tower(pixels)
        out = out.reshape(-1, out.shape[-1]).to(self.dtype)
        sizes = [int(item["image_tokens"]) for item in items]
        if sum(sizes) != out.shape[0]:
            raise RuntimeError(f"the vision tower returned {out.shape[0]} rows for {sizes} tokens")
        hosts = [torch.empty((n, out.shape[-1]), dtype=self.dtype, pin_memory=self.pin)
                 for n in sizes]  # one tensor per image: each owns its storage in the cache
        if self.stream is None:
            for host, piece in zip(hosts, out.split(sizes), strict=True):
                host.copy_(piece)
        else:  # D2H copies on a side stream, waited for by their event only (a miss needs them now)
            self.stream.wait_stream(torch.cuda.current_stream(out.device))
            with torch.cuda.stream(self.stream):
                for host, piece in zip(hosts, out.split(sizes), strict=True):
                    host.copy_(piece, non_blocking=True)
                out.record_stream(self.stream)
                done = torch.cuda.Event()
                done.record(self.stream)
            done.synchronize()
        self.cache.count(SECTION, "vision_calls")
        self.cache.count(SECTION, "vision_images", len(items))
        return hosts

    def to_turbomind(self, vision_model: Any, messages: list[dict[str, Any]], chat_template: Any,
                     tokenizer: Any, tools: Any = None, chat_template_kwargs: Any = None
                     ) -> dict[str, Any]:
        """lmdeploy's own packing: prompt, input_ids, input_embeddings, input_embedding_ranges."""
        prompt, image_token = vision_model.proc_messages(
            messages, chat_template, tools=tools, chat_template_kwargs=chat_template_kwargs)
        result: dict[str, Any] = vision_model.to_turbomind_aux(messages, prompt, image_token,
                                                               tokenizer)
        return result
