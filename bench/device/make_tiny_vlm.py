#!/usr/bin/env python3
"""Build tiny, random-initialised, hub-free VLM checkpoints that lmdeploy 0.18 (PyTorch engine
and TurboMind) can load. Run where the models are used (the GPU machine builds its own in seconds).

    python3 bench/device/make_tiny_vlm.py OUT_DIR
        [--arch internvl|qwen2vl|internvl_chat|qwen3vl|qwen3_5|qwen3vl_moe|qwen3_5_moe|glm4v|gemma3|llava|
                llama4|glm4v_9b|cogvlm|all]
                                          [--dtype bfloat16|float16|float32]

Writes OUT_DIR/internvl_hf_tiny, OUT_DIR/qwen2vl_tiny and/or OUT_DIR/internvl_chat_tiny:
config.json (with `architectures` written explicitly), tokenizer files (byte-level BPE, no merges,
plus the special tokens the processors need), processor/preprocessor configs and
model.safetensors (random weights). internvl_chat_tiny is a legacy ``InternVLChatModel``
checkpoint (InternViT + MLP projector + Qwen2 LLM, ps_version v2, dynamic tiling) with its own
small ``configuration_internvl_chat.py`` (load it with ``trust_remote_code=True``; no hub access).

Head dims are 64 in both the LLM and the ViT so that lmdeploy's Triton attention kernels see a
realistic shape. Needs only torch + transformers (>= 5.x; tested with 5.17 and 5.24) + tokenizers.
"""
import argparse
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

LLM = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=4096)


def _bpe_tokenizer_file(out, special):
    """Byte-level BPE with no merges: every byte is one token; specials appended at the end."""
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)
    path = os.path.join(out, '_tmp_tokenizer.json')
    tok.save(path)
    return path


QWEN_VL_SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|vision_start|>', '<|vision_end|>',
                   '<|image_pad|>', '<|video_pad|>']
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_tokenizer(out, special):
    """A Qwen2 tokenizer over the byte-level BPE (``special`` appended), ChatML's template."""
    from transformers import Qwen2TokenizerFast
    tmp = _bpe_tokenizer_file(out, special)
    tok = Qwen2TokenizerFast(tokenizer_file=tmp, eos_token='<|im_end|>', pad_token='<|endoftext|>')
    os.remove(tmp)
    tok.chat_template = CHATML
    return tok


def _patch_config(out, arch, dtype):
    """Write architectures + dtype explicitly (save_pretrained may leave them null / float32)."""
    p = os.path.join(out, 'config.json')
    c = json.load(open(p))
    c['architectures'] = [arch]
    for d in [c] + [c[k] for k in ('text_config', ) if isinstance(c.get(k), dict)]:
        d['dtype'] = dtype
        d['torch_dtype'] = dtype
    json.dump(c, open(p, 'w'), indent=2)


def _save(model_cls, cfg, out, arch, dtype, eos_token_id, pad_token_id, renames=(), config=None,
          flat_text=False, public=None):
    """Random weights saved as the public checkpoints hold them, which is what lmdeploy's loaders
    read: ``renames`` (old prefix, new prefix) for the weight names transformers 5 saves
    otherwise (a SigLIP/CLIP tower's ``vision_model.`` level); ``config``: entries written into
    config.json over the saved ones (a dict value merged one level down); ``flat_text``: the
    text config's entries at the top level too (GLM-4.1V's config.json, which lmdeploy's text
    model reads).; ``public``: a function that puts a weight saved in transformers' layout into the public
    checkpoints' (name, tensor -> tensor)."""
    torch.manual_seed(0)
    m = model_cls(cfg).to(getattr(torch, dtype)).eval()
    m.save_pretrained(out, safe_serialization=True)
    _patch_config(out, arch, dtype)
    if renames or public:
        _rename_weights(os.path.join(out, 'model.safetensors'), renames, public)
    p = os.path.join(out, 'config.json')
    c = json.load(open(p))
    for k, v in (config or {}).items():
        c[k] = {**c.get(k, {}), **v} if isinstance(v, dict) else v
    if flat_text:  # every entry, defaults too (config.json keeps only what differs from them)
        text = json.loads(cfg.text_config.to_json_string(use_diff=False))
        c = {**{k: v for k, v in text.items() if k not in ('model_type', 'architectures')}, **c}
    json.dump(c, open(p, 'w'), indent=2)
    json.dump(dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=pad_token_id),
              open(os.path.join(out, 'generation_config.json'), 'w'), indent=2)
    from safetensors import safe_open
    keys = list(safe_open(os.path.join(out, 'model.safetensors'), 'pt').keys())
    assert any(k.endswith('lm_head.weight') for k in keys), 'lm_head.weight missing from checkpoint'


