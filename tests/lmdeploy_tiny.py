"""Tiny, download-free InternVL-HF and Qwen2-VL checkpoints for the lmdeploy CPU tests.

``build(root, arch)`` writes what lmdeploy 0.18's frontend and its PyTorch input processors read
from a checkpoint: ``config.json`` (float32, ``architectures`` set explicitly), a byte-level BPE
tokenizer with the model's special tokens, and the processor configs. No weights are written:
nothing on the CPU runs a model forward (the engine and the vision towers need CUDA), and lmdeploy's
``ImageEncoder`` for the PyTorch backend never loads them. Shapes follow
``bench/device/make_tiny_vlm.py`` (the GPU check builds its checkpoints with it):

- InternVL-HF: 56 px tiles, patch 14, pixel shuffle 0.5 -> 4 image tokens a tile, up to 4 crops
  plus a thumbnail per image;
- Qwen2-VL: patch 14, merge 2, ``min_pixels`` 56*56, ``max_pixels`` 28*28*64.

Without torchvision. transformers (every version lmdeploy 0.18 accepts) loads a *video* processor
as part of ``InternVLProcessor`` / ``Qwen2VLProcessor``, and its video processors need torchvision,
which has no PyPI build that loads beside the CPU torch these tests run on. So the checkpoints
name a processor class that is the real one minus its video processor (``NoVideo*Processor``:
the same ``__init__``, tokens and image processor; ``get_attributes`` leaves out
``video_processor``), registered with ``AutoProcessor`` by ``register_processors()``. The image
processors are transformers' PIL ones (``GotOcr2ImageProcessorPil``, ``Qwen2VLImageProcessorPil``):
lmdeploy's ``VisionModel.preprocess`` runs unchanged on top of them.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

INTERNVL = "InternVLForConditionalGeneration"
QWEN2VL = "Qwen2VLForConditionalGeneration"
INTERNS1 = "InternS1ForConditionalGeneration"  # Intern-S1: the InternVL-HF classes in lmdeploy
QWEN3VL = "Qwen3VLForConditionalGeneration"
QWEN3VL_MOE = "Qwen3VLMoeForConditionalGeneration"
QWEN3_5 = "Qwen3_5ForConditionalGeneration"
QWEN3_5_MOE = "Qwen3_5MoeForConditionalGeneration"
GLM4V = "Glm4vForConditionalGeneration"  # GLM-4.1V
# Intern-S1-Pro / S1.1 ship remote-code configs and processors (time series beside images): a
# stand-in, Qwen3-VL's config and processor under its architecture string (lmdeploy's classes for
# it are real: its vision model, input processor, prepare and forward)
INTERNS1PRO = "InternS1ProForConditionalGeneration"
GEMMA3 = "Gemma3ForConditionalGeneration"
QWEN3_OMNI = "Qwen3OmniMoeForConditionalGeneration"  # Qwen3-Omni (lmdeploy serves its thinker)
LLAVA = "LlavaForConditionalGeneration"  # LLaVA (HF): llava-1.5-hf, llava-interleave-qwen-hf
# Kimi-K2.5 / K2.6: transformers' config, a DeepSeek-V3 LLM; its remote processor a stand-in
# (tests/kimi_processor_standin.py), written into the checkpoint as remote code
KIMI = "KimiK25ForConditionalGeneration"
# Llama 4: transformers' config and processor; its image processor a stand-in
# (tests/llama4_image_standin.py: transformers' is torchvision-only), written in as remote code
LLAMA4 = "Llama4ForConditionalGeneration"
LLAMA4_TILE_TOKENS = 4  # 56 px tiles, patch 14, pixel shuffle 0.5: 4 <|patch|> tokens a tile
# GLM-4V-9B (``ChatGLMModel`` with a vision_config): remote code; its config a stand-in
# (bench/device/seed_remote_code.py's, as the GPU builder's), its tokenizer this module's
GLM4V_9B = "ChatGLMModel"
GLM4V_9B_TOKENS = 6  # 56 px, patch 14, 2x2 merged, boi and eoi: 2 + 2 * 2
# CogVLM2 (``CogVLMForCausalLM``): remote code, the same stand-in config module; 6 tokens an image
# as GLM-4V's (lmdeploy's CogVLM2 count); its directory name picks lmdeploy's cogvlm template
COGVLM = "CogVLMForCausalLM"
LLAVA_TOKENS = 16  # the tiny LLaVA: CLIP at 56 px, patch 14, CLS dropped: 16 tokens an image
GEMMA3_TOKENS = 4  # the tiny Gemma 3: 56 px images, patch 14, 2x2 pooled: 4 tokens an image
DIRS = {INTERNVL: "internvl_hf_tiny", QWEN2VL: "qwen2vl_tiny", INTERNS1: "interns1_tiny",
        QWEN3VL: "qwen3vl_tiny", QWEN3VL_MOE: "qwen3vl_moe_tiny", QWEN3_5: "qwen3_5_tiny",
        QWEN3_5_MOE: "qwen3_5_moe_tiny", GLM4V: "glm4v_tiny", GEMMA3: "gemma3_tiny",
        INTERNS1PRO: "interns1pro_standin", LLAVA: "llava_tiny", QWEN3_OMNI: "qwen3_omni_tiny",
        KIMI: "kimi_k25_standin", LLAMA4: "llama4_tiny", GLM4V_9B: "glm4v_9b_standin",
        COGVLM: "cogvlm_standin"}
# the processor-level ("new") preprocessing API of lmdeploy 0.18
NEW_API = (QWEN3VL, QWEN3VL_MOE, QWEN3_5, QWEN3_5_MOE, GLM4V, INTERNS1PRO, QWEN3_OMNI)
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 32 * 32, 32 * 32 * 64  # patch 16, merge 2: 1 to 64 tokens
# GLM-4.1V's smart_resize counts the temporal factor (2) in its budget: 28*28*2 per token
GLM4V_MIN_PIXELS, GLM4V_MAX_PIXELS = 28 * 28 * 2, 28 * 28 * 2 * 64

_LLM = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)

_registered = False
NO_VIDEO: dict[str, type] = {}  # processor class name -> its NoVideo* class (``register_processors``)
_built: dict[str, str] = {}


def checkpoint(arch: str, tmp_path_factory: Any) -> str:
    """The tiny checkpoint of ``arch``, built once per test session (in pytest's tmp dir)."""
    if arch not in _built:
        register_processors()
        _built[arch] = build(str(tmp_path_factory.mktemp("lmdeploy_tiny")), arch)
    return _built[arch]


def noise_image(width: int, height: int, seed: int = 0) -> Any:
    """A random RGB PIL image (pixel content matters to the keys and the preprocessing)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def tokens(item: dict[str, Any]) -> int:
    """An image's token count in a preprocessed request: the legacy API's ``image_tokens``, the
    processor-level API's span (``offset``: start, end)."""
    if "image_tokens" in item:
        return int(item["image_tokens"])
    start, end = item["offset"]
    return int(end) - int(start)


def image_item(image: Any, **params: Any) -> dict[str, Any]:
    """An OpenAI-style content item for a PIL image, with per-image parameters."""
    return {"type": "image_data", "image_data": {"data": image, **params}}


def messages(*items: dict[str, Any], text: str = "describe") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *items]}]


