#!/usr/bin/env python3
"""Build the InternVL3-2B-shaped random checkpoint the speed benches use, where it is used.

    python3 bench/device/make_real_shape.py /tmp/models        # -> /tmp/models/internvl3_2b_shape
    python3 bench/device/make_real_shape.py /tmp/models --force --device cpu

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
    t = time.time()
    torch.manual_seed(0)
    with torch.device(device):
        m = InternVLForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.data.normal_(0, 0.02)
    m.save_pretrained(out, safe_serialization=True)
    mk._patch_config(out, 'InternVLForConditionalGeneration', 'bfloat16')
    n = sum(p.numel() for p in m.parameters())
    del m
    if device.startswith('cuda'):
        torch.cuda.empty_cache()
    with open(done, 'w') as f:
        json.dump(dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       bos_token_id=tok.pad_token_id), f)
    return dict(path=out, built=True, device=device, params_B=round(n / 1e9, 3),
                build_s=round(time.time() - t, 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('models_dir', nargs='?', default='/tmp/models')
    ap.add_argument('--device', help='where to initialise the weights (default: cuda if available)')
    ap.add_argument('--force', action='store_true', help='rebuild even if the checkpoint exists')
    a = ap.parse_args()
    print('REAL_SHAPE', json.dumps(build(a.models_dir, a.device, a.force)), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