def _rename_weights(path, renames, public=None):
    from safetensors.torch import load_file, save_file
    weights = load_file(path)
    renamed = {}
    for k, v in weights.items():
        for old, new in renames:
            if k.startswith(old) and not k.startswith(new):
                k = new + k[len(old):]
        renamed[k] = public(k, v).contiguous() if public else v
    save_file(renamed, path, metadata={'format': 'pt'})


def internvl_hf_processor(out, tile, max_patches, image_seq_length):
    """Write the tokenizer and processor of an InternVL-HF checkpoint into ``out``; return the
    tokenizer. Byte-level BPE (``_bpe_tokenizer_file``) with InternVL's special tokens, a Qwen
    chat template that puts ``<IMG_CONTEXT>`` where an image goes, and a GotOcr2 processor of
    ``tile``-px tiles (up to ``max_patches`` crops + thumbnail, ``image_seq_length`` tokens each).
    Shared by the tiny checkpoint and make_real_shape.py's InternVL3-2B shape."""
    from transformers import (
        GotOcr2ImageProcessorFast,
        InternVLProcessor,
        InternVLVideoProcessor,
        Qwen2TokenizerFast,
    )
    special = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<img>', '</img>', '<IMG_CONTEXT>', '<video>']
    tmp = _bpe_tokenizer_file(out, special)
    tok = Qwen2TokenizerFast(tokenizer_file=tmp, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                             extra_special_tokens={'start_image_token': '<img>', 'end_image_token': '</img>',
                                                   'context_image_token': '<IMG_CONTEXT>',
                                                   'video_token': '<video>'})
    os.remove(tmp)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<IMG_CONTEXT>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ip = GotOcr2ImageProcessorFast(size={'height': tile, 'width': tile}, crop_to_patches=True, min_patches=1,
                                   max_patches=max_patches)
    proc = InternVLProcessor(image_processor=ip, tokenizer=tok, video_processor=InternVLVideoProcessor(),
                             image_seq_length=image_seq_length, chat_template=tok.chat_template)
    proc.save_pretrained(out)
    return tok


def internvl_hf(out, dtype='bfloat16'):
    """HF-native InternVL (InternVLForConditionalGeneration) with a Qwen2 LLM.

    56 px tiles, patch 14 -> 16 patches, pixel-shuffle 0.5 -> 4 image tokens per tile; up to
    4 crops + thumbnail per image.
    """
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    os.makedirs(out, exist_ok=True)
    tok = internvl_hf_processor(out, tile=56, max_patches=4, image_seq_length=4)
    cfg = InternVLConfig(
        vision_config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                           image_size=[56, 56], patch_size=[14, 14]),
        text_config=dict(model_type='qwen2', vocab_size=len(tok), architectures=['Qwen2ForCausalLM'],
                         tie_word_embeddings=False, bos_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **LLM),
        image_token_id=tok.convert_tokens_to_ids('<IMG_CONTEXT>'), image_seq_length=4, downsample_ratio=0.5,
        tie_word_embeddings=False)  # untied: lm_head must be written to the checkpoint
    cfg.architectures = ['InternVLForConditionalGeneration']
    _save(InternVLForConditionalGeneration, cfg, out, 'InternVLForConditionalGeneration', dtype,
          tok.eos_token_id, tok.pad_token_id)
    return out