class PromptPath:
    """lmdeploy's real prompt path (``ImageEncoder`` + ``MultimodalProcessor``) of the PyTorch
    backend (or ``backend="turbomind"``) for one tiny checkpoint; ``calls`` records the images (as
    ``PIL.Image.size``) that each call of the model's own ``preprocess`` was given."""

    def __init__(self, path: str, dtype: str = "float16", backend: str = "pytorch",
                 trust_remote_code: bool = False) -> None:
        from lmdeploy.messages import PytorchEngineConfig, TurbomindEngineConfig
        from lmdeploy.model import get_chat_template
        from lmdeploy.serve.processors.multimodal import MultimodalProcessor
        from lmdeploy.tokenizer import Tokenizer
        from lmdeploy.vl.engine import ImageEncoder

        # float16: InternVL-HF's pixel_values are cast to it, Qwen2-VL's stay float32 (as on a GPU);
        # 'bfloat16' would ask CUDA whether bf16 works
        config = (PytorchEngineConfig if backend == "pytorch" else TurbomindEngineConfig)(dtype=dtype)
        self.encoder = ImageEncoder(path, backend, backend_config=config, trust_remote_code=trust_remote_code)
        self.model = self.encoder.model
        template = get_chat_template(path, None, trust_remote_code=trust_remote_code)
        self.processor = MultimodalProcessor(Tokenizer(path), template,
                                             vl_encoder=self.encoder, backend=backend)
        self.calls: list[list[tuple[int, int]]] = []
        self._lmdeploy_only = True
        original = self.model.preprocess

        def preprocess(messages: list[dict[str, Any]], *args: Any) -> Any:
            if self._lmdeploy_only:
                self._record(messages)
            return original(messages, *args)

        if self.encoder._uses_new_preprocess:  # lmdeploy reads the API off the signature
            def new_api(messages: list[dict[str, Any]], input_prompt: Any = None,
                        mm_processor_kwargs: Any = None) -> Any:
                return preprocess(messages, input_prompt, mm_processor_kwargs)

            self.model.preprocess = new_api
        else:
            self.model.preprocess = preprocess

    def _record(self, messages: list[dict[str, Any]]) -> None:
        self.calls.append([data.size for _, data, _ in self.model.collect_multimodal_items(messages)])

    def record_featcache(self) -> None:
        """Once featcache is installed on this path: ``calls`` records every preprocessing its
        frontend runs, featcache's own (``fastprep``, which makes lmdeploy's output itself for the
        models it reproduces, e.g. Qwen2-VL, InternVL-HF) or lmdeploy's, not only lmdeploy's."""
        if not self._lmdeploy_only:
            return
        frontend = self.model.preprocess.frontend
        inner = frontend.original
        self._lmdeploy_only = False

        def preprocess(messages: list[dict[str, Any]], *args: Any) -> Any:
            self._record(messages)
            return inner(messages, *args)

        frontend.original = preprocess
        maker = getattr(frontend, "maker", None)  # the processor-level frontend's own pixels
        if maker is not None:
            frontend.maker = _RecordedMaker(maker, self.calls)

    def prompt(self, msgs: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """What ``VLAsyncEngine`` hands the engine for ``msgs``: prompt, input_ids, per-image dicts
        (``kwargs``: a request's options, e.g. ``media_io_kwargs``)."""
        return asyncio.run(self.processor.get_prompt_input(msgs, do_preprocess=True, **kwargs))

    def close(self) -> None:
        self.encoder.executor.shutdown(wait=True)


class _RecordedMaker:
    """A ``PatchMaker`` whose images are recorded in ``calls``, one entry a request (its
    ``ProcessorFrontend`` makes a request's misses in one pass, ``fastprep.processor_patches``,
    which asks every image's ``size`` first)."""

    def __init__(self, maker: Any, calls: list[list[tuple[int, int]]]) -> None:
        self.maker, self.calls, self._open = maker, calls, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.maker, name)

    def size(self, width: int, height: int, *args: Any) -> Any:
        if self._open is False:  # the first image of a request's pass
            self._open = True
            self.calls.append([])
        self.calls[-1].append((width, height))
        return self.maker.size(width, height, *args)

    def __call__(self, image: Any, *args: Any) -> Any:
        self._open = False
        return self.maker(image, *args)


