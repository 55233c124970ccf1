"""A stand-in for lmdeploy's PyTorch pipeline on the CPU, with featcache's real frontend and
model hook: what ``dry-run`` runs bench and breakdown over."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from typing import Any

import numpy as np
import torch


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

    import featcache.lmdeploy.models as fcm
    from featcache.lmdeploy.frontend import install_frontend
    from featcache.lmdeploy.refs import REF_KEY

    tiles, per_tile, hidden, token_id = 2, 4, 64, 7

    class Vision:
        def preprocess(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
            out = []
            for m in messages:
                for x in m["content"] if isinstance(m.get("content"), list) else []:
                    if isinstance(x, dict) and x.get("type") == "image":
                        a = np.asarray(x["data"].convert("RGB").resize((28, 28)), dtype=np.float32)
                        px = torch.from_numpy(a).permute(2, 0, 1)[None].repeat(tiles, 1, 1, 1) / 255
                        time.sleep(0.002)
                        out.append(dict(pixel_values=px, image_tokens=tiles * per_tile,
                                        image_token_id=token_id))
            messages.append(dict(role="preprocess", content=out))
            return messages

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
            self.vl_encoder = type("Encoder", (), {})()
            self.vl_encoder.model = Vision()
            self.model = Model().eval()
            self.legacy_copy = legacy_copy
            # what the text-only twins count prompts with: this stand-in's 8 characters a token
            self.tokenizer = types.SimpleNamespace(encode=lambda text: [1] * (len(text) // 8))
            self.chat_template = types.SimpleNamespace(
                messages2prompt=lambda msgs: "".join(str(m.get("content")) for m in msgs))

        def _prepare(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
            msgs = [dict(m, content=[dict(type="image", data=x["image_data"]["data"])
                                     if isinstance(x, dict) and x.get("type") == "image_data" else x
                                     for x in m["content"]]) if isinstance(m.get("content"), list) else m
                    for m in messages]
            msgs = self.vl_encoder.model.preprocess(msgs)
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

    class Pipe:
        def __init__(self, legacy_copy: bool) -> None:
            self.async_engine = Engine(legacy_copy)
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.ids = iter(range(1, 1 << 30))

        def _run(self, coro: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

        def __call__(self, prompts: Any, gen_config: Any) -> Any:
            async def one(p: Any) -> Any:
                if isinstance(p, tuple):
                    p = [dict(role="user", content=[dict(type="text", text=p[0]),
                                                    dict(type="image_data", image_data=dict(data=p[1]))])]
                req = await self.async_engine.preprocess(p, next(self.ids), gen_config)
                async for out in self.async_engine.generate(req):
                    return out
            if isinstance(prompts, tuple):
                return self._run(one(prompts)).result()
            return [self._run(one(p)).result() for p in prompts]

        def close(self) -> None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)

    def build(engine: str, cache: Any) -> Any:
        pipe = Pipe(legacy_copy=engine == "plain")
        if cache is not None:
            install_frontend(pipe.async_engine.vl_encoder.model, cache, "dry-run")
        return pipe

    def on_device(t: torch.Tensor) -> bool:
        return t.is_cuda or bool(getattr(t, "_standin_device", False))

    return build, [(Model, "extract_feature", None)], on_device