def qwen2vl(out, dtype='bfloat16'):
    """Qwen2-VL with a 2-layer ViT (embed 128, head_dim 64) and a 2-layer LLM (hidden 256, head_dim 64)."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )
    os.makedirs(out, exist_ok=True)
    tok = qwen_tokenizer(out, QWEN_VL_SPECIAL)
    ip = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    proc = Qwen2VLProcessor(image_processor=ip, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                            chat_template=tok.chat_template)
    proc.save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2VLConfig(
        # mrope_section sums to head_dim/2
        vocab_size=len(tok), rope_scaling={'type': 'mrope', 'mrope_section': [8, 12, 12]},
        vision_config=dict(depth=2, embed_dim=128, hidden_size=LLM['hidden_size'], num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=ids('<|image_pad|>'), video_token_id=ids('<|video_pad|>'),
        vision_start_token_id=ids('<|vision_start|>'), vision_end_token_id=ids('<|vision_end|>'),
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id,
        tie_word_embeddings=False, **LLM)
    cfg.architectures = ['Qwen2VLForConditionalGeneration']
    _save(Qwen2VLForConditionalGeneration, cfg, out, 'Qwen2VLForConditionalGeneration', dtype,
          tok.eos_token_id, tok.pad_token_id)
    return out


REMOTE_CONFIG = '''"""Minimal remote config of the tiny legacy InternVL (bench/device/make_tiny_vlm.py)."""
from transformers import PretrainedConfig, Qwen2Config


class InternVisionConfig(PretrainedConfig):
    model_type = "intern_vit_6b"


class InternVLChatConfig(PretrainedConfig):
    model_type = "internvl_chat"

    def __init__(self, vision_config=None, llm_config=None, **kwargs):
        super().__init__(**kwargs)
        self.vision_config = InternVisionConfig(**(vision_config or {}))
        self.llm_config = Qwen2Config(**(llm_config or {}))
'''


def internvl_chat(out, dtype='bfloat16'):
    """Legacy InternVL (InternVLChatModel, as InternVL2/2.5 checkpoints): InternViT (2 x 128, 56 px,
    patch 14, packed qkv, layer scale), pixel shuffle 0.5 (v2) -> MLP projector -> Qwen2 LLM.
    4 image tokens a tile, up to 4 tiles + thumbnail (lmdeploy's dynamic preprocess, torchvision)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM
    os.makedirs(out, exist_ok=True)
    tok = qwen_tokenizer(out, ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<img>', '</img>',
                               '<IMG_CONTEXT>'])
    tok.save_pretrained(out)
    vit, inter, size, patch = 128, 256, 56, 14
    llm = dict(model_type='qwen2', architectures=['Qwen2ForCausalLM'], vocab_size=len(tok),
               tie_word_embeddings=False, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, dtype=dtype, torch_dtype=dtype, **LLM)
    config = dict(
        model_type='internvl_chat', architectures=['InternVLChatModel'], template='internvl2_5',
        auto_map={'AutoConfig': 'configuration_internvl_chat.InternVLChatConfig'},
        vision_config=dict(model_type='intern_vit_6b', architectures=['InternVisionModel'], hidden_size=vit,
                           num_attention_heads=2, num_hidden_layers=2, intermediate_size=inter,
                           num_channels=3, image_size=size, patch_size=patch, layer_norm_eps=1e-6,
                           norm_type='layer_norm', qk_normalization=False, qkv_bias=True,
                           hidden_act='gelu', use_flash_attn=False, drop_path_rate=0.0, dtype=dtype),
        llm_config=llm, force_image_size=size, downsample_ratio=0.5, ps_version='v2', select_layer=-1,
        dynamic_image_size=True, use_thumbnail=True, min_dynamic_patch=1, max_dynamic_patch=4,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, dtype=dtype, torch_dtype=dtype)
    json.dump(config, open(os.path.join(out, 'config.json'), 'w'), indent=2)
    with open(os.path.join(out, 'configuration_internvl_chat.py'), 'w') as f:
        f.write(REMOTE_CONFIG)
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.pad_token_id)
    json.dump(ids, open(os.path.join(out, 'generation_config.json'), 'w'), indent=2)
    torch.manual_seed(0)
    t = getattr(torch, dtype)
    w = {f'language_model.{k}': v.to(t).contiguous() for k, v in Qwen2ForCausalLM(Qwen2Config(**{
        k: v for k, v in llm.items() if k not in ('model_type', 'architectures')})).state_dict().items()}
    n = (size // patch) ** 2

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape) * std).to(t)

    v = 'vision_model.'
    w[v + 'embeddings.class_embedding'] = rnd(1, 1, vit)
    w[v + 'embeddings.position_embedding'] = rnd(1, n + 1, vit)
    w[v + 'embeddings.patch_embedding.weight'] = rnd(vit, 3, patch, patch)
    w[v + 'embeddings.patch_embedding.bias'] = rnd(vit)
    for i in range(config['vision_config']['num_hidden_layers']):
        p = f'{v}encoder.layers.{i}.'
        w.update({p + 'ls1': torch.full((vit,), 0.5, dtype=t), p + 'ls2': torch.full((vit,), 0.5, dtype=t),
                  p + 'norm1.weight': 1 + rnd(vit), p + 'norm1.bias': rnd(vit),
                  p + 'norm2.weight': 1 + rnd(vit), p + 'norm2.bias': rnd(vit),
                  p + 'attn.qkv.weight': rnd(3 * vit, vit), p + 'attn.qkv.bias': rnd(3 * vit),
                  p + 'attn.proj.weight': rnd(vit, vit), p + 'attn.proj.bias': rnd(vit),
                  p + 'mlp.fc1.weight': rnd(inter, vit), p + 'mlp.fc1.bias': rnd(inter),
                  p + 'mlp.fc2.weight': rnd(vit, inter), p + 'mlp.fc2.bias': rnd(vit)})
    h = LLM['hidden_size']
    w.update({'mlp1.0.weight': 1 + rnd(4 * vit), 'mlp1.0.bias': rnd(4 * vit),
              'mlp1.1.weight': rnd(h, 4 * vit), 'mlp1.1.bias': rnd(h),
              'mlp1.3.weight': rnd(h, h), 'mlp1.3.bias': rnd(h)})
    save_file(w, os.path.join(out, 'model.safetensors'), metadata={'format': 'pt'})
    return out


QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen3_processor(out, min_pixels, max_pixels):
    """Write a Qwen3-VL processor into ``out`` (patch 16, merge 2, mean/std 0.5, images of
    ``min_pixels`` to ``max_pixels``) with the byte-level tokenizer and Qwen3's template; return
    the tokenizer. Shared by the tiny checkpoints and make_real_shape.py's Qwen3-VL-2B shape."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    tok = qwen_tokenizer(out, QWEN_VL_SPECIAL)
    tok.chat_template = QWEN3_TEMPLATE
    ip = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                               image_std=[0.5] * 3,
                               size={'shortest_edge': min_pixels, 'longest_edge': max_pixels})
    proc = Qwen3VLProcessor(image_processor=ip, tokenizer=tok,
                            video_processor=Qwen3VLVideoProcessor(
                                patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                image_std=[0.5] * 3,
                                size={'shortest_edge': min_pixels, 'longest_edge': 4 * max_pixels}),
                            chat_template=tok.chat_template)
    proc.save_pretrained(out)
    return tok


def qwen3(out, arch, dtype='bfloat16'):
    """Qwen3-VL (``qwen3vl``: two deepstack levels) or Qwen3.5 (``qwen3_5``: one linear-attention
    and one full-attention layer), or their MoE variants (``qwen3vl_moe``, ``qwen3_5_moe``: 4
    experts, 2 a token): patch 16, merge 2, mean/std 0.5 as their public checkpoints; a 2-layer
    ViT (hidden 128, head_dim 64) and a 2-layer LLM (hidden 256, head_dim 64)."""
    import transformers
    os.makedirs(out, exist_ok=True)
    tok = qwen3_processor(out, 32 * 32, 32 * 32 * 64)
    ids = tok.convert_tokens_to_ids
    vision = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                  out_hidden_size=LLM['hidden_size'], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64)
    text = dict(vocab_size=len(tok), bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=False, head_dim=64,
                rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0, 'mrope_section': [8, 12, 12],
                                 'mrope_interleaved': True}, **LLM)
    moe = arch.endswith('_moe')
    if moe:
        # (the experts' width other than the hidden size: a fused weight's layout is then unambiguous)
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
    if arch.startswith('qwen3vl'):
        vision['deepstack_visual_indexes'] = [0, 1]
        # lmdeploy's Qwen3-VL text model adds a level after each of the first layers and ends
        # with a norm that needs a residual: one layer more than the levels (the real ones: 3 of 28)
        text['num_hidden_layers'] = 3
        names = ('Qwen3VLMoeConfig', 'Qwen3VLMoeForConditionalGeneration') if moe else (
            'Qwen3VLConfig', 'Qwen3VLForConditionalGeneration')
    else:
        text.update(layer_types=['linear_attention', 'full_attention'], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64)
        names = ('Qwen3_5MoeConfig', 'Qwen3_5MoeForConditionalGeneration') if moe else (
            'Qwen3_5Config', 'Qwen3_5ForConditionalGeneration')
    cfg = getattr(transformers, names[0])(
        text_config=text, vision_config=vision, image_token_id=ids('<|image_pad|>'),
        video_token_id=ids('<|video_pad|>'), vision_start_token_id=ids('<|vision_start|>'),
        vision_end_token_id=ids('<|vision_end|>'), tie_word_embeddings=False)
    cfg.architectures = [names[1]]
    # (Qwen3-VL-MoE's config.json has norm_topk_prob, which lmdeploy reads; transformers 5.24 drops it)
    extra = {'text_config': {'norm_topk_prob': True}} if moe else None
    _save(getattr(transformers, names[1]), cfg, out, names[1], dtype, tok.eos_token_id, tok.pad_token_id,
          config=extra, public=_public_experts if moe else None)
    return out


def _public_experts(name, w):
    """Fused expert weights as the public Qwen3-VL-MoE checkpoints hold them (gate_up_proj [experts,
    hidden, 2 x width], down_proj [experts, width, hidden], which lmdeploy's loader transposes),
    from transformers 5's [experts, 2 x width, hidden] and [experts, hidden, width], if so saved."""
    hidden = LLM['hidden_size']
    if name.endswith('experts.gate_up_proj') and w.shape[-1] == hidden:
        return w.transpose(-1, -2)
    if name.endswith('experts.down_proj') and w.shape[-2] == hidden:
        return w.transpose(-1, -2)
    return w


GLM4V_SPECIAL = ['<|endoftext|>', '[gMASK]', '<sop>', '<|user|>', '<|assistant|>', '<|im_end|>',
                 '<|begin_of_image|>', '<|end_of_image|>', '<|image|>', '<|begin_of_video|>',
                 '<|end_of_video|>', '<|video|>']
GLM4V_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|begin_of_image|><|image|><|end_of_image|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def glm4v(out, dtype='bfloat16'):
    """GLM-4.1V (``Glm4vForConditionalGeneration``): patch 14, merge 2, CLIP mean/std, its own
    smart_resize (1 to 64 tokens here); a 2-layer ViT (hidden 128, head_dim 64) and a 2-layer LLM
    (hidden 256, 2 heads of 128 as the real one, half of each rotary, mrope). The tokenizer and
    template of tests/lmdeploy_tiny.py's GLM-4.1V checkpoint."""
    from transformers import (
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vImageProcessor,
        Glm4vProcessor,
        Glm4vVideoProcessor,
    )
    os.makedirs(out, exist_ok=True)
    tok = qwen_tokenizer(out, GLM4V_SPECIAL)
    tok.chat_template = GLM4V_TEMPLATE
    ip = Glm4vImageProcessor(size={'shortest_edge': 28 * 28 * 2, 'longest_edge': 28 * 28 * 2 * 64})
    proc = Glm4vProcessor(image_processor=ip, tokenizer=tok, video_processor=Glm4vVideoProcessor(),
                          chat_template=tok.chat_template)
    proc.save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    cfg = Glm4vConfig(
        text_config=dict(vocab_size=len(tok), bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, partial_rotary_factor=0.5,
                         rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0,
                                          'mrope_section': [8, 12, 12], 'partial_rotary_factor': 0.5},
                         **{**LLM, 'num_attention_heads': 2, 'num_key_value_heads': 1}),
        vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                           out_hidden_size=LLM['hidden_size'], patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, image_size=56),
        image_token_id=ids('<|image|>'), video_token_id=ids('<|video|>'),
        image_start_token_id=ids('<|begin_of_image|>'), image_end_token_id=ids('<|end_of_image|>'),
        video_start_token_id=ids('<|begin_of_video|>'), video_end_token_id=ids('<|end_of_video|>'),
        tie_word_embeddings=False)
    cfg.architectures = ['Glm4vForConditionalGeneration']
    cfg.pad_token_id = tok.pad_token_id  # (GLM-4.1V's config.json has it; lmdeploy's text model reads it)
    _save(Glm4vForConditionalGeneration, cfg, out, 'Glm4vForConditionalGeneration', dtype,
          tok.eos_token_id, tok.pad_token_id, flat_text=True,
          config={'attention_bias': True, 'partial_rotary_factor': 0.5})  # (GLM-4.1V's config.json)
    return out