def featcache_prepare(monkeypatch: Any, cls: type, spec: Any) -> type:
    """Patch featcache's ``prepare`` for ``spec`` in for one test (``patch_model_class``: it
    returns the class it patched); ``cls``'s own, lmdeploy's, is put back after the test."""
    from featcache.lmdeploy.pytorch.models import patch_model_class

    monkeypatch.setattr(cls, "prepare_inputs_for_generation", cls.prepare_inputs_for_generation)
    return patch_model_class(spec)


def register_processors() -> None:
    """Make ``AutoProcessor`` resolve the checkpoints' ``NoVideo*Processor`` names (idempotent).

    Registered under a private config class, so no real model's processor lookup changes."""
    global _registered
    if _registered:
        return
    from transformers import AutoProcessor, InternVLProcessor, PretrainedConfig, Qwen2VLProcessor

    def without_video(base: type) -> type:
        @classmethod  # type: ignore[misc]
        def get_attributes(cls: type) -> list[str]:
            return [a for a in base.get_attributes() if a != "video_processor"]

        body = {"get_attributes": get_attributes, "__module__": __name__,
                "__doc__": f"{base.__name__} without a video processor (which needs torchvision)."}
        if base.__name__ == "Qwen3OmniMoeProcessor":  # its __init__ passes its parts by position
            body["__init__"] = _omni_init
        return type(f"NoVideo{base.__name__}", (base,), body)

    from transformers import Glm4vProcessor, Qwen3OmniMoeProcessor, Qwen3VLProcessor

    for base in (InternVLProcessor, Qwen2VLProcessor, Qwen3VLProcessor, Glm4vProcessor,
                 Qwen3OmniMoeProcessor):
        key = type(f"_{base.__name__}Key", (PretrainedConfig,), {"model_type": f"featcache-{base.__name__}"})
        NO_VIDEO[base.__name__] = without_video(base)
        AutoProcessor.register(key, NO_VIDEO[base.__name__], exist_ok=True)
    _registered = True


