"""The combined TurboMind configuration (``turbomind="combined"``) on lmdeploy's real prompt path, up to
what TurboMind's C++ engine is handed, on the CPU.

lmdeploy's real ``ImageEncoder`` + ``MultimodalProcessor`` (backend "turbomind") run every request;
lmdeploy's real ``TurboMindInstance.async_stream_infer`` turns the result into the engine call, whose
``model_inst.forward(inputs, mm_inputs, ...)`` is recorded here (``Engine``) instead of entering C++;
``mm_inputs`` comes from the real ``TurboMind.mm_input_converter`` and InternVL's
``to_turbomind_multimodal`` over the stand-in binding (tests/turbomind_binding.py). So each request
is seen in the form TurboMind receives: token ids plus either per-image pixels with fingerprints
(native: prefix-cacheable) or ``input_embeddings`` + ranges (features: never prefix-cached).
"""

from __future__ import annotations

import asyncio
import gc
import types

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require("shortuuid")

import lmdeploy_tiny as tiny  # noqa: E402
import turbomind_binding  # noqa: E402
from test_lmdeploy_turbomind import (  # noqa: E402
    ENGINE_DTYPE,
    reference_features,
    source_model,
    weighted_checkpoint,
)

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import wrap  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.turbomind.combined import features_key  # noqa: E402
from featcache.lmdeploy.turbomind.native import fingerprint  # noqa: E402
from featcache.lmdeploy.turbomind.route import (  # noqa: E402
    FEATURES,
    NATIVE,
    RouteBook,
    context_digests,
    decide,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")


@pytest.fixture(scope="module")
def binding():
    with turbomind_binding.installed() as b:
        b.TensorMap = dict  # the engine's input map: a dict here, so the test can read it
        yield b


@pytest.fixture(autouse=True)
def no_cuda_query(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))


class Engine:
    """Stands in for TurboMind's C++ model instance: records what ``forward`` is handed and
    finishes each request at once with one token."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, torch.Tensor], object]] = []

    def forward(self, inputs, mm_inputs, session, gen_cfg, stream_output, metrics, signal_cb):
        tensors = {k: v.args[0] for k, v in inputs.items()}  # _tm.from_dlpack(tensor) records
        self.calls.append((tensors, mm_inputs))
        n = len(tensors["input_ids"])
        state = types.SimpleNamespace(status=7, seq_len=n + 1)  # 7: finished
        signal_cb()
        return ({"output_ids": torch.zeros(n + 1, dtype=torch.int32)},
                types.SimpleNamespace(consume=lambda: state), None)

    def cancel(self) -> None:
        pass


class Rig:
    def __init__(self, path: str, cache: FeatureCache | None = None) -> None:
        from lmdeploy.messages import TurbomindEngineConfig

        self.path = path
        self.cache = cache or FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.prompt = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
        self.plain = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
        engine = types.SimpleNamespace(vl_encoder=self.prompt.encoder,
                                       prompt_processor=self.prompt.processor,
                                       backend_config=TurbomindEngineConfig(dtype=ENGINE_DTYPE))
        wrap(types.SimpleNamespace(async_engine=engine), cache=self.cache, turbomind="combined")
        self.prompt.record_featcache()  # calls: featcache's preprocessing too (InternVL-HF's)
        self.server = self.prompt.model.forward.__self__  # the CombinedServer
        self.tm = source_model(tiny.INTERNVL, path)
        self.tm.engine_config.enable_metrics = False  # (the stand-in engine reports none)

    def send(self, msgs: list[dict]) -> types.SimpleNamespace:
        """One request through the prompt path and lmdeploy's TurboMindInstance, as the engine
        receives it: ``inputs`` (its tensor map), ``items`` (the binding's per-image items, or
        None), ``out`` (the prompt path's dict), ``route``."""
        from lmdeploy.messages import GenerationConfig
        from lmdeploy.turbomind.turbomind import TurboMindInstance

        out = self.prompt.prompt(msgs)
        instance = object.__new__(TurboMindInstance)
        instance.tm_model = self.tm
        instance._model_inst = Engine()

        async def run() -> None:
            async for _ in instance.async_stream_infer(
                    1, gen_config=GenerationConfig(max_new_tokens=1), **out):
                pass

        asyncio.run(run())
        (inputs, mm), = instance.model_inst.calls
        items = None if mm is None else list(mm.args[0])
        route = NATIVE if items is not None else FEATURES
        assert (route == FEATURES) == ("input_embeddings" in inputs)
        return types.SimpleNamespace(inputs=inputs, items=items, out=out, route=route)

    def want(self, msgs: list[dict]) -> types.SimpleNamespace:
        """Plain TurboMind's input for ``msgs``: token ids and per-image pixels."""
        out = self.plain.prompt(msgs)
        return types.SimpleNamespace(ids=out["input_ids"],
                                     pixels=[m["pixel_values"] for m in out["multimodal"]],
                                     spans=[(m["offset"], m["offset"] + m["image_tokens"])
                                            for m in out["multimodal"]])

    def counts(self) -> dict:
        return self.cache.stats()[SECTION]

    def close(self) -> None:
        self.prompt.close()
        self.plain.close()
        gc.collect()
        self.cache.close()


@pytest.fixture
def rig(tmp_path_factory, binding):
    r = Rig(weighted_checkpoint(tmp_path_factory))
    yield r
    r.close()


IMG = {s: tiny.noise_image(120, 90, seed=s) for s in (1, 2, 3)}


def user(text: str, *seeds: int) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *[tiny.image_item(IMG[s]) for s in seeds]]}


