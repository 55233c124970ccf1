"""featcache's lmdeploy frontend on lmdeploy's real CPU prompt path (ImageEncoder + MultimodalProcessor).

Each test runs the same requests through plain lmdeploy and through lmdeploy with
``featcache.lmdeploy.request.frontend`` installed, on tiny InternVL-HF and Qwen2-VL checkpoints built in
the session, and checks what reaches the engine: prompt, input_ids, image offsets and the per-image
dicts; and whether lmdeploy's own preprocessing ran. The engine side (storing features) is
simulated with ``cache.put(key, features, meta=ref.meta)``, as ``featcache.lmdeploy.pytorch.models`` does.

Needs lmdeploy 0.18 and its light dependencies (requirements/lmdeploy-cpu.txt); skipped without.
"""

from __future__ import annotations

import base64
import gc
import io

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.errors import FeatCacheError  # noqa: E402
from featcache.lmdeploy.request import frontend as frontend_module  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY, FeatRef  # noqa: E402

pytestmark = pytest.mark.filterwarnings(  # lmdeploy passes min_pixels to transformers' processor
    "ignore:Passing `min_pixels` and `max_pixels`:FutureWarning")

HIDDEN = 256  # the tiny models' LLM hidden size: one feature row per image token
# per-image parameters that change the key; lmdeploy honours Qwen2-VL's, drops InternVL-HF's
PARAMS = {tiny.INTERNVL: {"max_dynamic_patch": 2}, tiny.QWEN2VL: {"min_pixels": 28 * 28 * 16}}


class Rig:
    def __init__(self, arch: str, path: str) -> None:
        self.arch = arch
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path)  # lmdeploy alone
        self.cached = tiny.PromptPath(path)  # lmdeploy + featcache
        install_frontend(self.cached.model, self.cache, f"test:{arch}")
        self.cached.record_featcache()  # calls: featcache's preprocessing too (Qwen2-VL's)

    def close(self) -> None:
        self.plain.close()
        self.cached.close()
        gc.collect()  # release what the test's requests leased before the cache goes
        self.cache.close()

    def counters(self) -> dict[str, int]:
        """The frontend's counters; any featcache failure counted shows up as frontend_errors."""
        stats = self.cache.stats().get(SECTION, {})
        names = ("images", "hits", "misses", "preprocess_skipped", "frontend_errors")
        return {k: stats[k] for k in names if stats.get(k)}

    def pinned(self, key: bytes) -> bool:
        """Whether the device tier pins ``key`` (a lease on it is outstanding)."""
        return self.cache._chain.top._books.pinned(key)

    def store(self, out: dict) -> dict[bytes, torch.Tensor]:
        """What the engine does after running the vision model on the misses of ``out``."""
        stored = {}
        for item in out["multimodal"]:
            ref = item[REF_KEY]
            if not ref.hit:
                features = torch.randn(int(item["image_tokens"]), HIDDEN)
                self.cache.put(ref.key, features, meta=ref.meta)
                stored[ref.key] = features
        return stored


@pytest.fixture(params=[tiny.INTERNVL, tiny.QWEN2VL], ids=["internvl_hf", "qwen2vl"])
def rig(request, tmp_path_factory):
    r = Rig(request.param, tiny.checkpoint(request.param, tmp_path_factory))
    yield r
    r.close()


def assert_same_prompt(got: dict, want: dict) -> None:
    assert got["prompt"] == want["prompt"]
    assert got["input_ids"] == want["input_ids"]
    assert [m["offset"] for m in got["multimodal"]] == [m["offset"] for m in want["multimodal"]]


def assert_same_miss(got: dict, want: dict) -> None:
    """A miss's per-image dict: lmdeploy's own, plus a FeatRef that is a miss."""
    assert set(got) == set(want) | {REF_KEY}
    for k, v in want.items():
        assert_equal(got[k], v, k)
    ref = got[REF_KEY]
    assert isinstance(ref, FeatRef) and not ref.hit and ref.lease is None


def assert_same_hit(got: dict, want: dict) -> None:
    """A hit's per-image dict: lmdeploy's fields, a 0-row pixel_values placeholder, a hit FeatRef."""
    assert set(got) == set(want) | {REF_KEY}
    pixels, real = got["pixel_values"], want["pixel_values"]
    assert pixels.shape == (0, *real.shape[1:]) and pixels.dtype == real.dtype
    for k, v in want.items():
        if k != "pixel_values":
            assert_equal(got[k], v, k)
    ref = got[REF_KEY]
    assert isinstance(ref, FeatRef) and ref.hit and ref.lease is not None