def _omni_init(self: Any, image_processor: Any = None, feature_extractor: Any = None, tokenizer: Any = None,
               chat_template: Any = None, **kwargs: Any) -> None:
    """``Qwen3OmniMoeProcessor.__init__`` without its video processor: its parts by name, then its
    token attributes, read off the tokenizer as its own ``__init__`` reads them."""
    from transformers import ProcessorMixin

    ProcessorMixin.__init__(self, image_processor=image_processor, feature_extractor=feature_extractor,
                            tokenizer=tokenizer, chat_template=chat_template)
    for name in ("image_token", "audio_token", "video_token", "image_token_id", "audio_token_id",
                 "video_token_id", "vision_bos_token", "vision_eos_token", "audio_bos_token",
                 "audio_eos_token"):
        setattr(self, name, getattr(tokenizer, name))


def build(root: str, arch: str) -> str:
    """Write the tiny checkpoint of ``arch`` under ``root``; returns its directory."""
    out = os.path.join(root, DIRS[arch])
    os.makedirs(out, exist_ok=True)
    if arch == INTERNS1:
        _internvl_hf(out, INTERNS1)
    elif arch == GLM4V:
        _glm4v(out)
    elif arch == GEMMA3:
        _gemma3(out)
    elif arch == LLAVA:
        _llava(out)
    elif arch == QWEN3_OMNI:
        _qwen3_omni(out)
    elif arch == KIMI:
        _kimi(out)
    elif arch == LLAMA4:
        _llama4(out)
    elif arch in (GLM4V_9B, COGVLM):
        _glm4v_9b(out, arch)
    elif arch in NEW_API:
        _qwen3(out, arch)
    else:
        {INTERNVL: _internvl_hf, QWEN2VL: _qwen2vl}[arch](out)
    return out