def chat(first: dict, turns: int) -> list[dict]:
    """``first`` and ``turns - 1`` more turns, each answered "ok." (the history a client resends)."""
    msgs = [first]
    for t in range(1, turns):
        msgs += [{"role": "assistant", "content": "ok."}, {"role": "user", "content": f"and {t}?"}]
    return msgs


def assert_native(got, want) -> None:
    """What the native path sends: plain TurboMind's token ids, spans and pixels (bit for bit),
    every image with its fingerprint: TurboMind can compute any image itself."""
    assert got.route == NATIVE and "input_embeddings" not in got.inputs
    assert got.inputs["input_ids"].tolist() == want.ids
    assert len(got.items) == len(want.pixels)
    for item, px, (begin, end), m in zip(got.items, want.pixels, want.spans, got.out["multimodal"],
                                         strict=True):
        assert (item.kwargs["token_begin"], item.kwargs["token_end"]) == (begin, end)
        sent = item.kwargs["data"].args[0]
        assert sent.dtype == px.dtype and torch.equal(sent, px)  # full pixels, not a placeholder
        assert item.kwargs["fingerprint"] == fingerprint(m[REF_KEY].key)


def assert_features(got, want, path: str) -> None:
    """What the features path sends: plain's token ids, the checkpoint's features over exactly the
    image spans, in the engine dtype, no multimodal items (so TurboMind runs no vision model)."""
    assert got.route == FEATURES and got.items is None
    assert got.inputs["input_ids"].tolist() == want.ids
    values, ranges = got.inputs["input_embeddings"], got.inputs["input_embedding_ranges"]
    assert values.device.type == "cpu" and values.dtype == torch.float16
    assert [tuple(r) for r in ranges.tolist()] == want.spans
    ref = torch.cat([reference_features(path, px) for px in want.pixels])
    assert torch.equal(values, ref)