def assert_equal(got, want, name: str) -> None:
    assert type(got) is type(want), name
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    else:
        assert got == want, name


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_first_request_misses_and_preprocesses_as_lmdeploy(rig):
    image = tiny.noise_image(100, 80, seed=1)
    msgs = tiny.messages(tiny.image_item(image))

    out, want = rig.cached.prompt(msgs), rig.plain.prompt(msgs)

    assert rig.cached.calls == [[(100, 80)]]  # lmdeploy's preprocess ran once, on the image
    assert_same_prompt(out, want)
    assert_same_miss(out["multimodal"][0], want["multimodal"][0])
    assert out["multimodal"][0][REF_KEY].key not in rig.cache
    assert rig.counters() == {"images": 1, "misses": 1}


def test_second_request_is_a_hit_without_preprocessing(rig):
    image = tiny.noise_image(100, 80, seed=1)
    first = rig.cached.prompt(tiny.messages(tiny.image_item(image)))
    stored = rig.store(first)
    (key,) = stored

    # the same pixels again, this time as a PNG data URL (lmdeploy decodes it to RGB)
    msgs = tiny.messages({"type": "image_url", "image_url": {"url": png_data_url(image)}})
    out, want = rig.cached.prompt(msgs), rig.plain.prompt(msgs)

    assert len(rig.cached.calls) == 1  # preprocess did not run for the second request
    assert_same_prompt(out, want)
    assert_same_hit(out["multimodal"][0], want["multimodal"][0])
    ref = out["multimodal"][0][REF_KEY]
    assert ref.key == key and ref.meta == first["multimodal"][0][REF_KEY].meta
    assert torch.equal(ref.lease.tensor, stored[key])
    assert rig.pinned(key)
    assert rig.counters() == {"images": 2, "hits": 1, "misses": 1, "preprocess_skipped": 1}

    del out, ref
    gc.collect()
    assert not rig.pinned(key)  # the request is gone: its lease went with it


def test_mixed_request_preprocesses_only_the_new_images_and_keeps_order(rig):
    a, b, c = (tiny.noise_image(w, h, seed=s) for w, h, s in [(100, 80, 1), (60, 130, 2), (90, 90, 3)])
    rig.store(rig.cached.prompt(tiny.messages(tiny.image_item(a))))
    # a conversation: [B, A] in the first user turn, C in the second
    msgs = [*tiny.messages(tiny.image_item(b), tiny.image_item(a)),
            {"role": "assistant", "content": "two images"},
            *tiny.messages(tiny.image_item(c), text="and this one?")]

    out, want = rig.cached.prompt(msgs), rig.plain.prompt(msgs)

    assert rig.cached.calls[1:] == [[b.size, c.size]]  # one call, with only the new images
    assert_same_prompt(out, want)
    got, real = out["multimodal"], want["multimodal"]
    assert_same_miss(got[0], real[0])
    assert_same_hit(got[1], real[1])
    assert_same_miss(got[2], real[2])
    assert len({m[REF_KEY].key for m in got}) == 3
    assert rig.counters() == {"images": 4, "hits": 1, "misses": 3, "preprocess_skipped": 1}
    assert msgs[0]["content"][1]["image_data"]["data"] is b  # the caller's messages are untouched


def test_other_pixels_or_other_params_miss(rig):
    image = tiny.noise_image(100, 80, seed=1)
    rig.store(rig.cached.prompt(tiny.messages(tiny.image_item(image))))
    touched = image.copy()
    touched.putpixel((0, 0), tuple(255 - v for v in image.getpixel((0, 0))))
    params = PARAMS[rig.arch]

    for msgs in (tiny.messages(tiny.image_item(touched)),
                 tiny.messages(tiny.image_item(image, **params))):
        calls = len(rig.cached.calls)
        out, want = rig.cached.prompt(msgs), rig.plain.prompt(msgs)
        assert len(rig.cached.calls) == calls + 1
        assert_same_prompt(out, want)
        assert_same_miss(out["multimodal"][0], want["multimodal"][0])
        rig.store(out)

    # with its params stored too, the image hits under each: fields as lmdeploy gives for each
    for msgs in (tiny.messages(tiny.image_item(image)), tiny.messages(tiny.image_item(image, **params))):
        out, want = rig.cached.prompt(msgs), rig.plain.prompt(msgs)
        assert_same_prompt(out, want)
        assert_same_hit(out["multimodal"][0], want["multimodal"][0])
    assert len(rig.cached.calls) == 3
    if rig.arch == tiny.QWEN2VL:  # min_pixels changes the grid: the params are part of the key
        assert not torch.equal(want["multimodal"][0]["image_grid_thw"],
                               rig.plain.prompt(tiny.messages(tiny.image_item(image)))
                               ["multimodal"][0]["image_grid_thw"])
    assert rig.counters() == {"images": 5, "hits": 2, "misses": 3, "preprocess_skipped": 2}