def _tokenizer(special: list[str], **kwargs: Any) -> Any:
    """Byte-level BPE without merges (every byte is one token), the special tokens appended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2TokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)
    return Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              **kwargs)


def _finish(out: str, cfg: Any, arch: str, tok: Any, processor: dict[str, Any]) -> None:
    """config.json (float32, architectures explicit), generation and processor configs."""
    cfg.architectures = [arch]
    cfg.save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = [arch]
    for d in (config, config.get("text_config")):
        if isinstance(d, dict):
            d["dtype"] = d["torch_dtype"] = "float32"
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(dict(eos_token_id=eos, pad_token_id=pad, bos_token_id=pad), f, indent=2)
    path = os.path.join(out, "processor_config.json")
    saved = {}
    if os.path.exists(path):  # written by the processor itself: kept, ``processor`` over it
        with open(path) as f:
            saved = json.load(f)
    with open(path, "w") as f:
        json.dump({**saved, **processor}, f, indent=2)


def _internvl_hf(out: str, arch: str = INTERNVL) -> None:
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig

    tok = _tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"],
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<IMG_CONTEXT>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(out)
    GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1,
                             max_patches=4).save_pretrained(out)
    cfg = InternVLConfig(
        vision_config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=256, image_size=[56, 56], patch_size=[14, 14]),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), architectures=["Qwen2ForCausalLM"],
                         tie_word_embeddings=False, bos_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **_LLM),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4,
        downsample_ratio=0.5, tie_word_embeddings=False)
    _finish(out, cfg, arch, tok,
            {"processor_class": "NoVideoInternVLProcessor", "image_seq_length": 4})


def _qwen2vl(out: str) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessorPil

    tok = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                      "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2VLConfig(
        vocab_size=len(tok), rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
        vision_config=dict(depth=2, embed_dim=128, hidden_size=_LLM["hidden_size"], num_heads=2,
                           mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           in_chans=3),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id,
        tie_word_embeddings=False, **_LLM)
    _finish(out, cfg, QWEN2VL, tok, {"processor_class": "NoVideoQwen2VLProcessor"})


# the Qwen3 lineage's template (an image item: its vision span)
def _qwen3_template() -> str:
    from bench.device.make_tiny_vlm import QWEN3_TEMPLATE  # (the GPU checkpoints': images and videos)

    return QWEN3_TEMPLATE


def _qwen3(out: str, arch: str) -> None:
    """Qwen3-VL / Qwen3.5 (and their MoE variants): patch 16, merge 2, mean and std 0.5, as
    their public checkpoints; Qwen3-VL with two deepstack levels."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    tok = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                      "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    tok.chat_template = _qwen3_template()
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                             size={"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS}
                             ).save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=_LLM["hidden_size"], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64)
    text = dict(vocab_size=len(tok), bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=False, head_dim=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [8, 12, 12], "mrope_interleaved": True}, **_LLM)
    if arch in (QWEN3VL, QWEN3VL_MOE, INTERNS1PRO):
        vision["deepstack_visual_indexes"] = [0, 1]
        text["num_hidden_layers"] = 3  # lmdeploy's text model: a layer more than the levels
    if arch in (QWEN3VL_MOE, QWEN3_5_MOE):
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1)
    if arch in (QWEN3_5, QWEN3_5_MOE):
        text.update(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32)
    config_class = {QWEN3VL: "Qwen3VLConfig", QWEN3VL_MOE: "Qwen3VLMoeConfig", INTERNS1PRO: "Qwen3VLConfig",
                    QWEN3_5: "Qwen3_5Config", QWEN3_5_MOE: "Qwen3_5MoeConfig"}[arch]
    cfg = getattr(transformers, config_class)(
        text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False)
    _finish(out, cfg, arch, tok, {"processor_class": "NoVideoQwen3VLProcessor"})