def test_chat_turns_go_native_and_fresh_contexts_skip_the_vit(rig):
    a1 = user("conversation A: look", 1)
    first = rig.send([a1])  # image 1 never seen: TurboMind's ViT computes it, the prompt indexed
    assert_native(first, rig.want([a1]))
    assert rig.prompt.calls == [[(120, 90)]]

    for turns in (2, 3):  # turns resending A's history: TurboMind's prefix cache covers image 1
        got = rig.send(chat(a1, turns))
        assert_native(got, rig.want(chat(a1, turns)))
    assert len(rig.prompt.calls) == 1  # pixels from the cache, nothing preprocessed again
    assert rig.counts().get("vision_images", 0) == 0  # featcache's tower never ran

    b1 = user("conversation B, another context: look", 1)
    b = rig.send([b1])  # a fresh context, image 1 seen: features, the tower once on cached pixels
    assert_features(b, rig.want([b1]), rig.path)
    assert len(rig.prompt.calls) == 1 and rig.counts()["vision_images"] == 1

    c1 = user("conversation C: look", 1)
    c = rig.send([c1])  # features held: neither preprocessing nor any vision model
    assert_features(c, rig.want([c1]), rig.path)
    assert rig.counts()["vision_images"] == 1 and rig.counts()["tm_features_served"] == 1
    assert c.out["input_embeddings"][0].data_ptr() == b.out["input_embeddings"][0].data_ptr()

    b2 = rig.send(chat(b1, 2))  # B came back: sent native once, so TurboMind indexes it
    assert_native(b2, rig.want(chat(b1, 2)))
    b3 = rig.send(chat(b1, 3))
    assert_native(b3, rig.want(chat(b1, 3)))
    counts = rig.counts()
    assert (counts["tm_route_miss"], counts["tm_route_continued"], counts["tm_route_repeat"],
            counts["tm_route_indexed"]) == (1, 3, 2, 1)
    assert (counts["tm_route_native"], counts["tm_route_features"]) == (5, 2)
    assert len(rig.prompt.calls) == 1


def test_a_new_image_in_a_fresh_context_goes_native_then_features(rig):
    rig.send([user("first", 1)])
    mixed = user("a fresh context with a new picture", 1, 2)
    assert_native(rig.send([mixed]), rig.want([mixed]))  # image 2 is new: a miss
    again = user("yet another context", 2, 1)
    got = rig.send([again])  # both seen, neither's features held: the tower over cached pixels
    assert_features(got, rig.want([again]), rig.path)
    assert rig.counts()["vision_images"] == 2 and rig.prompt.calls == [[(120, 90)], [(120, 90)]]


def test_a_turn_resending_its_history_with_a_seen_image_continues_the_history(rig):
    """Several contexts in one request (issue 40 item 5): a turn resending a history and adding
    an image featcache has seen elsewhere. Its last context (the history up to the new image) is
    fresh and every image seen, but the request continues its history: native, so that
    TurboMind's prefix cache covers the history and its image (a history sent natively) or
    indexes it now (one sent as features). Routed features, it would lose that prefix reuse."""
    rig.send([user("conversation B: look", 2)])  # image 2 seen: its pixels cached
    a1 = user("conversation A: look", 1)
    assert rig.send([a1]).route == NATIVE  # image 1 new: a miss, A sent natively
    turn = [a1, {"role": "assistant", "content": "ok."}, user("and this one?", 2)]
    assert_native(rig.send(turn), rig.want(turn))
    assert rig.counts()["tm_route_continued"] == 1

    c1 = user("conversation C: look", 1)
    assert rig.send([c1]).route == FEATURES  # a fresh context, image 1 seen
    turn = [c1, {"role": "assistant", "content": "ok."}, user("and this one?", 2)]
    assert_native(rig.send(turn), rig.want(turn))  # C came back: indexed now
    counts = rig.counts()
    assert (counts["tm_route_miss"], counts["tm_route_continued"], counts["tm_route_repeat"],
            counts["tm_route_indexed"]) == (2, 1, 1, 1)


