#!/usr/bin/env python3
"""Build random-weight checkpoints of the seed models, InternVL2-2B and InternVL2-26B, at
their real shapes, and tiny variants of the same architecture that lmdeploy reads on a CPU.

    python3 bench/device/make_seed_models.py /tmp/models --which 2b     # -> /tmp/models/internvl2_2b_shape
    python3 bench/device/make_seed_models.py /tmp/models --which 26b    # -> /tmp/models/internvl2_26b_shape
    python3 bench/device/make_seed_models.py /tmp/models --which tiny   # -> internvl2_{2b,26b}_tiny
    options: --device cuda|cpu (default: cuda if available), --force, --shard-gb 4, --dry-run

Both seed models are the legacy ``InternVLChatModel`` (``model_type`` internvl_chat, ``ps_version``
v2, ``template`` internlm2-chat): InternViT (packed ``attn.qkv``, layer scale ``ls1``/``ls2``) ->
pixel shuffle 0.5 -> ``mlp1`` projector (LayerNorm, Linear, GELU, Linear) -> InternLM2
(``InternLM2ForCausalLM``: ``attention.wqkv`` GQA-interleaved, ``attention.wo``,
``feed_forward.w1/w2/w3``, ``attention_norm``/``ffn_norm``, ``tok_embeddings``, ``output``). 448 px
tiles, patch 14 -> 1024 patches -> 256 tokens a tile; dynamic tiling, 1 to 12 tiles plus a
thumbnail (a 1344x1008 image: 12 + 1 tiles = 3328 image tokens).

Where the values come from (the public ``config.json`` of each model):

- InternVL2-26B (OpenGVLab/InternVL2-26B): vision_config InternViT-6B-448px-V1-5: hidden 3200, 45
  layers, 25 heads (head dim 128), intermediate 12800, ``norm_type`` rms_norm,
  ``qk_normalization`` true, ``qkv_bias`` false, layer_norm_eps 1e-6, gelu; llm_config
  internlm2-chat-20b: hidden 6144, 48 layers, 48 heads, 8 KV heads, intermediate 16384, vocab 92553,
  max positions 32768, rope_theta 1e6, rope_scaling dynamic x3.0, rms_norm_eps 1e-5, untied;
  downsample 0.5, force_image_size 448, max_dynamic_patch 12, use_thumbnail, select_layer -1.
  Read from a verbatim copy of that config.json held in a public repository's source (found with the
  project's code search; the copy names ``_name_or_path`` internlm/internlm2-chat-20b).
- InternVL2-2B (OpenGVLab/InternVL2-2B): vision_config InternViT-300M-448px: hidden 1024, 24 layers,
  16 heads, intermediate 4096, layer_norm, no qk norm, ``qkv_bias`` true (the same block as the
  InternVL2-8B config.json in the same public copy, which uses the same ViT); llm_config
  internlm2-chat-1_8b: hidden 2048, 24 layers, 16 heads, 8 KV heads, intermediate 8192, vocab 92553,
  max positions 32768, rope_theta 1e6, rope_scaling dynamic x2.0, rms_norm_eps 1e-5, untied. The LLM
  values were not found in a stored copy of that file; they are InternLM2-chat-1.8B's published
  shape (2048 x 24, GQA 16/8, FFN 8192) and match the 2B row of ``shared/notes/gpu.md``
  (24 x 1024 ViT -> LLM hidden 2048). Check them against the hub's file when a copy is at hand.

Parameters: 2B 2.21e9 (4.4 GB bf16), 26B 25.5e9 (51 GB bf16); ``--dry-run`` prints the exact
counts and shard plan without writing weights.

What is written (what lmdeploy 0.18 reads; no modeling code: lmdeploy's PyTorch engine has its own
``InternVLChatModel`` / ``InternLM2ForCausalLM`` and TurboMind its own loaders, both keyed on the
weight names above; ``AutoModel`` is used only by lmdeploy's quantization path, not served here):

- ``config.json`` with ``auto_map`` AutoConfig -> ``configuration_internvl_chat.InternVLChatConfig``,
  and the trust_remote_code files ``configuration_internvl_chat.py``,
  ``configuration_intern_vit.py``, ``configuration_internlm2.py`` (written here, small: the config
  classes as the hub's files define their fields; ``llm_config`` becomes an ``InternLM2Config``,
  ``vision_config`` an ``InternVisionConfig``). Load with ``trust_remote_code=True``;
- a tokenizer: a byte-level BPE stand-in (no merges: one token a byte) with InternLM2's special
  tokens *at InternVL2's ids* (``<s>`` 1, ``</s>`` 2, ``<|im_end|>`` 92542, ``<|im_start|>`` 92543,
  ``<img>`` 92544, ``</img>`` 92545, ``<IMG_CONTEXT>`` 92546, ``<quad>``...``</box>`` 92547-92552;
  the ids between are unused fillers), so the vocabulary is the model's 92553; the chat template of
  InternVL2's tokenizer (internlm2-chat: ``<s><|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``),
  which lmdeploy 0.18 uses through its ``hf`` chat template; lmdeploy's legacy InternVL
  preprocessing wraps each image as ``<img><IMG_CONTEXT></img>`` and expands ``<IMG_CONTEXT>``;
- ``generation_config.json`` (eos ``</s>`` and ``<|im_end|>``);
- safetensors shards of ``--shard-gb`` (default 4 GB), each tensor made on the GPU in bf16 with a
  seeded generator (linear/embedding weights N(0, 0.02), norm weights 1 + N(0, 0.02), biases
  N(0, 0.02), layer scales 0.1), moved to host one shard at a time and written; the GPU holds at
  most one shard, the host one shard; never the whole model. ``model.safetensors.index.json``
  last, then ``generation_config.json`` (the "done" marker; a rebuild skips when it is there).

Tiny variants (``--which tiny``, CPU in about a second): ``internvl2_2b_tiny`` (layer_norm ViT with
qkv bias) and ``internvl2_26b_tiny`` (rms_norm ViT with qk normalization, no qkv bias), each a
2-layer ViT of 128 (head dim 64), 56 px tiles (4 tokens a tile, up to 12 tiles + thumbnail), a
2-layer InternLM2 of 256 (4 heads, 2 KV heads), the same tokenizer with compact ids (bytes +
specials) and float32 weights. tests/test_seed_models.py builds them.

Prints one JSON line per model (``SEED {...}``: path, params, bytes written, seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the templates beside this file

from seed_remote_code import REMOTE_FILES  # noqa: E402

# -- shapes --------------------------------------------------------------------------------------


@dataclass
class Spec:
    name: str
    vit: dict[str, Any]
    llm: dict[str, Any]
    image_size: int = 448
    max_dynamic_patch: int = 12
    dtype: str = "bfloat16"
    real_ids: bool = True  # special tokens at InternVL2's ids (vocab 92553); tiny: compact
    extra: dict[str, Any] = field(default_factory=dict)


VIT_300M = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                norm_type="layer_norm", qk_normalization=False, qkv_bias=True, initializer_factor=1.0)
VIT_6B = dict(hidden_size=3200, num_hidden_layers=45, num_attention_heads=25, intermediate_size=12800,
              norm_type="rms_norm", qk_normalization=True, qkv_bias=False, initializer_factor=0.1)
LLM_1_8B = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=92553,
                rope_scaling={"type": "dynamic", "factor": 2.0})
LLM_20B = dict(hidden_size=6144, num_hidden_layers=48, num_attention_heads=48, num_key_value_heads=8,
               intermediate_size=16384, vocab_size=92553,
               rope_scaling={"type": "dynamic", "factor": 3.0})
TINY_VIT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
TINY_LLM = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=512, rope_scaling={"type": "dynamic", "factor": 2.0})

SPECS = {
    "2b": Spec("internvl2_2b_shape", VIT_300M, LLM_1_8B),
    "26b": Spec("internvl2_26b_shape", VIT_6B, LLM_20B),
    "tiny2b": Spec("internvl2_2b_tiny", {**VIT_300M, **TINY_VIT}, TINY_LLM, image_size=56,
                   dtype="float32", real_ids=False),
    "tiny26b": Spec("internvl2_26b_tiny", {**VIT_6B, **TINY_VIT}, TINY_LLM, image_size=56,
                    dtype="float32", real_ids=False),
}
WHICH = {"2b": ["2b"], "26b": ["26b"], "tiny": ["tiny2b", "tiny26b"],
         "all": ["tiny2b", "tiny26b", "2b", "26b"]}

# InternLM2 / InternVL2 special tokens and their ids in InternVL2's tokenizer (vocab 92553)
SPECIAL_IDS = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|plugin|>": 92538, "<|interpreter|>": 92539,
               "<|action_end|>": 92540, "<|action_start|>": 92541, "<|im_end|>": 92542,
               "<|im_start|>": 92543, "<img>": 92544, "</img>": 92545, "<IMG_CONTEXT>": 92546,
               "<quad>": 92547, "</quad>": 92548, "<ref>": 92549, "</ref>": 92550, "<box>": 92551,
               "</box>": 92552}
# InternVL2's tokenizer chat template (internlm2-chat)
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")

# -- config, tokenizer ---------------------------------------------------------------------------

def config_dict(spec: Spec, vocab_size: int) -> dict[str, Any]:
    vit = {k: v for k, v in spec.vit.items()}
    vision = dict(architectures=["InternVisionModel"], model_type="intern_vit_6b", num_channels=3,
                  patch_size=14, image_size=spec.image_size, hidden_act="gelu", layer_norm_eps=1e-6,
                  dropout=0.0, attention_dropout=0.0, drop_path_rate=0.0, initializer_range=0.02,
                  use_flash_attn=False, dtype=spec.dtype, torch_dtype=spec.dtype, **vit)
    llm = dict(architectures=["InternLM2ForCausalLM"], model_type="internlm2",
               auto_map={"AutoConfig": "configuration_internlm2.InternLM2Config"},
               hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000,
               bias=False, tie_word_embeddings=False, use_cache=True, initializer_range=0.02,
               attn_implementation="eager",
               dtype=spec.dtype, torch_dtype=spec.dtype, **{**spec.llm, "vocab_size": vocab_size})
    return dict(
        architectures=["InternVLChatModel"], model_type="internvl_chat",
        auto_map={"AutoConfig": "configuration_internvl_chat.InternVLChatConfig"},
        downsample_ratio=0.5, dynamic_image_size=True, force_image_size=spec.image_size, ps_version="v2",
        select_layer=-1, template="internlm2-chat", use_thumbnail=True, min_dynamic_patch=1,
        max_dynamic_patch=spec.max_dynamic_patch, use_backbone_lora=0, use_llm_lora=0,
        vision_config=vision, llm_config=llm, dtype=spec.dtype, torch_dtype=spec.dtype)


def write_tokenizer(out: str, real_ids: bool) -> dict[str, int]:
    """Byte-level BPE stand-in with InternVL2's special tokens; returns the vocabulary (token -> id).

    ``real_ids``: the specials at InternVL2's ids, the 256 byte tokens right after ``</s>``, unused
    fillers between (vocabulary 92553); otherwise compact (bytes, then the specials)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = sorted(SPECIAL_IDS, key=SPECIAL_IDS.get)
    alphabet = sorted(ByteLevel.alphabet())
    if real_ids:
        vocab = {s: i for s, i in SPECIAL_IDS.items()}
        vocab.update({ch: 3 + i for i, ch in enumerate(alphabet)})
        first_special = min(i for i in SPECIAL_IDS.values() if i > 2)
        vocab.update({f"[UNUSED_{i}]": i for i in range(3 + len(alphabet), first_special)})
    else:
        vocab = {ch: i for i, ch in enumerate(alphabet)}
        vocab.update({s: len(alphabet) + i for i, s in enumerate(specials)})
    assert sorted(vocab.values()) == list(range(len(vocab))), "ids must be dense"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # already in the vocabulary: added tokens keep those ids
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert all(tok.token_to_id(s) == vocab[s] for s in specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")  # the class name every transformers knows
    with open(path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tc, f, indent=2)
    return vocab


# -- weights -------------------------------------------------------------------------------------

def tensors(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) for every weight, in the hub checkpoints' naming."""
    v, m = cfg["vision_config"], cfg["llm_config"]
    d, inter, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    n_pos = (v["image_size"] // p) ** 2 + 1
    pre = "vision_model."
    yield pre + "embeddings.class_embedding", (1, 1, d), "w"
    yield pre + "embeddings.patch_embedding.weight", (d, 3, p, p), "w"
    yield pre + "embeddings.patch_embedding.bias", (d,), "b"
    yield pre + "embeddings.position_embedding", (1, n_pos, d), "w"
    for i in range(v["num_hidden_layers"]):
        q = f"{pre}encoder.layers.{i}."
        yield q + "attn.qkv.weight", (3 * d, d), "w"
        if v["qkv_bias"]:
            yield q + "attn.qkv.bias", (3 * d,), "b"
        if v["qk_normalization"]:
            yield q + "attn.q_norm.weight", (d,), "n"
            yield q + "attn.k_norm.weight", (d,), "n"
        yield q + "attn.proj.weight", (d, d), "w"
        yield q + "attn.proj.bias", (d,), "b"
        yield q + "mlp.fc1.weight", (inter, d), "w"
        yield q + "mlp.fc1.bias", (inter,), "b"
        yield q + "mlp.fc2.weight", (d, inter), "w"
        yield q + "mlp.fc2.bias", (d,), "b"
        for k in ("norm1", "norm2"):
            yield q + k + ".weight", (d,), "n"
            if v["norm_type"] == "layer_norm":
                yield q + k + ".bias", (d,), "b"
        yield q + "ls1", (d,), "ls"
        yield q + "ls2", (d,), "ls"
    h, d4 = m["hidden_size"], 4 * d  # pixel shuffle 0.5: 4 patches a token
    yield "mlp1.0.weight", (d4,), "n"
    yield "mlp1.0.bias", (d4,), "b"
    yield "mlp1.1.weight", (h, d4), "w"
    yield "mlp1.1.bias", (h,), "b"
    yield "mlp1.3.weight", (h, h), "w"
    yield "mlp1.3.bias", (h,), "b"
    heads, kv, ffn, vocab = (m["num_attention_heads"], m["num_key_value_heads"], m["intermediate_size"],
                             m["vocab_size"])
    hd = h // heads
    lm = "language_model."
    yield lm + "model.tok_embeddings.weight", (vocab, h), "w"
    for i in range(m["num_hidden_layers"]):
        q = f"{lm}model.layers.{i}."
        yield q + "attention.wqkv.weight", ((heads + 2 * kv) * hd, h), "w"
        yield q + "attention.wo.weight", (h, heads * hd), "w"
        yield q + "feed_forward.w1.weight", (ffn, h), "w"
        yield q + "feed_forward.w3.weight", (ffn, h), "w"
        yield q + "feed_forward.w2.weight", (h, ffn), "w"
        yield q + "attention_norm.weight", (h,), "n"
        yield q + "ffn_norm.weight", (h,), "n"
    yield lm + "model.norm.weight", (h,), "n"
    yield lm + "output.weight", (vocab, h), "w"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_weights(out: str, cfg: dict[str, Any], dtype: str, device: str, shard_bytes: int) -> dict[str, Any]:
    """Make each tensor on ``device`` and write shards of about ``shard_bytes``; returns counts."""
    import torch
    from safetensors.torch import save_file

    t_dtype = getattr(torch, dtype)
    item = torch.empty((), dtype=t_dtype).element_size()
    plan = list(tensors(cfg))
    total = sum(_numel(s) for _, s, _ in plan) * item
    n_shards = max(1, -(-total // shard_bytes))
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    size = written = 0
    index = 0

    def flush() -> None:
        nonlocal shard, size, index, written
        if not shard:
            return
        index += 1
        name = (f"model-{index:05d}-of-{n_shards:05d}.safetensors" if n_shards > 1 else "model.safetensors")
        host = {k: v.to("cpu") for k, v in shard.items()}  # one shard on the host at a time
        shard.clear()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        save_file(host, os.path.join(out, name), metadata={"format": "pt"})
        written += os.path.getsize(os.path.join(out, name))
        for k in host:
            weight_map[k] = name
        del host
        size = 0

    with torch.no_grad():
        for name, shape, init in plan:
            if init == "ls":
                t = torch.full(shape, 0.1, dtype=t_dtype, device=device)
            else:
                t = torch.randn(shape, generator=gen, dtype=t_dtype, device=device).mul_(0.02)
                if init == "n":
                    t.add_(1.0)
            nbytes = t.numel() * item
            if shard and size + nbytes > shard_bytes:
                flush()
            shard[name] = t
            size += nbytes
        flush()
    if index != n_shards:  # the plan's count was a lower bound: rename to the real count
        for old in sorted(set(weight_map.values())):
            new = old.replace(f"-of-{n_shards:05d}", f"-of-{index:05d}")
            os.rename(os.path.join(out, old), os.path.join(out, new))
            for k, v in weight_map.items():
                if v == old:
                    weight_map[k] = new
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return dict(params=sum(_numel(s) for _, s, _ in plan), tensor_bytes=total, bytes_written=written,
                shards=index)


# -- build ---------------------------------------------------------------------------------------

def build(key: str, models_dir: str, device: str | None = None, force: bool = False,
          shard_gb: float = 4.0, dry_run: bool = False) -> dict[str, Any]:
    spec = SPECS[key]
    out = os.path.join(models_dir, spec.name)
    done = os.path.join(out, "generation_config.json")  # written last
    if os.path.exists(done) and not force and not dry_run:
        return dict(which=key, path=out, built=False)
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    ids = write_tokenizer(out, spec.real_ids)
    vocab = len(ids)
    cfg = config_dict(spec, vocab)
    cfg["llm_config"].update(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["</s>"])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for fname, text in REMOTE_FILES.items():
        with open(os.path.join(out, fname), "w") as f:
            f.write(text)
    plan = list(tensors(cfg))
    params = sum(_numel(s) for _, s, _ in plan)
    res: dict[str, Any] = dict(which=key, path=out, params=params, params_B=round(params / 1e9, 3),
                               vocab=vocab)
    if dry_run:
        item = 2 if spec.dtype in ("bfloat16", "float16") else 4
        res.update(dry_run=True, tensor_bytes=params * item,
                   shards=max(1, -(-params * item // int(shard_gb * 1e9))))
        return res
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t1 = time.time()
    res.update(write_weights(out, cfg, spec.dtype, device, int(shard_gb * 1e9)))
    with open(done, "w") as f:
        json.dump(dict(bos_token_id=ids["<s>"], eos_token_id=[ids["</s>"], ids["<|im_end|>"]],
                       pad_token_id=ids["</s>"]), f, indent=2)
    res.update(built=True, device=device, weights_s=round(time.time() - t1, 1),
               build_s=round(time.time() - t0, 1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models_dir", nargs="?", default="/tmp/models")
    ap.add_argument("--which", default="tiny", choices=sorted(WHICH))
    ap.add_argument("--device", help="where to make the weights (default: cuda if available)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the checkpoint is there")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="shard size in GB (default 4)")
    ap.add_argument("--dry-run", action="store_true", help="config, tokenizer, counts; no weights")
    a = ap.parse_args(argv)
    for key in WHICH[a.which]:
        print("SEED", json.dumps(build(key, a.models_dir, a.device, a.force, a.shard_gb, a.dry_run)),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