def gemma3(out, dtype='bfloat16'):
    """Gemma 3 (``Gemma3ForConditionalGeneration``): SigLIP at 56 px (patch 14, hidden 128, head_dim
    64), 2x2 pooled into 4 tokens an image (the public checkpoints: 896 px, 256 tokens), a fixed
    bilinear resize with mean/std 0.5; a 2-layer Gemma 3 LLM (hidden 256, head_dim 64, sliding
    window 64). The tokenizer and template of tests/lmdeploy_tiny.py's Gemma 3 checkpoint."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Qwen2TokenizerFast,
    )
    os.makedirs(out, exist_ok=True)
    tmp = _bpe_tokenizer_file(out, ['<|endoftext|>', '<bos>', '<start_of_turn>', '<end_of_turn>',
                                    '<|im_end|>', '<start_of_image>', '<end_of_image>', '<image_soft_token>'])
    image_tokens = {'boi_token': '<start_of_image>', 'eoi_token': '<end_of_image>',
                    'image_token': '<image_soft_token>'}
    tok = Qwen2TokenizerFast(tokenizer_file=tmp, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                             extra_special_tokens=image_tokens)
    os.remove(tmp)
    tok.chat_template = (
        "<bos>{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    ip = Gemma3ImageProcessor(size={'height': 56, 'width': 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template,
                    image_seq_length=4).save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    cfg = Gemma3Config(
        text_config=dict(vocab_size=len(tok), bos_token_id=ids('<bos>'), eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, head_dim=64, sliding_window=64,
                         # gemma-3-4b's: lmdeploy's Gemma reads the full-attention layers' factor
                         rope_parameters={'full_attention': {'rope_type': 'linear', 'factor': 8.0,
                                                             'rope_theta': 1000000.0},
                                          'sliding_attention': {'rope_type': 'default',
                                                                'rope_theta': 10000.0}},
                         **LLM),
        vision_config=dict(model_type='siglip_vision_model', hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=ids('<start_of_image>'), eoi_token_index=ids('<end_of_image>'),
        image_token_index=ids('<image_soft_token>'), tie_word_embeddings=False)
    cfg.architectures = ['Gemma3ForConditionalGeneration']
    _save(Gemma3ForConditionalGeneration, cfg, out, 'Gemma3ForConditionalGeneration', dtype,
          tok.eos_token_id, tok.pad_token_id, renames=[('vision_tower.', 'vision_tower.vision_model.')],
          config={'text_config': {'architectures': ['Gemma3ForCausalLM']}})
    return out


def llava(out, dtype='bfloat16'):
    """LLaVA (HF) (``LlavaForConditionalGeneration``): CLIP at 56 px (patch 14, hidden 128, head_dim
    64), the second-last layer's 16 patch tokens (CLS dropped), a 2-layer projector, a Qwen2 LLM
    as llava-interleave-qwen's; shortest-edge resize and centre crop. The tokenizer and template of
    tests/lmdeploy_tiny.py's LLaVA checkpoint."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    os.makedirs(out, exist_ok=True)
    tok = qwen_tokenizer(out, ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<image>'])
    ip = CLIPImageProcessor(size={'shortest_edge': 56}, crop_size={'height': 56, 'width': 56})
    LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy='default',
                   image_token='<image>', num_additional_image_tokens=1,
                   chat_template=tok.chat_template).save_pretrained(out)
    cfg = LlavaConfig(
        vision_config=dict(model_type='clip_vision_model', hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14,
                           projection_dim=128),
        text_config=dict(model_type='qwen2', vocab_size=len(tok), tie_word_embeddings=False,
                         bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **LLM),
        image_token_index=tok.convert_tokens_to_ids('<image>'), vision_feature_layer=-2,
        vision_feature_select_strategy='default', pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    cfg.architectures = ['LlavaForConditionalGeneration']
    _save(LlavaForConditionalGeneration, cfg, out, 'LlavaForConditionalGeneration', dtype,
          tok.eos_token_id, tok.pad_token_id, renames=[('vision_tower.', 'vision_tower.vision_model.')],
          config={'text_config': {'architectures': ['Qwen2ForCausalLM']}})
    return out


def llama4_config(tok):
    """The tiny Llama 4's config (this file's GPU checkpoint, tests/lmdeploy_tiny.py's too)."""
    from transformers import Llama4Config
    ids = tok.convert_tokens_to_ids
    return Llama4Config(
        vision_config=dict(image_size=56, patch_size=14, hidden_size=128, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=512, pixel_shuffle_ratio=0.5,
                           projector_input_dim=256, projector_output_dim=256, vision_output_dim=256,
                           rope_theta=10000),
        text_config=dict(vocab_size=len(tok), bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, head_dim=64, num_local_experts=2,
                         num_experts_per_tok=1, intermediate_size_mlp=512, interleave_moe_layer_step=1,
                         no_rope_layers=[1, 1], attention_chunk_size=8192, **LLM),
        boi_token_index=ids('<|image_start|>'), eoi_token_index=ids('<|image_end|>'),
        image_token_index=ids('<|patch|>'), tie_word_embeddings=False)


def llama4(out, dtype='bfloat16'):
    """Llama 4 (``Llama4ForConditionalGeneration``): 56 px tiles (the public checkpoints: 336 px),
    patch 14, pixel shuffle 0.5: 4 ``<|patch|>`` tokens a tile, up to 4 tiles and a global one;
    a 2-layer ViT (hidden 64, head_dim 32 as 1408/44's... 64 here) and a 2-layer MoE LLM (2
    experts, one a token, every layer MoE). The tokenizer of tests/lmdeploy_tiny.py's Llama 4."""
    from transformers import Llama4ForConditionalGeneration, Llama4ImageProcessor, Llama4Processor
    os.makedirs(out, exist_ok=True)
    tok = qwen_tokenizer(out, ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|image_start|>',
                               '<|image_end|>', '<|image|>', '<|patch|>', '<|tile_x_separator|>',
                               '<|tile_y_separator|>'])
    ip = Llama4ImageProcessor(size={'height': 56, 'width': 56}, max_patches=4)
    Llama4Processor(image_processor=ip, tokenizer=tok, patch_size=14, pixel_shuffle_ratio=0.5,
                    chat_template=tok.chat_template).save_pretrained(out)
    cfg = llama4_config(tok)
    cfg.architectures = ['Llama4ForConditionalGeneration']
    _save(Llama4ForConditionalGeneration, cfg, out, 'Llama4ForConditionalGeneration', dtype,
          tok.eos_token_id, tok.pad_token_id)
    return out