def test_features_survive_their_pixels(rig):
    """Pixels evicted, features held: the request still goes features, served from the cache;
    only lmdeploy's preprocessing runs again (a cost of speed)."""
    rig.send([user("one", 3)])
    rig.send([user("two", 3)])  # features computed and stored
    keys = list(rig.cache.keys())
    assert len(keys) == 2  # the pixels and the features of image 3
    pixels = [k for k in keys if rig.cache.get(k).dim() == 4]
    assert len(pixels) == 1
    rig.cache.discard(pixels[0])
    msgs = [user("three", 3)]
    got = rig.send(msgs)
    assert_features(got, rig.want(msgs), rig.path)
    assert len(rig.prompt.calls) == 2 and rig.counts()["vision_images"] == 1


def test_a_wrong_guess_costs_speed_only(rig):
    """A book that forgot conversation A (or a TurboMind that evicted it) changes the route of
    A's next turn, never what a request carries: either full pixels or full features."""
    rig.server.book = RouteBook(capacity=1)
    a1 = user("conversation A", 1)
    rig.send([a1])
    rig.send([user("conversation B", 1)])  # books B; A is forgotten
    got = rig.send(chat(a1, 2))  # A's turn 2 now looks fresh: features, complete
    assert_features(got, rig.want(chat(a1, 2)), rig.path)
    got = rig.send(chat(a1, 3))  # and comes back native
    assert_native(got, rig.want(chat(a1, 3)))


def test_an_image_featcache_cannot_key_sends_the_request_native(rig):
    """An image whose parameters cannot be keyed is lmdeploy's alone (its own sha256 fingerprint);
    the request goes native even where its other image's features are cached."""
    import hashlib

    for text in ("one", "two"):
        rig.send([user(text, 1)])  # image 1: pixels, then features cached
    odd = {"type": "image_data", "image_data": {"data": IMG[2], "note": object()}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "fresh"},
                                         tiny.image_item(IMG[1]), odd]}]
    got = rig.send(msgs)
    assert got.route == NATIVE and rig.counts()["tm_route_unkeyed"] == 1
    want = rig.want([{"role": "user", "content": [{"type": "text", "text": "fresh"},
                                                  tiny.image_item(IMG[1]), tiny.image_item(IMG[2])]}])
    assert got.inputs["input_ids"].tolist() == want.ids
    for item, px in zip(got.items, want.pixels, strict=True):
        assert torch.equal(item.kwargs["data"].args[0], px)
    unkeyed = got.items[1].kwargs
    pixels = unkeyed["data"].args[0].contiguous().view(torch.uint8).numpy().tobytes()
    assert unkeyed["fingerprint"] == hashlib.sha256(pixels).digest()  # lmdeploy's own


def test_a_failure_while_routing_sends_the_request_native(rig, monkeypatch):
    rig.send([user("one", 1)])

    def broken(items):
        raise RuntimeError("injected")

    monkeypatch.setattr(rig.server.features, "run", broken)
    msgs = [user("a fresh context", 1)]
    got = rig.send(msgs)  # would go features; the tower fails: native, complete
    assert_native(got, rig.want(msgs))
    assert rig.counts()["tm_route_errors"] == 1 and rig.counts()["frontend_errors"] == 1


def test_combined_refuses_what_the_features_path_cannot_serve(tmp_path_factory, binding):
    from lmdeploy.messages import TurbomindEngineConfig

    path = tiny.checkpoint(tiny.QWEN2VL, tmp_path_factory)
    prompt = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind")
    engine = types.SimpleNamespace(vl_encoder=prompt.encoder, prompt_processor=prompt.processor,
                                   backend_config=TurbomindEngineConfig(dtype=ENGINE_DTYPE))
    with FeatureCache(device="cpu", device_bytes="8MiB", host_bytes=0) as cache:
        with pytest.raises(ValueError, match="M-RoPE"):
            wrap(types.SimpleNamespace(async_engine=engine), cache, turbomind="combined")
        with pytest.raises(ValueError, match="turbomind= must be one of"):
            wrap(types.SimpleNamespace(async_engine=engine), cache, turbomind="auto")
    prompt.close()


# -- the books and the policy alone --------------------------------------------------------------

