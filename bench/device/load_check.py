"""Build lmdeploy's PyTorch model class for a checkpoint and load its weights, on any device.

What a GPU run of a tiny checkpoint does first, before any step: lmdeploy builds its model config
(``ModelConfig.from_pretrained``: the family's config builder), picks the class (``module_map``
through ``patch._get_model_class``), builds it from the checkpoint's config, and
loads every weight by name (``rename_weight``, then ``load_weights``). A config field its code
reads but the checkpoint lacks, or a weight saved under another name than the public
checkpoints', fails here in seconds, with lmdeploy's own traceback, instead of inside a GPU call.

    python3 -m bench make_tiny_vlm /tmp/models --arch gemma3
    python3 -m bench load_check /tmp/models/gemma3_tiny [PATH ...]

On a CPU machine lmdeploy's kernels import ``triton`` (installed aside: ``pip install --no-deps
--target /tmp/tritonpkg triton``, then ``PYTHONPATH=/tmp/tritonpkg``); nothing is run, so no GPU
is needed. Exit 0 when every checkpoint loads; one line per checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys


def hf_config(path: str, dtype: str = "bfloat16") -> object:
    """The checkpoint's HF config as lmdeploy's engine makes it: its model config builder reads (and
    completes) it. Without CUDA, lmdeploy's ``is_bf16_supported`` (which CogVLM's builder asks)
    answers yes: the weights are only loaded here."""
    import torch
    from lmdeploy.pytorch.config import ModelConfig

    if not torch.cuda.is_available():
        import lmdeploy.utils

        lmdeploy.utils.is_bf16_supported = lambda *args, **kwargs: True
    return ModelConfig.from_pretrained(path, trust_remote_code=True, dtype=dtype, device_type="cpu").hf_config


def load(path: str) -> str:
    """Load ``path`` into lmdeploy's class for it (bfloat16, on the CPU); returns the class name."""
    import torch
    from lmdeploy.pytorch.models.module_map import MODULE_MAP
    from lmdeploy.pytorch.models.patch import _get_model_class
    from safetensors.torch import load_file

    config = hf_config(path)
    cls = _get_model_class(config, MODULE_MAP)
    model = cls(config, ctx_mgr=None, dtype=torch.bfloat16, device="cpu")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors in {path}")
    rename = getattr(model, "rename_weight", None)
    for name in files:
        weights = load_file(os.path.join(path, name))
        model.load_weights([(rename(k) if rename else k, v) for k, v in weights.items()])
    return cls.__name__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="checkpoint directories")
    failed = 0
    for path in ap.parse_args().paths:
        try:
            print(f"[load_check] {path}: loads into {load(path)}")
        except Exception as e:  # noqa: BLE001 (every checkpoint reported, each failure named)
            failed += 1
            print(f"[load_check] {path}: FAILED: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
