"""A stand-in for lmdeploy's PyTorch pipeline on the CPU, with featcache's real frontend and
model hook: what ``dry-run`` runs bench and breakdown over (its pipeline and vision preprocessing
from bench/lib/standin.py, the engine and model here)."""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any

import torch

from bench.lib.standin import Pipe, Vision, encoder, image_items


class _Meta:
    def __init__(self, is_decoding: bool) -> None:
        self.is_decoding = is_decoding


def standin() -> tuple[Any, list[tuple[Any, str | None, Any]], Any]:
    """(builder, timer targets, on_device) for a stand-in of lmdeploy's PyTorch pipeline: lmdeploy's
    own request shapes and ``Response``, featcache's real frontend (keys, lookups, hits that skip
    preprocessing) and real model hook (its per-instance vision wrapper and ``_serve``: misses run
    the vision model and are put, hits come from their leases), over a stand-in vision model
    (tiles of 28 px, a 3 ms ViT, 2 ms of image preprocessing) and engine (one prefill forward of
    ~4 ms, ~2 ms of loop overhead, the next token copied to the host). Tensors the stand-in marks
    ``_standin_device`` count as device tensors for the D2H counter; its plain engine also copies
    each step's features to the host, as lmdeploy 0.5/0.6 did (0.18 does not), so that the counter
    is seen to catch a feature-sized copy."""
    from lmdeploy.messages import Response

    import featcache.lmdeploy.pytorch.models as fcm
    from featcache.lmdeploy.request.frontend import install_frontend
    from featcache.lmdeploy.request.refs import REF_KEY

    tiles, per_tile, hidden, token_id = 2, 4, 64, 7

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(3 * 28 * 28 // per_tile, hidden)
            self.lm = torch.nn.Linear(hidden, hidden)

        def extract_feature(self, pixel_values: torch.Tensor) -> torch.Tensor:
            time.sleep(0.003)
            return self.proj(pixel_values.reshape(pixel_values.shape[0], per_tile, -1))

        def forward(self, input_ids: torch.Tensor, position_ids: Any = None, past_key_values: Any = None,
                    attn_metadata: Any = None, pixel_values: Any = None, image_mask: Any = None,
                    legacy_copy: bool = False) -> torch.Tensor:
            embeds = torch.zeros(input_ids.shape[0], hidden)
            if pixel_values is not None:
                feats = self.extract_feature(pixel_values)
                if legacy_copy:
                    feats._standin_device = True  # type: ignore[attr-defined]
                    feats = feats.to("cpu")
                embeds[image_mask] = feats.reshape(-1, hidden).to(embeds)
            time.sleep(0.004)
            return self.lm(embeds)

    spec = fcm.ArchSpec("standin", "Model", "extract_feature", False, {})

    class Engine:
        def __init__(self, legacy_copy: bool) -> None:
            self.vl_encoder = encoder(Vision(tiles, per_tile, token_id, scale=255, delay_s=0.002))
            self.model = Model().eval()
            self.legacy_copy = legacy_copy
            # what the text-only twins count prompts with: this stand-in's 8 characters a token
            self.tokenizer = types.SimpleNamespace(encode=lambda text: [1] * (len(text) // 8))
            self.chat_template = types.SimpleNamespace(
                messages2prompt=lambda msgs: "".join(str(m.get("content")) for m in msgs))

        def _prepare(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
            msgs = self.vl_encoder.model.preprocess(image_items(messages))
            items = [m for m in msgs if m.get("role") == "preprocess"][0]["content"]
            text = sum(len(str(m.get("content"))) // 8 for m in messages)
            ids = [1] * text + [token_id] * sum(int(x["image_tokens"]) for x in items)
            return dict(items=items, input_ids=torch.tensor(ids))

        async def preprocess(self, messages: Any, session_id: int, gen_config: Any) -> dict[str, Any]:
            return await asyncio.to_thread(self._prepare, messages)

        def _step(self, request: dict[str, Any]) -> torch.Tensor:
            items, ids = request["items"], request["input_ids"]
            refs = [x.get(REF_KEY) for x in items]
            pixels = [x["pixel_values"] for x, r in zip(items, refs, strict=True) if r is None or not r.hit]
            if any(r is not None for r in refs):  # featcache's model hook, as in its prepare
                fcm._ensure_vision_wrapper(self.model, spec)
                fcm._step.plan = fcm._Plan(refs, [int(x["image_tokens"]) for x in items])
            pv = torch.cat(pixels) if pixels else (torch.empty(0) if items else None)
            with torch.inference_mode():
                logits = self.model(input_ids=ids, position_ids=None, past_key_values=None,
                                    attn_metadata=_Meta(False), pixel_values=pv,
                                    image_mask=ids == token_id, legacy_copy=self.legacy_copy)
            nxt = logits[-1:].argmax(-1)
            nxt._standin_device = True
            return nxt.cpu()  # the engine's output copy (a few bytes)

        async def generate(self, request: dict[str, Any], stream_response: bool = True) -> Any:
            await asyncio.sleep(0.001)
            token = self._step(request)
            await asyncio.sleep(0.001)
            yield Response(text="x", generate_token_len=1, input_token_len=len(request["input_ids"]),
                           token_ids=[int(token)], cached_tokens=0)

    def build(engine: str, cache: Any) -> Any:
        pipe = Pipe(Engine(legacy_copy=engine == "plain"))
        if cache is not None:
            install_frontend(pipe.async_engine.vl_encoder.model, cache, "dry-run")
        return pipe

    def on_device(t: torch.Tensor) -> bool:
        return t.is_cuda or bool(getattr(t, "_standin_device", False))

    return build, [(Model, "extract_feature", None)], on_device