def _glm4v(out: str) -> None:
    """GLM-4.1V: patch 14, merge 2, CLIP mean and std, its own smart_resize (a pixel budget that
    counts the temporal factor, small images upscaled), the special tokens its processor reads."""
    from transformers import Glm4vConfig, Glm4vImageProcessorPil

    tok = _tokenizer(["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|im_end|>",
                      "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>",
                      "<|end_of_video|>", "<|video|>"])
    tok.chat_template = (
        "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<|begin_of_image|><|image|><|end_of_image|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
        "{% endif %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
        "{% endif %}")
    tok.save_pretrained(out)
    Glm4vImageProcessorPil(size={"shortest_edge": GLM4V_MIN_PIXELS, "longest_edge": GLM4V_MAX_PIXELS}
                           ).save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    cfg = Glm4vConfig(
        text_config=dict(vocab_size=len(tok), bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, partial_rotary_factor=0.5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5},
                         **{**_LLM, "num_attention_heads": 2, "num_key_value_heads": 1}),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                           out_hidden_size=_LLM["hidden_size"], patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, image_size=56),
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"),
        tie_word_embeddings=False)
    _finish(out, cfg, GLM4V, tok, {"processor_class": "NoVideoGlm4vProcessor"})


def _gemma3(out: str) -> None:
    """Gemma 3: SigLIP at 56 px (patch 14), its patches average-pooled 2x2 into 4 tokens an image
    (the public checkpoints: 896 px, 256 tokens); a fixed bilinear resize, mean and std 0.5."""
    from transformers import Gemma3Config, Gemma3ImageProcessorPil

    tok = _tokenizer(["<|endoftext|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<|im_end|>",
                      "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                     extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                           "image_token": "<image_soft_token>"})
    tok.chat_template = (
        "<bos>{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    tok.save_pretrained(out)
    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, image_mean=[0.5] * 3,
                            image_std=[0.5] * 3).save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    cfg = Gemma3Config(
        text_config=dict(vocab_size=len(tok), bos_token_id=ids("<bos>"), eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, head_dim=64, sliding_window=64,
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                             "rope_theta": 1000000.0},
                                          "sliding_attention": {"rope_type": "default",
                                                                "rope_theta": 10000.0}},
                         **_LLM),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14),
        mm_tokens_per_image=GEMMA3_TOKENS, boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"),
        tie_word_embeddings=False)
    _finish(out, cfg, GEMMA3, tok, {"processor_class": "Gemma3Processor",
                                    "image_seq_length": GEMMA3_TOKENS})


def _llava(out: str) -> None:
    """LLaVA (HF): CLIP at 56 px (patch 14; the public checkpoints: 336 px, 576 tokens), the
    second-last layer's patch tokens (CLS dropped), a two-layer projector; shortest-edge resize and
    centre crop with CLIP's mean and std; a Qwen2 LLM as llava-interleave-qwen's."""
    from transformers import CLIPImageProcessorPil, LlavaConfig

    tok = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"])
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": 56},
                          crop_size={"height": 56, "width": 56}).save_pretrained(out)
    cfg = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14,
                           projection_dim=64),
        text_config=dict(model_type="qwen2", vocab_size=len(tok), architectures=["Qwen2ForCausalLM"],
                         tie_word_embeddings=False, bos_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **_LLM),
        image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
        vision_feature_select_strategy="default", pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    _finish(out, cfg, LLAVA, tok, {"processor_class": "LlavaProcessor", "patch_size": 14,
                                   "vision_feature_select_strategy": "default", "image_token": "<image>",
                                   "num_additional_image_tokens": 1})


