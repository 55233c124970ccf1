"""Class-level timers and counters on what lmdeploy's live model runs: vision-model calls
(``VisionCounter``), prompt logits (``PromptLogits``), per-request spans of host and GPU time
(``SPANS``, ``install_stage_timers``, ``instrument_preprocess``) and device-to-host copies
(``D2HCounter``). Each wrapper calls what it replaces with the same arguments and returns what it
returns; each is installed once per process (``PATCHES``)."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import torch

from bench.lib.patching import Patches
from bench.lib.timing import timed_call


class VisionCounter:
    """Counts vision-model calls of the supported classes (patched under featcache's wrappers)."""

    def __init__(self) -> None:
        import lmdeploy.pytorch.models.internvl as legacy
        import lmdeploy.pytorch.models.internvl3_hf as ivl
        import lmdeploy.pytorch.models.qwen2_5_vl as q25
        import lmdeploy.pytorch.models.qwen2_vl as q2

        self.calls = 0
        self.rows = 0
        counter = self

        def wrap(cls: Any, name: str) -> None:
            original = getattr(cls, name)

            def counted(self_: Any, pixel_values: Any, *a: Any, **k: Any) -> Any:
                counter.calls += 1
                counter.rows += int(pixel_values.shape[0])
                return original(self_, pixel_values, *a, **k)

            setattr(cls, name, counted)

        wrap(ivl.InternVLForConditionalGeneration, "get_image_features")
        wrap(legacy.InternVLChatModel, "extract_feature")  # InternVL2 (the seed models)
        import lmdeploy.pytorch.models.gemma3_vl as gemma3
        import lmdeploy.pytorch.models.glm4_1v as glm4v
        import lmdeploy.pytorch.models.llama4 as llama4
        import lmdeploy.pytorch.models.llava as llava

        wrap(gemma3.Gemma3ForConditionalGeneration, "get_image_features")
        wrap(llava.LlavaForConditionalGeneration, "get_image_features")
        wrap(llama4.Llama4ForConditionalGeneration, "get_image_features")
        import lmdeploy.pytorch.models.qwen3_5 as q35
        import lmdeploy.pytorch.models.qwen3_vl as q3

        for vt in (q2.Qwen2VisionTransformerPretrainedModel,
                   q25.Qwen2_5_VisionTransformerPretrainedModel, q3.Qwen3VLVisionModel,
                   q35.Qwen3_5VisionModel, glm4v.Glm4vVisionModel):
            wrap(getattr(vt, "__wrapped__", vt), "forward")

    def take(self) -> tuple[int, int]:
        out = (self.calls, self.rows)
        self.calls = self.rows = 0
        return out


class PromptLogits:
    """Digests (sha256 of the raw bytes) of the prompt logits of every prefill forward, one per
    sequence of the step (split by ``attn_metadata.q_seqlens``): the supported model classes'
    ``forward`` is wrapped at class level and ``get_logits`` run on its hidden states. lmdeploy's
    PyTorch engine returns prompt logits only with ``max_new_tokens=0`` and prefix caching off, so
    ``check`` reads them here; random weights often emit the same tokens for different images, the
    logits decide. Only for ``check`` (eager, untimed): one extra lm-head projection a prefill."""

    def __init__(self) -> None:
        import hashlib
        import importlib

        import featcache.lmdeploy.pytorch.models as fcm

        self.rows: list[dict[str, Any]] = []
        self.last: list[torch.Tensor] = []  # the last prefill's last-position logits, per sequence
        rec = self

        def make(orig: Any) -> Any:
            def forward(self_: Any, *a: Any, **k: Any) -> Any:
                out = orig(self_, *a, **k)
                if not _is_decoding(a, k):
                    meta = k.get("attn_metadata", a[3] if len(a) > 3 else None)
                    hidden = out["hidden_states"] if isinstance(out, dict) else out  # (Qwen3.5: a dict)
                    logits = self_.get_logits(hidden)
                    flat = logits.reshape(-1, logits.shape[-1])
                    lens = [int(x) for x in getattr(meta, "q_seqlens", torch.tensor([flat.shape[0]]))]
                    parts = flat.split(lens) if sum(lens) == flat.shape[0] else [flat]
                    mask = k.get("image_mask")  # the image's tokens in this step (a prefill with pixels)
                    mask = k.get("multimodal_mask") if mask is None else mask  # (the Qwen3 lineage)
                    first = mask.reshape(-1).nonzero() if mask is not None else None
                    rec.last = [q[-1].float().cpu() for q in parts]
                    rec.rows.append(dict(seqlens=lens, image_at=int(first[0]) if first is not None
                                         and len(first) else None, digests=[
                        hashlib.sha256(p.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
                        for p in parts]))
                return out
            return forward

        for spec in fcm.SPECS.values():
            cls = getattr(importlib.import_module(f"lmdeploy.pytorch.models.{spec.module}"), spec.cls)
            PATCHES.patch(getattr(cls, "__wrapped__", cls), "forward", make)

    def take(self) -> list[dict[str, Any]]:
        out, self.rows = self.rows, []
        return out

    def take_last(self) -> list[torch.Tensor]:
        out, self.last = self.last, []
        return out


class Spans:
    """Named spans summed per request: host time (perf_counter) and, where CUDA runs, GPU time by
    CUDA events recorded on the current stream (resolved after the request, never during it). A
    span opened while a CUDA graph is being captured is not timed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[tuple[str, float, float, Any, Any]] = []
        self.enabled = True

    def span(self, name: str, fn: Any, *a: Any, **k: Any) -> Any:
        if not self.enabled:
            return fn(*a, **k)
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda and torch.cuda.is_current_stream_capturing():
            return fn(*a, **k)
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            host = (time.perf_counter() - t) * 1e3
            if end is not None:
                end.record()
            with self.lock:
                self.open.append((name, host, t, start, end))

    def add(self, name: str, host_ms: float) -> None:
        with self.lock:
            self.open.append((name, host_ms, time.perf_counter(), None, None))

    def take(self) -> dict[str, Any]:
        """``{name: ms}`` (GPU time where there is one, else host), ``{name}_host`` and counts."""
        with self.lock:
            spans, self.open = self.open, []
        out: dict[str, Any] = {}
        calls: dict[str, int] = {}
        for name, host, _, start, end in spans:
            ms = host
            if end is not None:
                end.synchronize()
                ms = start.elapsed_time(end)
            out[name] = out.get(name, 0.0) + ms
            out[f"{name}_host"] = out.get(f"{name}_host", 0.0) + host
            calls[name] = calls.get(name, 0) + 1
        out["calls"] = calls
        return out


SPANS = Spans()
PATCHES = Patches()  # class-level wrappers, once per process


def _is_decoding(a: tuple[Any, ...], k: dict[str, Any]) -> bool:
    meta = k.get("attn_metadata", a[3] if len(a) > 3 else None)
    return bool(getattr(meta, "is_decoding", False))


def install_stage_timers(models: list[tuple[Any, str | None, Any]] | None = None) -> list[str]:
    """Class-level timers on what the live model runs (as ``VisionCounter``: featcache's per-instance
    vision wrapper then wraps these, so ``vision`` times only real vision-model runs): each model
    class's ``forward`` (``forward_prefill`` / ``forward_decode`` by ``attn_metadata.is_decoding``),
    its vision call (``vision``), and featcache's ``_serve`` (``fc_serve``: the vision call of a step
    with featcache, hits' leases, puts and the concatenation). ``models``: (class, vision method or
    None, vision submodule class or None); default: the four architectures featcache supports."""
    import featcache.lmdeploy.pytorch.models as fcm

    if models is None:
        import importlib

        import lmdeploy.pytorch.models.qwen2_5_vl as q25
        import lmdeploy.pytorch.models.qwen2_vl as q2

        models = []
        for spec in fcm.SPECS.values():
            cls = getattr(importlib.import_module(f"lmdeploy.pytorch.models.{spec.module}"), spec.cls)
            models.append((getattr(cls, "__wrapped__", cls), None if spec.submodule else spec.vision, None))
        for vt in (q2.Qwen2VisionTransformerPretrainedModel, q25.Qwen2_5_VisionTransformerPretrainedModel):
            models.append((None, None, getattr(vt, "__wrapped__", vt)))
    done = []
    for cls, vision, tower in models:
        if cls is not None:
            def fwd(orig: Any) -> Any:
                def forward(self_: Any, *a: Any, **k: Any) -> Any:
                    name = "forward_decode" if _is_decoding(a, k) else "forward_prefill"
                    return SPANS.span(name, orig, self_, *a, **k)
                return forward
            PATCHES.patch(cls, "forward", fwd)
            done.append(f"{cls.__name__}.forward")
        if cls is not None and vision is not None:
            def vis(orig: Any) -> Any:
                def call(self_: Any, *a: Any, **k: Any) -> Any:
                    return SPANS.span("vision", orig, self_, *a, **k)
                return call
            PATCHES.patch(cls, vision, vis)
            done.append(f"{cls.__name__}.{vision}")
        if tower is not None:
            def tow(orig: Any) -> Any:
                def forward(self_: Any, *a: Any, **k: Any) -> Any:
                    return SPANS.span("vision", orig, self_, *a, **k)
                return forward
            PATCHES.patch(tower, "forward", tow)
            done.append(f"{tower.__name__}.forward")

    def serve(orig: Any) -> Any:
        def _serve(*a: Any, **k: Any) -> Any:
            return SPANS.span("fc_serve", orig, *a, **k)
        return _serve
    PATCHES.patch(fcm, "_serve", serve)  # looked up by name in featcache's vision wrapper, per call
    done.append("featcache.lmdeploy.pytorch.models._serve")
    return done


class D2HCounter:
    """Counts device-to-host copies made from Python while active: ``Tensor.cpu()``,
    ``Tensor.to(<cpu>)`` and ``cpu_tensor.copy_(device_tensor)`` (calls, bytes, host ms; those of
    >= 1 MiB apart: feature-sized). Patches ``torch.Tensor`` while open: use it for a few requests,
    not timed ones."""

    LARGE = 1 << 20

    def __init__(self, on_device: Any = None) -> None:
        self.on_device = on_device or (lambda t: t.is_cuda)
        self.rows: list[tuple[str, int, float]] = []
        self.lock = threading.Lock()
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> D2HCounter:
        counter = self

        def record(what: str, nbytes: int, fn: Any, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            r = fn(*a, **k)
            with counter.lock:
                counter.rows.append((what, nbytes, (time.perf_counter() - t) * 1e3))
            return r

        cpu, to, copy_ = torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.copy_
        self.saved = dict(cpu=cpu, to=to, copy_=copy_)

        def p_cpu(self_: Any, *a: Any, **k: Any) -> Any:
            if counter.on_device(self_):
                return record("cpu", self_.nbytes, cpu, self_, *a, **k)
            return cpu(self_, *a, **k)

        def p_to(self_: Any, *a: Any, **k: Any) -> Any:
            dev = k.get("device", a[0] if a else None)
            to_host = isinstance(dev, (str, torch.device)) and str(dev).startswith("cpu")
            if to_host and counter.on_device(self_):
                return record("to_cpu", self_.nbytes, to, self_, *a, **k)
            return to(self_, *a, **k)

        def p_copy(self_: Any, src: Any, *a: Any, **k: Any) -> Any:
            if (isinstance(src, torch.Tensor) and self_.device.type == "cpu"
                    and not counter.on_device(self_) and counter.on_device(src)):
                return record("copy_to_cpu", src.nbytes, copy_, self_, src, *a, **k)
            return copy_(self_, src, *a, **k)

        torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.copy_ = p_cpu, p_to, p_copy  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            setattr(torch.Tensor, k, v)

    def take(self) -> dict[str, Any]:
        with self.lock:
            rows, self.rows = self.rows, []
        large = [r for r in rows if r[1] >= self.LARGE]
        return dict(calls=len(rows), mbytes=round(sum(r[1] for r in rows) / 2**20, 3),
                    ms=round(sum(r[2] for r in rows), 3), large_calls=len(large),
                    large_mbytes=round(sum(r[1] for r in large) / 2**20, 3),
                    large_ms=round(sum(r[2] for r in large), 3),
                    by_kind={k: sum(1 for r in rows if r[0] == k) for k in {r[0] for r in rows}})


def instrument_preprocess(pipe: Any) -> None:
    """Host-time wrappers on the live pipeline (instance attributes): lmdeploy's request
    preprocessing (template, tokenizer, image preprocessing), its image preprocessing, and
    featcache's frontend hook around it (keying, lookup, tagging)."""
    def timed(name: str, fn: Any) -> Any:
        return timed_call(fn, functools.partial(SPANS.add, name))

    engine = pipe.async_engine
    engine.preprocess = timed("request_preprocess", engine.preprocess)
    vm = engine.vl_encoder.model
    hook = vm.preprocess
    frontend = getattr(hook, "frontend", None)
    if frontend is None:
        vm.preprocess = timed("image_preprocess", hook)
    else:
        vm.preprocess = timed("fc_frontend", hook)
        frontend.original = timed("image_preprocess", frontend.original)