def _from_lmdeploys_class(out, config, dtype, unmerge=None):
    """A remote-code family (no transformers model class): config.json, its stand-in config class
    (``seed_remote_code.STANDIN_FILES``), and random weights made by lmdeploy's own model class,
    saved under the public checkpoints' names, which its load_weights reads: its parameters' own,
    but for a merged one that ``unmerge`` names (merged name -> the halves' names, split along the
    output dimension, as CogVLM's gate_up_proj); linear weights N(0, 0.02), norm weights 1, biases
    0. Needs lmdeploy (and triton)."""
    from lmdeploy.pytorch.models.module_map import MODULE_MAP
    from lmdeploy.pytorch.models.patch import _get_model_class
    from load_check import hf_config
    from safetensors.torch import save_file
    from seed_remote_code import write_standin
    write_standin(out, config['auto_map']['AutoConfig'])
    with open(os.path.join(out, 'config.json'), 'w') as f:
        json.dump({**config, 'torch_dtype': dtype}, f, indent=2)
    hf = hf_config(out, dtype)
    model = _get_model_class(hf, MODULE_MAP)(hf, ctx_mgr=None, dtype=getattr(torch, dtype), device='cpu')
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, p in model.named_parameters():
        if name.endswith('bias'):
            weights[name] = torch.zeros_like(p)
        elif 'norm' in name.rsplit('.', 2)[-2]:
            weights[name] = torch.ones_like(p)
        else:
            weights[name] = (torch.randn(p.shape, generator=g) * 0.02).to(p.dtype)
    for merged, halves in (unmerge or {}).items():
        for name in [n for n in weights if merged in n and '.vision.' not in n]:
            for half, part in zip(halves, weights.pop(name).chunk(2), strict=True):
                weights[name.replace(merged, half)] = part
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, 'model.safetensors'),
              metadata={'format': 'pt'})