def conversation(*entries) -> list[dict]:
    """Messages from ("role", "text") and ("image",) entries (images in user messages)."""
    msgs: list[dict] = []
    for e in entries:
        if e[0] == "image":
            msgs[-1]["content"].append({"type": "image", "data": None})
        else:
            msgs.append({"role": e[0], "content": [{"type": "text", "text": e[1]}]})
    return msgs


def test_context_digests_follow_the_conversation_up_to_each_image():
    k1, k2 = b"k" * 32, b"q" * 32
    base = conversation(("user", "look"), ("image",), ("user", "after"))
    d = context_digests(base, [k1], "ns")
    assert d == context_digests(conversation(("user", "look"), ("image",), ("user", "other")),
                                [k1], "ns")  # what follows an image is not its context
    assert d != context_digests(conversation(("user", "lo0k"), ("image",)), [k1], "ns")
    assert d != context_digests(base, [k2], "ns")  # another image
    assert d != context_digests(base, [k1], "other model")
    turn = base + [{"role": "assistant", "content": "ok."}, {"role": "preprocess", "content": []}]
    assert context_digests(turn, [k1], "ns") == d  # lmdeploy's own entries are not conversation
    two = conversation(("user", "look"), ("image",), ("image",))
    d2 = context_digests(two, [k1, k2], "ns")
    assert d2[0] == context_digests(conversation(("user", "look"), ("image",)), [k1], "ns")[0]
    assert context_digests(two, [None, k2], "ns") == [None, None]
    assert context_digests(two, [k1, None], "ns") == [d2[0], None]
    with pytest.raises(ValueError):
        context_digests(two, [k1], "ns")


def test_decide_on_hand_made_traces():
    book = RouteBook()
    asked = []

    def seen(*values):
        def answer():
            asked.append(values)
            return values
        return answer

    a, b = [b"a" * 32], [b"b" * 32]
    assert decide([None], book, seen(True)) == (NATIVE, "unkeyed")
    assert decide(a, book, seen(False)) == (NATIVE, "miss")
    book.record(a, NATIVE)
    assert decide(a, book, seen(True)) == (NATIVE, "continued")
    assert decide(b, book, seen(True)) == (FEATURES, "repeat")
    book.record(b, FEATURES)
    assert decide(b, book, seen(True)) == (NATIVE, "indexed")
    book.record(a, FEATURES)  # a prefix TurboMind indexed stays booked native
    assert book.sent_as(a[0]) == NATIVE
    assert asked == [(False,), (True,)]  # the cache is asked about fresh contexts only
    with pytest.raises(ValueError):
        book.record(a, "auto")
    small = RouteBook(capacity=1)
    small.record(a, NATIVE)
    small.record(b, NATIVE)
    assert small.sent_as(a[0]) is None and len(small) == 1


def test_a_request_of_several_contexts_routes_on_its_first():
    """A request's first context is the conversation up to its first image: what a chat turn
    resending its history shares with the turn that sent it. The route follows how that was
    sent; the request's later contexts (its new images) are fresh."""
    k1, k2 = b"1" * 32, b"2" * 32
    first = conversation(("user", "look"), ("image",))
    sent = context_digests(first, [k1], "ns")
    turn = first + conversation(("assistant", "ok."), ("user", "and this one?"), ("image",))
    digests = context_digests(turn, [k1, k2], "ns")
    assert digests[0] == sent[0] and digests[1] is not None and digests[1] != sent[0]

    def both_seen() -> list[bool]:
        return [True, True]

    book = RouteBook()
    book.record(sent, NATIVE)
    assert book.sent_as(digests[1]) is None
    assert decide(digests, book, both_seen) == (NATIVE, "continued")
    book.record(digests, NATIVE)
    assert [book.sent_as(d) for d in digests] == [NATIVE, NATIVE]

    book = RouteBook()
    book.record(sent, FEATURES)
    assert decide(digests, book, both_seen) == (NATIVE, "indexed")

    book = RouteBook()
    book.record(sent, NATIVE)
    book.record(digests, FEATURES)  # (forced): the history TurboMind indexed stays native
    assert [book.sent_as(d) for d in digests] == [NATIVE, FEATURES]

    fresh = context_digests(conversation(("user", "new"), ("image",), ("image",)), [k1, k2], "ns")
    assert decide(fresh, RouteBook(), both_seen) == (FEATURES, "repeat")
    assert decide(fresh, RouteBook(), lambda: [True, False]) == (NATIVE, "miss")
    assert decide([digests[0], None], book, both_seen) == (NATIVE, "unkeyed")


