"""The model families featcache caches on lmdeploy 0.18's PyTorch engine, as declarations.

A family is data: where its vision call lives, which list of the step's ``MultiModalData`` holds
its images, what the vision call returns, which forward inputs must be rebuilt over every image of
the step, and which frontend API lmdeploy runs for it. ``models`` holds the one mechanism that
serves every declaration; adding a family is its ``ArchSpec`` here, its tiny checkpoint and its
tests (docs/lmdeploy.md, "Adding a model").

``SUPPORT`` is one row per architecture string lmdeploy 0.18 accepts as a VLM (``check_vl_llm``
plus the configs it recognises by shape): cached on which engine, or why it passes through.
docs/lmdeploy.md's support table is tested against it (tests/test_families.py).

Sources: shared survey of lmdeploy 0.18's models (every vision call, its outputs and inputs),
verified on the installed package where a declaration relies on it; see each declaration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TENSOR, DEEPSTACK, MAIN_ONLY, LIST, PER_IMAGE = "tensor", "deepstack", "main", "list", "per_image"
VISUAL = ("image", "video")  # the modalities of an ``mm_data`` list that the vision call takes
LEGACY, PROCESSOR = "legacy", "processor"


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture's vision call lives and what its forward needs to reach it."""

    module: str  # lmdeploy.pytorch.models.<module>
    cls: str  # the top-level model class
    vision: str  # the vision call: a method name, or a submodule's dotted path ("model.visual")
    submodule: bool  # True: ``vision`` names an nn.Module attribute; False: a method
    # forward kwargs when every image of the step hit: ``make(device, images)`` (``images``: the
    # step's visual ``MultiModalData``, every one a hit with a 0-row placeholder as its data)
    placeholders: dict[str, Callable[[torch.device, list[Any]], Any]]
    # the key of the step's ``MultiModalData`` lists in ``context.input_multimodals``: "image"
    # (every item an image), or "mm_data" (the Qwen3 lineage: images, video frames, audio and
    # time series in one list; its ``VISUAL`` items are the vision call's inputs, in order)
    items: str = "image"
    # what the vision call returns: ``TENSOR`` ([rows, hidden] or [n, t, hidden]); ``DEEPSTACK``
    # ((main, [one [rows, hidden] per deepstack level]): every level is cached, in one entry of
    # [rows, (levels + 1) * hidden]); ``MAIN_ONLY`` ((main, levels the forward discards): only
    # main is cached, the forward gets (main, [])); ``LIST`` (one [rows, hidden] per image, in
    # order: Kimi-K2.5's ``get_image_features``); ``PER_IMAGE`` ([images, rows, hidden], every
    # image as many rows, and read so by the forward: CogVLM's index assignment)
    output: str = TENSOR
    # forward inputs that describe every visual item of the step, rebuilt after lmdeploy's own
    # prepare whenever featcache took items out of it: ``step_inputs(model, vision, context,
    # items, tokens, inputs)`` updates ``inputs`` (``items``: the step's whole list; ``tokens``:
    # the rows each visual item contributes, in the vision call's order). None: the legacy
    # families, whose forward needs only an ``image_mask`` when every image hit.
    step_inputs: Callable[..., None] | None = None
    # lmdeploy's frontend API for this family: ``LEGACY`` ``preprocess(messages)`` or
    # ``PROCESSOR`` ``preprocess(messages, input_prompt, mm_processor_kwargs)`` (``ProcessorFrontend``)
    frontend: str = LEGACY
    # TurboMind runs this architecture with its C++ vision model: featcache's native path
    turbomind: bool = False
    # featcache keeps the engine's prefix caching on for it (its images keyed by content). False
    # where the forward assumes every image's whole span is in the step (Gemma 3's bidirectional
    # image-attention masks, built from the step's own ids with positions from 0)
    prefix_caching: bool = True
    # a prefix match may end inside a held image of it (``pytorch.prefix``: the forward then gets
    # the image's remaining rows). False for the Qwen3.5 family: its hybrid state is restored only
    # at lmdeploy's state checkpoints, which lmdeploy keeps out of images (the match ends before
    # the image, as lmdeploy rewinds it; a hit still skips the tower)
    partial_images: bool = True
    # empty: a hit (or an image sharing another's vision output) is taken out of the step's list
    # before lmdeploy's prepare. Else lmdeploy's prepare is handed every item, a taken one with
    # 0-row pixels (Kimi-K2.5's checks the step's image tokens against the grids of the images it
    # was given, and refuses precomputed embeddings beside images), and these forward inputs, one
    # row per visual item, are cut to the items the vision call computes after it
    keep_items: tuple[str, ...] = ()
    # an image's feature rows are the count of its image token in its span, not the span's length
    # (Llama 4's span holds tile separators and an <|image|> marker among its patch tokens):
    # counted by the engine's input processor (``pytorch.engine.KeyedInputProcessor``)
    token_rows: bool = False


