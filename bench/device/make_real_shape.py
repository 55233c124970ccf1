#!/usr/bin/env python3
"""Build the InternVL3-2B-shaped random checkpoint the speed benches use, where it is used.

    python3 bench/device/make_real_shape.py /tmp/models        # -> /tmp/models/internvl3_2b_shape
    python3 bench/device/make_real_shape.py /tmp/models --force --device cpu
    python3 bench/device/make_real_shape.py /tmp/models --shape qwen3vl_2b  # -> qwen3vl_2b_shape

InternVL-HF (``InternVLForConditionalGeneration``): an InternViT-300M-sized vision tower (24 x 1024,
448 px tiles, patch 14, pixel shuffle 0.5 -> 256 tokens per tile, up to 12 tiles + thumbnail) and a
Qwen2.5-1.5B-sized LLM (28 x 1536, 12 heads, 2 KV heads, vocab 151936), 2.09B parameters, bf16,
random weights (normal(0, 0.02), seed 0), the byte-level tokenizer of make_tiny_vlm.py with the
InternVL special tokens. A 1344x1008 image is 12 tiles + thumbnail = 3328 image tokens.

The same shapes, tokenizer, processor and initialisation as the builder the earlier PyTorch-engine
runs used (``real_shape_baseline.build()`` outside this repo, docs/benchmarks.md), so figures stay
comparable. Built on the GPU in ~7 s (4.2 GB written); never carried. Skips the build when the
checkpoint is already there (``--force`` rebuilds). Prints one JSON line.
"""
import argparse
import json
import os
import sys
import time

import torch

NAME = 'internvl3_2b_shape'


def _write(model_cls, cfg, out: str, done: str, tok, device: str) -> dict:
    """``cfg``'s model with random bf16 weights (normal(0, 0.02), seed 0) made on ``device`` and
    saved in ``out``, ``done`` (the generation config) written last; what was done."""
    import make_tiny_vlm as mk
    arch = cfg.architectures[0]
    t = time.time()
    torch.manual_seed(0)
    with torch.device(device):
        m = model_cls(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.data.normal_(0, 0.02)
    m.save_pretrained(out, safe_serialization=True)
    mk._patch_config(out, arch, 'bfloat16')
    n = sum(p.numel() for p in m.parameters())
    del m
    if device.startswith('cuda'):
        torch.cuda.empty_cache()
    with open(done, 'w') as f:
        json.dump(dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       bos_token_id=tok.pad_token_id), f)
    return dict(path=out, built=True, device=device, params_B=round(n / 1e9, 3),
                build_s=round(time.time() - t, 1))


def build(models_dir: str = '/tmp/models', device: str | None = None, force: bool = False) -> dict:
    """Write ``models_dir/internvl3_2b_shape``; returns what was done (path, params, seconds)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import make_tiny_vlm as mk
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    out = os.path.join(models_dir, NAME)
    done = os.path.join(out, 'generation_config.json')  # written last
    if os.path.exists(done) and not force:
        return dict(path=out, built=False)
    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    os.makedirs(out, exist_ok=True)
    tok = mk.internvl_hf_processor(out, tile=448, max_patches=12, image_seq_length=256)
    cfg = InternVLConfig(
        vision_config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                           intermediate_size=4096, image_size=[448, 448], patch_size=[14, 14]),
        text_config=dict(model_type='qwen2', vocab_size=151936, architectures=['Qwen2ForCausalLM'],
                         hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=False, bos_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        image_token_id=tok.convert_tokens_to_ids('<IMG_CONTEXT>'), image_seq_length=256, downsample_ratio=0.5,
        tie_word_embeddings=False)
    cfg.architectures = ['InternVLForConditionalGeneration']
    return _write(InternVLForConditionalGeneration, cfg, out, done, tok, device)


QWEN3VL_NAME = 'qwen3vl_2b_shape'


def build_qwen3vl_2b(models_dir: str = '/tmp/models', device: str | None = None, force: bool = False) -> dict:
    """Write ``models_dir/qwen3vl_2b_shape``: Qwen3-VL-2B-Instruct's shapes (a 24 x 1024 ViT, patch
    16, merge 2, deepstack levels from layers 5, 11 and 17; a 28 x 2048 LLM, 16 heads of 128, 8 KV
    heads, vocab 151936), its processor's settings (images of 65536 to 16777216 pixels, mean/std
    0.5), random bf16 weights (normal(0, 0.02), seed 0). A 1344x1008 photo is 1344 image tokens."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import make_tiny_vlm as mk
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    out = os.path.join(models_dir, QWEN3VL_NAME)
    done = os.path.join(out, 'generation_config.json')  # written last
    if os.path.exists(done) and not force:
        return dict(path=out, built=False)
    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    os.makedirs(out, exist_ok=True)
    tok = mk.qwen3_processor(out, 256 * 256, 16777216)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=32768, tie_word_embeddings=False,
                         bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id,
                         rope_parameters={'rope_type': 'default', 'rope_theta': 5000000.0,
                                          'mrope_section': [24, 20, 20], 'mrope_interleaved': True}),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                           out_hidden_size=2048, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17]),
        image_token_id=ids('<|image_pad|>'), video_token_id=ids('<|video_pad|>'),
        vision_start_token_id=ids('<|vision_start|>'), vision_end_token_id=ids('<|vision_end|>'),
        tie_word_embeddings=False)
    cfg.architectures = ['Qwen3VLForConditionalGeneration']
    return _write(Qwen3VLForConditionalGeneration, cfg, out, done, tok, device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('models_dir', nargs='?', default='/tmp/models')
    ap.add_argument('--device', help='where to initialise the weights (default: cuda if available)')
    ap.add_argument('--force', action='store_true', help='rebuild even if the checkpoint exists')
    ap.add_argument('--shape', default='internvl3_2b', choices=['internvl3_2b', 'qwen3vl_2b'],
                    help='internvl3_2b (internvl3_2b_shape) or qwen3vl_2b (qwen3vl_2b_shape)')
    a = ap.parse_args()
    builder = build if a.shape == 'internvl3_2b' else build_qwen3vl_2b
    print('REAL_SHAPE', json.dumps(builder(a.models_dir, a.device, a.force)), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