def test_features_keys_are_derived_from_pixel_keys():
    k = features_key(b"p" * 32, "ns")
    assert k == features_key(b"p" * 32, "ns") and k.namespace == "ns" and len(k) == 32
    assert k != features_key(b"p" * 32, "other") and k != features_key(b"r" * 32, "ns")


def test_turbomind_bench_dry_run_measures_the_combined_configuration():
    """bench/turbomind_bench.py's CPU dry-run (stand-in pipelines, featcache's real hooks) runs the
    combined engine beside plain, native and features: (a) goes features after its priming miss,
    (b) turns 2-4 go native, (c) never runs featcache's tower (its own assertions)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "turbomind_bench.py"), "dry-run"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0 and "DRY-RUN OK: 4 engines" in out.stdout, out.stderr[-3000:]
    assert '"combined_b_turns_2_4_within_1_1x_native"' in out.stdout


def test_legacy_internvl_chat_model_routes_too(tmp_path, binding, monkeypatch):
    """The seed models' architecture (legacy ``InternVLChatModel``, trust_remote_code; the
    layer-norm InternViT of InternVL2-2B, tiny): a miss natively, a fresh context as features from
    ``LegacyInternVLTower`` in the engine dtype, the chat turn natively."""
    import importlib.util
    import sys

    import test_seed_models as seeds  # (its tiny checkpoint builder and torchvision stand-in)
    from lmdeploy.messages import TurbomindEngineConfig

    if importlib.util.find_spec("torchvision") is None:
        for name, module in seeds._torchvision_stand_in().items():
            monkeypatch.setitem(sys.modules, name, module)
    path = seeds.seed.build("tiny2b", str(tmp_path), device="cpu")["path"]
    prompt = tiny.PromptPath(path, ENGINE_DTYPE, backend="turbomind", trust_remote_code=True)
    engine = types.SimpleNamespace(vl_encoder=prompt.encoder, prompt_processor=prompt.processor,
                                   backend_config=TurbomindEngineConfig(dtype=ENGINE_DTYPE))
    image = seeds.IMAGE()

    def turn(text: str) -> dict:
        return {"role": "user", "content": [{"type": "text", "text": text}, tiny.image_item(image)]}

    with FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0) as cache:
        wrap(types.SimpleNamespace(async_engine=engine), cache, turbomind="combined")
        try:
            first = prompt.prompt([turn("A")])
            assert first["multimodal"][0]["pixel_values"].shape[0] == seeds.TILES
            fresh = prompt.prompt([turn("B")])
            assert "multimodal" not in fresh
            feats = fresh["input_embeddings"][0]
            assert feats.dtype == torch.float16 and feats.shape[0] == seeds.TILES * 4
            again = prompt.prompt([turn("A"), {"role": "assistant", "content": "ok."},
                                   {"role": "user", "content": "and?"}])
            counts = cache.stats()[SECTION]
            # the first turn preprocessed by featcache, none of the others
            assert "multimodal" in again and len(prompt.calls) == 0 and counts["preprocess_fast"] == 1
            assert (counts["tm_route_miss"], counts["tm_route_repeat"],
                    counts["tm_route_continued"], counts["vision_images"]) == (1, 1, 1, 1)
            del first, fresh, again, feats
        finally:
            prompt.close()
            gc.collect()