def _empty(device: torch.device, images: list[Any]) -> torch.Tensor:
    return torch.empty(0, device=device)


def _pair(device: torch.device, images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty(device, images), _empty(device, images)


def _step_pixels(device: torch.device, images: list[Any]) -> torch.Tensor:
    """The hits' own 0-row pixels, joined as lmdeploy's prepare joins pixels: a forward that reads
    the pixels' dtype (Gemma 3's attention masks) sees the one plain lmdeploy's forward sees."""
    return torch.cat([d.data for d in images]).to(device)


def qwen3_step_inputs(model: Any, vision: Any, context: Any, items: list[Any], tokens: list[int],
                      inputs: dict[str, Any]) -> None:
    """The Qwen3 lineage (``qwen3_vl.py``, ``qwen3_5.py``): the forward scatters the vision output
    by ``multimodal_mask`` (lmdeploy builds it from the token ids of the items it was handed:
    rebuilt here over every item of the step, as plain lmdeploy builds it), and splits and
    re-concatenates that output by ``grid_thw.prod(-1) // merge**2`` (a no-op whose sizes must
    sum to the rows returned: one row per visual item, ``[1, merge, merge * its rows]``). Where
    the spec-decoding draft model takes the step's embeddings, it takes them with hits too."""
    merge = int(vision.spatial_merge_size)
    inputs["multimodal_mask"] = model.get_multimodal_mask(context.input_ids, items)
    inputs["grid_thw"] = torch.tensor([[1, merge, merge * n] for n in tokens], dtype=torch.long)
    if "return_input_embeds" in inputs and getattr(model, "is_spec_decoding", False):
        inputs["return_input_embeds"] = True


def omni_step_inputs(model: Any, vision: Any, context: Any, items: list[Any], tokens: list[int],
                     inputs: dict[str, Any]) -> None:
    """Qwen3-Omni's thinker (``qwen3_omni_moe_thinker.py``): as the Qwen3 lineage, but its forward
    scatters by ``image_mask``, built over the step's visual items only (its audio items have a
    mask of their own, which lmdeploy's prepare builds from the items featcache leaves it)."""
    merge = int(vision.spatial_merge_size)
    visual = [d for d in items if modality_of(d) in VISUAL]
    inputs["image_mask"] = model.get_multimodal_mask(context.input_ids, visual)
    inputs["grid_thw"] = torch.tensor([[1, merge, merge * n] for n in tokens], dtype=torch.long)


def cogvlm_step_inputs(model: Any, vision: Any, context: Any, items: list[Any], tokens: list[int],
                       inputs: dict[str, Any]) -> None:
    """CogVLM (``cogvlm.py``): its forward writes the vision rows at ``vision_ids`` and routes every
    decoder layer's vision and language experts by ``vision_ids`` and ``lang_ids``, which its
    prepare builds from the step's ids only when it was handed images: rebuilt here the same way,
    over the step's ids (the first sequence's, as lmdeploy's), whatever featcache took out."""
    ids = context.input_ids
    at = torch.arange(0, ids.size(-1), device=ids.device)
    vision_mask = ids[0] == items[0].meta["image_token_id"]
    inputs["vision_ids"], inputs["lang_ids"] = at[vision_mask], at[~vision_mask]


def modality_of(data: Any) -> str | None:
    """A ``MultiModalData``'s modality as a string ("image", "video", "audio", ...), or None."""
    modality = getattr(data, "modality", None)
    return getattr(modality, "value", modality)


_INTERNVL_HF = ArchSpec("internvl3_hf", "InternVLForConditionalGeneration", "get_image_features",
                        False, {"pixel_values": _empty}, turbomind=True)
_QWEN3_VL = ArchSpec(
    "qwen3_vl", "Qwen3VLForConditionalGeneration", "visual", True,
    {"pixel_values": _empty, "vis_cu_seqlens": _empty, "vis_pos_emb": _pair, "pos_embeds": _empty},
    items="mm_data", output=DEEPSTACK, step_inputs=qwen3_step_inputs, frontend=PROCESSOR)
_QWEN3_5 = ArchSpec(
    "qwen3_5", "Qwen3_5ForConditionalGeneration", "model.visual", True,
    {"pixel_values": _empty, "vis_cu_seqlens": _empty, "vis_pos_emb": _pair, "pos_embeds": _empty},
    items="mm_data", output=TENSOR, step_inputs=qwen3_step_inputs, frontend=PROCESSOR, turbomind=True,
    partial_images=False)

# Kimi-K2.5 / K2.6: get_image_features(pixels, grid_thws) -> one tensor per image. Its prepare is
# handed every image (their grids must add up to the step's image tokens), the hits' pixels 0-row;
# no all-hit placeholder: those pixels reach the forward, which makes the vision call with them
_KIMI = ArchSpec("kimi_k25", "KimiK25ForConditionalGeneration", "get_image_features", False, {},
                 output=LIST, frontend=PROCESSOR, partial_images=False, keep_items=("grid_thws",))

_GLM4V_9B = ArchSpec("chatglm2", "ChatGLMForConditionalGeneration", "transformer.vision", True,
                     {"images": _empty}, prefix_caching=False)


def _as(spec: ArchSpec, module: str, cls: str, **changes: Any) -> ArchSpec:
    return ArchSpec(**{**spec.__dict__, "module": module, "cls": cls, **changes})


SPECS: dict[str, ArchSpec] = {
    "InternVLChatModel": ArchSpec(
        "internvl", "InternVLChatModel", "extract_feature", False, {"pixel_values": _empty},
        turbomind=True),
    "InternVLForConditionalGeneration": _INTERNVL_HF,
    # Intern-S1 / S1-mini: lmdeploy runs them with the InternVL-HF class and frontend
    # (module_map.py, vl/model/internvl3_hf.py's _arch)
    "InternS1ForConditionalGeneration": _INTERNVL_HF,
    "Qwen2VLForConditionalGeneration": ArchSpec(
        "qwen2_vl", "Qwen2VLForConditionalGeneration", "visual", True,
        {"pixel_values": _empty, "vis_cu_seqlens": _empty, "vis_pos_emb": _pair},
        turbomind=True),
    "Qwen2_5_VLForConditionalGeneration": ArchSpec(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "visual", True,
        {"pixel_values": _empty, "vis_cu_seqlens": _empty, "vis_pos_emb": _empty,
         "window_index": _empty, "cu_window_seqlens": _empty}, turbomind=True),
    # Qwen3-VL: visual -> (main, deepstack levels), split by the step's grid after the call
    "Qwen3VLForConditionalGeneration": _QWEN3_VL,
    # its own forward (the same vision call), Qwen3-VL's prepare
    "Qwen3VLMoeForConditionalGeneration": _as(_QWEN3_VL, "qwen3_vl_moe",
                                              "Qwen3VLMoeForConditionalGeneration"),
    # Qwen3.5: model.visual -> one tensor, split by the step's grid
    "Qwen3_5ForConditionalGeneration": _QWEN3_5,
    "Qwen3_5MoeForConditionalGeneration": _as(_QWEN3_5, "qwen3_5_moe",
                                              "Qwen3_5MoeForConditionalGeneration"),
    # GLM-4.1V: Qwen2-VL's shape (visual -> [rows, hidden], the "image" list, an image_mask over
    # the step's ids) with two more grid inputs, behind the processor-level frontend
    # Intern-S2 Preview: lmdeploy builds it with the Qwen3.5-MoE class (module_map.py), behind the
    # checkpoint's own (remote) processor
    "InternS2PreviewForConditionalGeneration": _as(_QWEN3_5, "qwen3_5_moe",
                                                   "Qwen3_5MoeForConditionalGeneration"),
    # (TurboMind builds the *ForConditionalGeneration strings only: supported_models.py)
    "InternS2PreviewForCausalLM": _as(_QWEN3_5, "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration",
                                      turbomind=False),
    # Intern-S2 Mobius: its own class, Qwen3.5's prepare and forward (model.visual, one tensor)
    "InternS2MobiusForConditionalGeneration": _as(_QWEN3_5, "interns2_mobius",
                                                  "InternS2MobiusForConditionalGeneration"),
    "InternS2MobiusForCausalLM": _as(_QWEN3_5, "interns2_mobius", "InternS2MobiusForConditionalGeneration",
                                     turbomind=False),
    # Intern-S1-Pro / S1.1: Qwen3-VL's tower and prepare; its forward drops the deepstack levels
    # (``image_embeds, _ = self.visual(...)``): only the main rows are cached
    "InternS1ProForConditionalGeneration": _as(_QWEN3_VL, "interns1_pro",
                                               "InternS1ProForConditionalGeneration", output=MAIN_ONLY),
    "InternS1_1_ForConditionalGeneration": _as(_QWEN3_VL, "interns1_pro",
                                               "InternS1ProForConditionalGeneration", output=MAIN_ONLY),
    # LLaVA (HF): get_image_features(pixels, layer, strategy) -> [1, images * tokens, hidden]
    "LlavaForConditionalGeneration": ArchSpec(
        "llava", "LlavaForConditionalGeneration", "get_image_features", False, {"pixel_values": _empty}),
    # Qwen3-Omni: lmdeploy serves its thinker, Qwen3-VL's tower (deepstack levels) beside an audio
    # tower; the step's "mm_data" list holds audio too (left to lmdeploy), its image mask its own
    "Qwen3OmniMoeForConditionalGeneration": _as(
        _QWEN3_VL, "qwen3_omni_moe_thinker", "Qwen3OmniMoeThinkerForConditionalGeneration",
        step_inputs=omni_step_inputs),
    # Gemma 3: get_image_features -> [images, tokens, hidden]; its forward builds bidirectional
    # image masks in the pixels' dtype whenever pixels are given, so an all-hit step passes the
    # hits' 0-row pixels (in the model's dtype); prefix caching stays off, as lmdeploy leaves it
    "Gemma3ForConditionalGeneration": ArchSpec(
        "gemma3_vl", "Gemma3ForConditionalGeneration", "get_image_features", False,
        {"pixel_values": _step_pixels}, prefix_caching=False),
    "KimiK25ForConditionalGeneration": _KIMI,
    "Kimi_K25ForConditionalGeneration": _KIMI,
    # GLM-4V-9B (ChatGLM with a vision_config; both strings build one class): transformer.vision
    # -> [images, tokens, hidden] (EVA2CLIP, boi and eoi included); positions from the step's
    # model_metas, so prefix caching stays off, as lmdeploy leaves it
    "ChatGLMModel": _GLM4V_9B,
    "ChatGLMForConditionalGeneration": _GLM4V_9B,
    # CogVLM / CogVLM2: model.vision -> [images, tokens, hidden] (EVA2CLIP, boi and eoi included),
    # written at the step's vision_ids, which also route its experts; positions from model_metas
    "CogVLMForCausalLM": ArchSpec(
        "cogvlm", "CogVLMForCausalLM", "model.vision", True, {"images": _empty}, output=PER_IMAGE,
        step_inputs=cogvlm_step_inputs, prefix_caching=False),
    # Llama 4: get_image_features -> [tiles, patches, hidden] before the projector (which runs on
    # hits too); an image's rows are its <|patch|> tokens; prefix caching stays off, as lmdeploy
    # leaves it for the legacy API
    "Llama4ForConditionalGeneration": ArchSpec(
        "llama4", "Llama4ForConditionalGeneration", "get_image_features", False,
        {"pixel_values": _empty}, prefix_caching=False, token_rows=True),
    "Glm4vForConditionalGeneration": ArchSpec(
        "glm4_1v", "Glm4vForConditionalGeneration", "visual", True,
        {"pixel_values": _empty, "vis_cu_seqlens": _empty, "vis_pos_emb": _pair,
         "image_type_ids": _empty, "grid_thw": _empty}, frontend=PROCESSOR),
}

# the architectures whose engine prefix caching featcache keeps on (``keep_prefix_caching``)
PREFIX_CACHED = frozenset(arch for arch, spec in SPECS.items() if spec.prefix_caching)
# the architectures whose prefix matches may end inside a held image (``pytorch.prefix``)
PARTIAL_IMAGES = frozenset(arch for arch in PREFIX_CACHED if SPECS[arch].partial_images)
# the architectures whose images' rows are counted in their spans (``ArchSpec.token_rows``)
TOKEN_ROWS = frozenset(arch for arch, spec in SPECS.items() if spec.token_rows)


# HF processors of the processor-level API whose placeholder expansion is a function of each
# image's ``image_grid_thw`` alone (``replace_image_token``): ``ProcessorFrontend`` reproduces
# their output (shown equal to lmdeploy's by tests/test_lmdeploy_newapi.py)
EXPANDING = ("Qwen2VLProcessor", "Qwen3VLProcessor", "Glm4vProcessor", "Qwen3OmniMoeProcessor")
# what ``ProcessorFrontend._expand`` calls or reproduces of a processor: defined by transformers,
# never overridden
_EXPANSION = ("__call__", "replace_image_token", "get_text_with_replacements", "_merge_kwargs")


def reproduces_expansion(processor: Any, model: Any = None) -> bool:
    """Whether ``request.processor.ProcessorFrontend._expand`` reproduces ``processor``'s call: one of
    ``EXPANDING`` (or a subclass of one), whose call, expansion and text replacement are
    transformers' own, run by lmdeploy's own processor-level ``preprocess`` (``model``: the vision
    model, when known; Kimi-K2.5's has a preprocess of its own). A checkpoint's remote-code
    processor that overrides any of them (Intern-S2's and Intern-S1-Pro's ship their own, with
    time series) takes lmdeploy's preprocessing, its images tagged: hits still skip the vision
    model."""
    if processor is None:
        return False
    if model is not None:
        from lmdeploy.vl.model.base import VisionModel

        if getattr(type(model), "preprocess", None) is not VisionModel.preprocess:
            return False
    mro = type(processor).__mro__
    if not {k.__name__ for k in mro} & set(EXPANDING):
        return False
    for name in _EXPANSION:
        owner = next((k for k in mro if name in vars(k)), None)
        if owner is None or not owner.__module__.startswith("transformers."):
            return False
    return True


@dataclass(frozen=True)
class Support:
    """One row of the support table: an architecture string and what featcache does with it."""

    arch: str
    family: str
    status: str  # "cached" or "passes through"
    note: str  # engines and the frontend API where cached; the reason where not

    @property
    def cached(self) -> bool:
        return self.status == "cached"


def _cached(arch: str, family: str, prefix_off: str = "") -> Support:
    """``prefix_off``: why engine prefix caching stays off for it (``ArchSpec.prefix_caching``)."""
    spec = SPECS[arch]
    assert spec.prefix_caching == (not prefix_off), arch
    engines = "PyTorch engine" + (", TurboMind (native path)" if spec.turbomind else "")
    api = "legacy preprocess" if spec.frontend == LEGACY else "processor-level preprocess"
    prefix = f"; engine prefix caching stays off ({prefix_off})" if prefix_off else ""
    return Support(arch, family, "cached", f"{engines}; {api}{prefix}")


def _through(arch: str, family: str, why: str) -> Support:
    return Support(arch, family, "passes through", why)


SUPPORT: tuple[Support, ...] = (
    _cached("InternVLChatModel", "InternVL 1.5-3.5"),
    _cached("InternVLForConditionalGeneration", "InternVL3/3.5 -HF"),
    _cached("InternS1ForConditionalGeneration", "Intern-S1, Intern-S1-mini"),
    _cached("Qwen2VLForConditionalGeneration", "Qwen2-VL"),
    _cached("Qwen2_5_VLForConditionalGeneration", "Qwen2.5-VL"),
    _cached("Qwen3VLForConditionalGeneration", "Qwen3-VL"),
    _cached("Qwen3VLMoeForConditionalGeneration", "Qwen3-VL-MoE"),
    _cached("Qwen3_5ForConditionalGeneration", "Qwen3.5"),
    _cached("Qwen3_5MoeForConditionalGeneration", "Qwen3.5-MoE"),
    _cached("InternS2PreviewForConditionalGeneration", "Intern-S2 Preview"),
    _cached("InternS2PreviewForCausalLM", "Intern-S2 Preview"),
    _cached("InternS2MobiusForConditionalGeneration", "Intern-S2 Mobius"),
    _cached("InternS2MobiusForCausalLM", "Intern-S2 Mobius"),
    _cached("InternS1ProForConditionalGeneration", "Intern-S1-Pro"),
    _cached("InternS1_1_ForConditionalGeneration", "Intern-S1.1"),
    _cached("Qwen3OmniMoeForConditionalGeneration", "Qwen3-Omni (thinker)"),
    _cached("Glm4vForConditionalGeneration", "GLM-4.1V"),
    _cached("Gemma3ForConditionalGeneration", "Gemma 3", "full-prefill masks"),
    _cached("LlavaForConditionalGeneration", "LLaVA (HF)"),
    _through("LlavaNextForConditionalGeneration", "LLaVA-NeXT",
             "lmdeploy 0.18 serves it only on transformers 4: its LLaVA-NeXT frontend does not build "
             "on 5 (its _from_config(..., trust_remote_code=) and del model.language_model), which "
             "every family since Qwen3.5 and GLM-4.1V needs, and featcache is tested on; not declared "
             "for 4 (a two-stage vision call: get_image_features per tile, pack_image_features per "
             "image, both to be wrapped)"),
    _cached("ChatGLMModel", "GLM-4V-9B (with a vision_config)", "positions from the step's model_metas"),
    _cached("ChatGLMForConditionalGeneration", "GLM-4V-9B (with a vision_config)",
            "positions from the step's model_metas"),
    _cached("CogVLMForCausalLM", "CogVLM, CogVLM2", "positions from the step's model_metas"),
    _cached("Llama4ForConditionalGeneration", "Llama 4", "as lmdeploy leaves it; an image's rows are not "
            "its span's length"),
    _cached("KimiK25ForConditionalGeneration", "Kimi-K2.5, Kimi-K2.6"),
    _cached("Kimi_K25ForConditionalGeneration", "Kimi-K2.5, Kimi-K2.6"),
    _through("Phi3VForCausalLM", "Phi-3-Vision, Phi-3.5-Vision",
             "not declared: its vision call makes the whole step's embeddings (vision_embed_tokens "
             "over the step's ids), each image's rows made inside it by hd_feature_transform; "
             "serving them takes a second wrapper (the CLIP call on the misses' crops only) and "
             "an all-hit placeholder of 336 px crops, tested over a stand-in of its remote "
             "processor (a 2024 family, after every one lmdeploy added since)"),
    _through("DeepseekVLV2ForCausalLM", "DeepSeek-VL2 (a language_config of DeepseekV2ForCausalLM)",
             "one preprocessed entry and one fused vision-and-scatter call per request: no image "
             "has an identity of its own in the engine"),
    _through("MiniCPMV", "MiniCPM-V", "lmdeploy 0.18's engine drops its images (no vision model)"),
    _through("MolmoForCausalLM", "Molmo", "no lmdeploy 0.18 engine builds it"),
    _through("MultiModalityCausalLM", "DeepSeek-VL", "no lmdeploy 0.18 engine builds it"),
    _through("LlavaLlamaForCausalLM", "LLaVA (original)", "no lmdeploy 0.18 engine builds it"),
    _through("LlavaMistralForCausalLM", "LLaVA (original)", "no lmdeploy 0.18 engine builds it"),
)


def support_table() -> str:
    """docs/lmdeploy.md's support table, one row per architecture string (Markdown)."""
    rows = ["| architecture | family | featcache | engines, API, or why not |", "|---|---|---|---|"]
    rows += [f"| `{s.arch}` | {s.family} | {s.status} | {s.note} |" for s in SUPPORT]
    return "\n".join(rows)