def _qwen3_omni(out: str) -> None:
    """Qwen3-Omni (its thinker: what lmdeploy serves): Qwen3-VL's image path (patch 16, merge 2,
    mean and std 0.5, two deepstack levels) beside a Whisper audio encoder; MoE LLM."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3OmniMoeConfig, WhisperFeatureExtractor

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
    tok = _tokenizer(special, extra_special_tokens={
        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
        "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"})
    tok.chat_template = _qwen3_template()
    ip = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                  size={"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS})
    # its image processor and feature extractor in one processor_config.json, as the processor saves them
    register_processors()
    NO_VIDEO["Qwen3OmniMoeProcessor"](image_processor=ip, tokenizer=tok,
                                      feature_extractor=WhisperFeatureExtractor(feature_size=128)).save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    thinker = dict(
        text_config=dict(vocab_size=len(tok), head_dim=64, num_experts=4, num_experts_per_tok=2,
                         **{**_LLM, "num_hidden_layers": 3},
                         moe_intermediate_size=128, decoder_sparse_step=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [8, 12, 12], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                           out_hidden_size=_LLM["hidden_size"], patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        audio_config=dict(d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                          output_dim=_LLM["hidden_size"], num_mel_bins=128),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        audio_token_id=ids("<|audio_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), audio_start_token_id=ids("<|audio_start|>"),
        audio_end_token_id=ids("<|audio_end|>"))
    cfg = Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)
    _finish(out, cfg, QWEN3_OMNI, tok, {"processor_class": "NoVideoQwen3OmniMoeProcessor"})


def _kimi(out: str) -> None:
    """Kimi-K2.5: transformers' ``Kimi_K25Config`` (MoonViT at patch 14, merge 2x2; a tiny
    DeepSeek-V3 LLM) with the ``media_placeholder_token_id`` lmdeploy reads; the processor is
    remote code, the stand-in (``kimi_processor_standin``) copied in and named by auto_map."""
    import shutil

    from transformers import Kimi_K25Config

    tok = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|media_start|>",
                      "<|media_content|>", "<|media_end|>", "<|media_pad|>"])
    tok.chat_template = _qwen3_template().replace("<|vision_start|><|image_pad|><|vision_end|>",
                                               "<|media_start|>image<|media_content|><|media_pad|><|media_end|>")
    tok.save_pretrained(out)
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copy(os.path.join(here, "kimi_processor_standin.py"), out)
    pad = tok.convert_tokens_to_ids("<|media_pad|>")
    text = dict(model_type="deepseek_v3", vocab_size=len(tok), bos_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **_LLM)
    cfg = Kimi_K25Config(
        text_config=text, media_placeholder_token_id=pad, image_token_id=pad,
        vision_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128),
        projection_hidden_size=64, tie_word_embeddings=False)
    _finish(out, cfg, KIMI, tok, {"auto_map": {
        "AutoProcessor": "kimi_processor_standin.KimiK25ProcessorStandIn"}})


def _llama4(out: str) -> None:
    """Llama 4: 56 px tiles (the public checkpoints: 336 px), patch 14, pixel shuffle 0.5, so 4
    ``<|patch|>`` tokens a tile; an image's span holds its tiles' patch tokens, the separators
    between them and an ``<|image|>`` marker before the global tile's. transformers' processor
    and config; the image processor a stand-in (``llama4_image_standin``), by auto_map."""
    import shutil

    tok = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_start|>", "<|image_end|>",
                      "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"])
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(out)
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copy(os.path.join(here, "llama4_image_standin.py"), out)
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Llama4ImageProcessorStandIn", "auto_map": {
            "AutoImageProcessor": "llama4_image_standin.Llama4ImageProcessorStandIn"}}, f, indent=2)
    from bench.device.make_tiny_vlm import llama4_config  # (the GPU checkpoint's)

    cfg = llama4_config(tok)
    _finish(out, cfg, LLAMA4, tok, {"processor_class": "Llama4Processor", "patch_size": 14,
                                    "pixel_shuffle_ratio": 0.5})


def _glm4v_9b(out: str, arch: str = GLM4V_9B) -> None:
    """GLM-4V-9B: EVA2CLIP at 56 px (the public checkpoint: 1120 px, 1602 tokens), patch 14, so
    6 tokens an image, every one the pad token; its remote config a stand-in, by auto_map.
    CogVLM2 (``arch`` COGVLM): the same shape (lmdeploy counts its tokens as GLM-4V's)."""
    tok = _tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_image|>",
                      "<|end_of_image|>"])
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(out)
    from bench.device.make_tiny_vlm import cogvlm_config, glm4v_9b_config  # (the GPU checkpoints')
    from bench.device.seed_remote_code import write_standin

    config = {**(cogvlm_config if arch == COGVLM else glm4v_9b_config)(tok),
              "dtype": "float32", "torch_dtype": "float32"}
    write_standin(out, config["auto_map"]["AutoConfig"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), f, indent=2)
