"""A stand-in for lmdeploy's TurboMind pipeline on the CPU, with featcache's real frontend and
native, features and combined hooks: what ``dry-run`` runs the bench over (its pipeline and vision
preprocessing from bench/lib/standin.py, the TurboMind engine here)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from bench.lib.standin import Pipe, Vision, encoder, image_items


def standin_builder() -> Callable[[str, Any], Any]:
    """Pipelines that go through what the real ones run in Python: lmdeploy's real
    ``TurboMind.mm_input_converter`` and InternVL ``to_turbomind_multimodal`` fingerprinting (over
    the stand-in binding: call it inside ``bench.lib.standin.turbomind_binding()``), featcache's
    real frontend with ``NativePixels`` or ``FeatureServer``; the vision preprocessing (tiles of
    28 px in bfloat16) and the engine are stand-ins (small tensors, a 2 ms sleep)."""
    import lmdeploy.turbomind.models.internvl as ivl
    import torch
    from lmdeploy.messages import Response, TurbomindEngineConfig
    from lmdeploy.turbomind.turbomind import TurboMind

    from featcache.lmdeploy.request.frontend import install_frontend
    from featcache.lmdeploy.turbomind.combined import CombinedServer
    from featcache.lmdeploy.turbomind.features import FeatureServer
    from featcache.lmdeploy.turbomind.native import install_native

    tiles, per_tile = 2, 4

    class Source:
        def to_turbomind_multimodal(self, mm: list[dict[str, Any]]) -> list[bytes]:
            return [ivl._resolve_fingerprint(x) for x in mm]  # looked up per call, as lmdeploy does

    class Tower:
        device = torch.device("cpu")

        def __call__(self, pixels: Any) -> Any:
            return torch.zeros(pixels.shape[0], per_tile, 16, dtype=torch.bfloat16)

    class Engine:
        def __init__(self) -> None:
            self.vl_encoder = encoder(Vision(tiles, per_tile, 5, dtype=torch.bfloat16))
            self.tm = object.__new__(TurboMind)
            self.tm.engine_config = TurbomindEngineConfig(dtype="bfloat16")
            self.tm.source_model = Source()

        def _prepare(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
            vm = self.vl_encoder.model
            msgs = vm.preprocess(image_items(messages))
            if getattr(vm, "_turbomind_native_vision", True) is False:  # features (combined: by route)
                msgs = vm.forward(msgs, 1)
                if msgs[-1].get("featcache_route", "features") == "features":
                    return dict(multimodal=None, tokens=10)
            items = [m for m in msgs if m.get("role") == "preprocess"][0]["content"]
            return dict(multimodal=[dict(x, offset=3 + 10 * i) for i, x in enumerate(items)],
                        tokens=10 + sum(int(x["image_tokens"]) for x in items))

        async def preprocess(self, messages: Any, session_id: int, gen_config: Any) -> dict[str, Any]:
            return await asyncio.to_thread(self._prepare, messages)

        async def generate(self, request: dict[str, Any], stream_response: bool = True) -> Any:
            TurboMind.mm_input_converter(self.tm, request["multimodal"])  # on the loop, as lmdeploy
            await asyncio.sleep(0.002)
            yield Response(text="", generate_token_len=1, input_token_len=request["tokens"],
                           token_ids=[1], cached_tokens=0)

    def build(path: str, cache: Any) -> Any:
        pipe = Pipe(Engine())
        vm = pipe.async_engine.vl_encoder.model
        if path == "native":
            install_native(vm, cache, "dry-run:native")
        elif path == "features":
            install_frontend(vm, cache, "dry-run:features")
            FeatureServer(cache, Tower(), torch.bfloat16).install(vm)  # type: ignore[arg-type]
        elif path == "combined":
            install_native(vm, cache, "dry-run:native")
            CombinedServer(cache, FeatureServer(cache, Tower(), torch.bfloat16),  # type: ignore[arg-type]
                           "dry-run:features").install(vm)
        if cache is not None:
            pipe.featcache = cache  # type: ignore[attr-defined]
        return pipe
    return build