def _failing_acquire(key):
    raise RuntimeError("acquire failed")


@pytest.mark.parametrize("failure", ["acquire", "closed"])
def test_featcache_failure_falls_back_to_plain_preprocessing(rig, monkeypatch, failure):
    image = tiny.noise_image(100, 80, seed=1)
    msgs = tiny.messages(tiny.image_item(image))
    rig.store(rig.cached.prompt(msgs))  # a hit, were featcache working
    if failure == "acquire":
        monkeypatch.setattr(rig.cache, "acquire", _failing_acquire)
    else:
        rig.cache.close()
        with pytest.raises(FeatCacheError):
            rig.cache.acquire(b"k" * 16)

    out, want = rig.cached.prompt(msgs), rig.plain.prompt(msgs)

    assert len(rig.cached.calls) == 2  # preprocessed as without featcache
    assert_same_prompt(out, want)
    for got, real in zip(out["multimodal"], want["multimodal"], strict=True):
        assert set(got) == set(real)  # no FeatRef: the image is neither served nor stored
        for k, v in real.items():
            assert_equal(got[k], v, k)
    assert rig.counters()["frontend_errors"] == 1


def test_failure_after_lmdeploy_preprocessed_still_serves_the_request(rig, monkeypatch):
    """A featcache failure once lmdeploy's preprocess has run (tagging the misses) is a miss too."""
    def broken(item, namespace=None):
        raise RuntimeError("cannot record this image")

    monkeypatch.setattr(frontend_module, "encode_item", broken)
    msgs = tiny.messages(tiny.image_item(tiny.noise_image(100, 80, seed=1)))

    out, want = rig.cached.prompt(msgs), rig.plain.prompt(msgs)

    assert_same_prompt(out, want)
    assert REF_KEY not in out["multimodal"][0]
    assert rig.counters()["frontend_errors"] == 1


def test_each_request_holds_its_own_lease(rig):
    image = tiny.noise_image(100, 80, seed=1)
    msgs = tiny.messages(tiny.image_item(image))
    (key,) = rig.store(rig.cached.prompt(msgs))
    assert not rig.pinned(key)

    first, second = rig.cached.prompt(msgs), rig.cached.prompt(msgs)
    assert first["multimodal"][0][REF_KEY].lease is not second["multimodal"][0][REF_KEY].lease
    del first
    gc.collect()
    assert rig.pinned(key)  # the second request still holds it
    del second
    gc.collect()
    assert not rig.pinned(key)


def test_unreadable_metadata_is_a_miss_and_leaks_no_lease(rig):
    """Entries whose metadata this version cannot read (another featcache version's record, a
    foreign put under the key) are misses, and leave no pin behind."""
    image = tiny.noise_image(100, 80, seed=1)
    msgs = tiny.messages(tiny.image_item(image))
    first = rig.cached.prompt(msgs)
    key = first["multimodal"][0][REF_KEY].key
    rig.cache.put(key, torch.zeros(int(first["multimodal"][0]["image_tokens"]), HIDDEN), meta=b"{}")
    del first

    out, want = rig.cached.prompt(msgs), rig.plain.prompt(msgs)
    assert_same_prompt(out, want)
    del out
    gc.collect()
    assert not rig.pinned(key)
    assert rig.cache.stats()["lmdeploy"]["unreadable_meta"] == 1


def test_entries_record_their_namespace_for_ls_and_purge(rig):
    import json

    from featcache.lmdeploy.request.entry_meta import decode_item, namespace_of

    out = rig.cached.prompt(tiny.messages(tiny.image_item(tiny.noise_image(90, 70, seed=11))))
    ref = out["multimodal"][0][REF_KEY]
    assert namespace_of(ref.meta) == f"test:{rig.arch}"
    assert set(json.loads(ref.meta)) == {"fields", "pixels", "ns"}
    assert int(decode_item(ref.meta)["image_tokens"]) == int(out["multimodal"][0]["image_tokens"])
