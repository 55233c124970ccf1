"""The model side of featcache's multi-process mode, as one model process (a rank) runs it.

``Side`` holds what a rank holds: lmdeploy's real input processor wrapped in
``KeyedInputProcessor``, the model class with featcache's ``prepare`` (lmdeploy's real
``prepare_inputs_for_generation`` and ``forward`` underneath), a fake vision tower and language
model (``test_lmdeploy_engine``'s: features are a function of each image's pixels), and the
process's own cache (``ranks``). ``step`` runs one prefill step over requests that arrive as
pickled bytes, exactly as lmdeploy's RPC and its mp executor hand them over.

``rank_main`` is the body of each process of the two-rank test (gloo, CPU).
"""

from __future__ import annotations

import datetime
import json
import pickle
import sys
import types
from typing import Any

import torch

ARCH = "InternVLForConditionalGeneration"


def stub_xgrammar() -> None:
    """An empty ``xgrammar`` where it is not installed (lmdeploy's engine modules import it;
    nothing here uses it)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        def attr(name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

        stub = types.ModuleType("xgrammar")
        stub.__getattr__ = attr  # type: ignore[method-assign]
        sys.modules["xgrammar"] = stub


class Side:
    def __init__(self, path: str, cache_bytes: int = 64 << 20) -> None:
        import lmdeploy_tiny as tiny
        import test_lmdeploy_engine as eng
        from lmdeploy.pytorch.models import internvl3_hf

        tiny.register_processors()  # the checkpoints' processors, for pixels rebuilt here
        from transformers import AutoConfig

        from featcache.lmdeploy.pytorch import models, ranks
        from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor

        self.eng = eng
        self.config = AutoConfig.from_pretrained(path)
        self.processor = KeyedInputProcessor(
            internvl3_hf.InternVLProcessor(self.config, torch.float16))
        self.cls = internvl3_hf.InternVLForConditionalGeneration
        self.original_prepare = self.cls.prepare_inputs_for_generation
        models.patch_model_class(models.SPECS[ARCH])
        ranks.configure(json.dumps({
            "feature_cache": {"device": "cpu", "device_bytes": cache_bytes, "host_bytes": 0},
            # what the engine tells the model processes (processes.rank_settings)
            "rebuild": {"model_path": path, "dtype": "float16", "device_type": "cpu",
                        "trust_remote_code": False}}))
        self.model = eng.FakeInternVL(self.config.text_config.vocab_size)
        self.model.get_input_processor = lambda: self.processor.inner  # the real model's method

    def step(self, blobs: list[bytes]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One prefill step over the pickled requests ``(input_ids, multimodal dicts)``: the
        image rows of the embeddings the language model got, and the vision calls' pixels."""
        ids: list[int] = []
        mms = []
        for blob in blobs:
            input_ids, multimodal = pickle.loads(blob)
            result = self.processor.preprocess_input(input_ids, multimodal)
            ids += input_ids
            mms.append(result.input_multimodals)
        ctx = self.eng.step_context(ids, mms)
        self.model.vision_inputs.clear()
        inputs = self.cls.prepare_inputs_for_generation(self.model, None, context=ctx)
        embeds = self.cls.forward(self.model, **inputs)
        token_id = mms[0]["image"][0].meta["image_token_id"]
        mask = ctx.input_ids[0] == token_id
        return embeds[0][mask].detach(), [x.detach() for x in self.model.vision_inputs]

    def close(self) -> None:
        from featcache.lmdeploy.pytorch import ranks

        self.cls.prepare_inputs_for_generation = self.original_prepare
        ranks.reset_for_tests()


def rank_main(rank: int, path: str, init: str, blobs: list[bytes], evict: bytes,
              out: Any, second: list[bytes] | None = None) -> None:
    """One rank of the two-rank test: a step over ``blobs`` (every image computed and stored),
    rank 1 then evicts ``evict`` from its cache, and a second step over the same requests (or
    over ``second``: the same images sent again, without pixels)."""
    import torch.distributed as dist

    from featcache.lmdeploy.pytorch import ranks
    from featcache.lmdeploy.request.frontend import SECTION

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        side = Side(path)
        ranks.use_group(dist.group.WORLD)
        first, calls1 = side.step(blobs)
        cache = ranks.local_cache()
        assert cache is not None
        if rank == 1:
            cache.discard(evict)
        again, calls2 = side.step(second or blobs)
        section = cache.stats().get(SECTION, {})
        # numpy: pickled by value (torch's queue shares tensors through the sender's fds)
        out.put((rank, first.numpy(), again.numpy(), [c.shape[0] for c in calls1],
                 [c.shape[0] for c in calls2], dict(section), ranks.rank(),
                 cache.config.disk_writes))
        side.close()
    except BaseException as e:  # reported, so the test fails with it instead of a timeout
        out.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()
