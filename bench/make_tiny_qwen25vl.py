"""Build a tiny random Qwen2.5-VL checkpoint lmdeploy's PyTorch engine can load (no download).

    python bench/make_tiny_qwen25vl.py OUT_DIR [--dtype bfloat16]

The Qwen2-VL builder of bench/device/make_tiny_vlm.py with Qwen2.5-VL's classes: a 2-layer
windowed ViT (hidden 128, head_dim 64, window 112 px, the last block full attention) and a 2-layer
LLM (hidden 256, head_dim 64). ``--shared DIR``: where make_tiny_vlm.py lives (default
bench/device). Then: ``python bench/e2e_lmdeploy.py check --model OUT_DIR/qwen25vl_tiny``.
"""

from __future__ import annotations

import argparse
import os
import sys


def build(out: str, dtype: str, shared: str) -> str:
    sys.path.insert(0, shared)
    import make_tiny_vlm as mk
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    out = os.path.join(out, "qwen25vl_tiny")
    os.makedirs(out, exist_ok=True)
    tok = mk.qwen_tokenizer(out, mk.QWEN_VL_SPECIAL)
    ip = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    proc = Qwen2_5_VLProcessor(image_processor=ip, tokenizer=tok,
                               video_processor=Qwen2VLVideoProcessor(),
                               chat_template=tok.chat_template)
    proc.save_pretrained(out)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        vocab_size=len(tok), rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
        vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                           out_hidden_size=mk.LLM["hidden_size"], patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id,
        tie_word_embeddings=False, **mk.LLM)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    mk._save(Qwen2_5_VLForConditionalGeneration, cfg, out, "Qwen2_5_VLForConditionalGeneration",
             dtype, tok.eos_token_id, tok.pad_token_id)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--shared", default=os.path.join(here, "device"),
                        help="folder holding make_tiny_vlm.py (default bench/device)")
    args = parser.parse_args()
    path = build(args.out, args.dtype, args.shared)
    print(f"wrote {path}: {sorted(os.listdir(path))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