# EVA2CLIP at 56 px (patch 14, 2x2 merged: 6 tokens an image with boi and eoi), hidden 128, head 64
EVA2CLIP = dict(hidden_size=128, num_heads=2, num_hidden_layers=2, intermediate_size=256, patch_size=14,
                image_size=56, in_channels=3, layer_norm_eps=1e-6, scaling_factor=8, num_positions=17,
                hidden_act='gelu', dropout_prob=0.0)


def glm4v_9b_config(tok):
    """The tiny GLM-4V-9B's config.json (this file's GPU checkpoint, tests/lmdeploy_tiny.py's too):
    EVA2CLIP at 56 px, a 2-layer ChatGLM (hidden 256, 4 heads of 64, 2 KV groups)."""
    ids = tok.convert_tokens_to_ids
    return dict(
        architectures=['ChatGLMModel'], model_type='chatglm',
        auto_map={'AutoConfig': 'configuration_chatglm.ChatGLMConfig',
                  'AutoModelForCausalLM': 'modeling_chatglm.ChatGLMForConditionalGeneration'},
        padded_vocab_size=len(tok), vocab_size=len(tok), hidden_size=256, num_layers=2,
        num_attention_heads=4,
        multi_query_attention=True, multi_query_group_num=2, kv_channels=64, ffn_hidden_size=512,
        layernorm_epsilon=1e-5, rmsnorm=True, add_bias_linear=False, add_qkv_bias=True,
        apply_residual_connection_post_layernorm=False, post_layer_norm=True,
        fp32_residual_connection=False,
        seq_length=4096, rope_ratio=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        boi_token_id=ids('<|begin_of_image|>'), eoi_token_id=ids('<|end_of_image|>'),
        tie_word_embeddings=False,
        vision_config=EVA2CLIP)


def cogvlm_config(tok):
    """The tiny CogVLM2's config.json (this file's GPU checkpoint, tests/lmdeploy_tiny.py's too):
    EVA2CLIP at 56 px, a 2-layer LLaMA-style LLM with vision experts (hidden 256, 4 heads of 64)."""
    return dict(
        architectures=['CogVLMForCausalLM'], model_type='cogvlm',
        auto_map={'AutoConfig': 'configuration_cogvlm.CogVLMConfig'},
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, hidden_act='silu', rms_norm_eps=1e-5, max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False, vision_config=EVA2CLIP)


def glm4v_9b(out, dtype='bfloat16'):
    """GLM-4V-9B (``ChatGLMModel`` with a vision_config): EVA2CLIP at 56 px (the public checkpoint:
    1120 px, 1602 tokens), a 2-layer ChatGLM (hidden 256, 4 heads of 64, 2 KV groups); its config
    a stand-in of the remote one, its weights lmdeploy's class's (``_from_lmdeploys_class``)."""
    os.makedirs(out, exist_ok=True)
    tok = qwen_tokenizer(out, ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|begin_of_image|>',
                               '<|end_of_image|>'])
    tok.save_pretrained(out)
    _from_lmdeploys_class(out, glm4v_9b_config(tok), dtype)
    json.dump(dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
              open(os.path.join(out, 'generation_config.json'), 'w'), indent=2)
    return out


def cogvlm(out, dtype='bfloat16'):
    """CogVLM2 (``CogVLMForCausalLM``): EVA2CLIP at 56 px, a 2-layer LLaMA-style LLM with vision
    experts (hidden 256, 4 heads of 64); the directory's name picks lmdeploy's cogvlm template;
    its config a stand-in of the remote one, its weights lmdeploy's class's."""
    os.makedirs(out, exist_ok=True)
    tok = qwen_tokenizer(out, ['<|endoftext|>', '<|im_start|>', '<|im_end|>'])
    tok.save_pretrained(out)
    halves = {'.gate_up_proj': ('.gate_proj', '.up_proj')}  # (its checkpoints' MLP weights, unmerged)
    _from_lmdeploys_class(out, cogvlm_config(tok), dtype, unmerge=halves)
    json.dump(dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
              open(os.path.join(out, 'generation_config.json'), 'w'), indent=2)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('out')
    ap.add_argument('--arch', default='all',
                    choices=['internvl', 'qwen2vl', 'internvl_chat', 'qwen3vl', 'qwen3_5', 'qwen3vl_moe',
                             'qwen3_5_moe', 'glm4v', 'gemma3',
                             'llava', 'llama4', 'glm4v_9b', 'cogvlm', 'both', 'all'])
    ap.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float16', 'float32'])
    a = ap.parse_args()
    built = []
    if a.arch in ('internvl', 'both', 'all'):
        built.append(internvl_hf(os.path.join(a.out, 'internvl_hf_tiny'), a.dtype))
    if a.arch in ('qwen2vl', 'both', 'all'):
        built.append(qwen2vl(os.path.join(a.out, 'qwen2vl_tiny'), a.dtype))
    if a.arch in ('internvl_chat', 'all'):
        built.append(internvl_chat(os.path.join(a.out, 'internvl_chat_tiny'), a.dtype))
    for arch in ('qwen3vl', 'qwen3_5', 'qwen3vl_moe', 'qwen3_5_moe'):
        if a.arch in (arch, 'all'):
            built.append(qwen3(os.path.join(a.out, f'{arch}_tiny'), arch, a.dtype))
    if a.arch in ('glm4v', 'all'):
        built.append(glm4v(os.path.join(a.out, 'glm4v_tiny'), a.dtype))
    if a.arch in ('gemma3', 'all'):
        built.append(gemma3(os.path.join(a.out, 'gemma3_tiny'), a.dtype))
    if a.arch in ('llava', 'all'):
        built.append(llava(os.path.join(a.out, 'llava_tiny'), a.dtype))
    if a.arch in ('llama4', 'all'):
        built.append(llama4(os.path.join(a.out, 'llama4_tiny'), a.dtype))
    if a.arch in ('glm4v_9b', 'all'):
        built.append(glm4v_9b(os.path.join(a.out, 'glm4v_9b_tiny'), a.dtype))
    if a.arch in ('cogvlm', 'all'):
        built.append(cogvlm(os.path.join(a.out, 'cogvlm_tiny'), a.dtype))
    for b in built:
        size = sum(os.path.getsize(os.path.join(b, f)) for f in os.listdir(b))
        print(f'wrote {b} ({size / 1e6:.2f} MB): {sorted(os.listdir(b))}')


if __name__ == '__main__':
    main()
