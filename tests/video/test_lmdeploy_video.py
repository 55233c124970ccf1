"""featcache on videos (issue 52), on lmdeploy 0.18's real CPU code (run in an interpreter of their
own by tests/test_lmdeploy_video.py): a tiny Qwen3-VL checkpoint with transformers' real video
processor (``video_tiny``), MP4 clips encoded by OpenCV and decoded as lmdeploy decodes them,
lmdeploy's real prompt path (``MultimodalProcessor`` + the new-API ``VisionModel.preprocess``),
then its real input processor, prepare and forward with the fake tower of ``test_lmdeploy_newapi``.

- a video's first request is lmdeploy's own output (ids, offsets, every frame item, pixels);
- its repeat is served from its entries: equal to lmdeploy's output, never decoded, never given to
  the video processor, the tower never run on it; another sampling (options, size) is a miss;
- every hostile video is refused before decoding with a 400 that names the limit, and the server
  (the frontend) goes on.
"""

from __future__ import annotations

import dataclasses
import gc
import io

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require()

import lmdeploy_tiny as tiny  # noqa: E402
import video_tiny as vt  # noqa: E402
from _family_rig import assert_prompt_is_lmdeploys  # noqa: E402

assert vt.torchvision_for_transformers() is None  # (tests/conftest.py did it, before transformers)

from lmdeploy.pytorch.models import qwen3_vl  # noqa: E402
from test_lmdeploy_newapi import CLASSES, FAKES, levels, n_levels, step_context, vision_of  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from featcache import FeatureCache  # noqa: E402
from featcache.lmdeploy import families  # noqa: E402
from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION, install_frontend  # noqa: E402
from featcache.lmdeploy.request.media import (  # noqa: E402
    MediaError,
    MediaOptionError,
    MediaPolicy,
    VideoLimits,  # noqa: E402
)
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.request.video import read as video_read  # noqa: E402
from featcache.lmdeploy.request.video.read import BadVideoError  # noqa: E402

ARCHS = [tiny.QWEN3VL, tiny.QWEN3_5]  # (Qwen3.5 on Qwen3-VL's processor, as its checkpoints)
CLIP = vt.clip(12, 96, 64, 4.0, seed=0)
OTHER = vt.clip(8, 64, 96, 2.0, seed=1)
FRAMES = vt.jpeg_frames(6, 96, 64, seed=2)  # a data URL of frames a client sampled itself


class VideoRig:
    def __init__(self, arch: str, path: str) -> None:
        self.arch = arch
        self.path = path
        self.config = AutoConfig.from_pretrained(path)
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = tiny.PromptPath(path)
        self.ours = tiny.PromptPath(path)
        install_frontend(self.ours.model, self.cache, f"test:{arch}", self.ours.processor)
        self.frontend = self.ours.model.preprocess.frontend
        self.given: list[int] = []  # videos the video processor was given, per call
        vp = self.ours.model.processor.video_processor
        given, call = self.given, type(vp).__call__

        def recorded(this, videos, *args, **kwargs):
            given.append(len(videos))
            return call(this, videos, *args, **kwargs)

        vp.__class__ = type(f"Recorded{type(vp).__name__}", (type(vp),), {"__call__": recorded})
        self.processor = KeyedInputProcessor(qwen3_vl.Qwen3VLInputProcessor(self.config, torch.float16),
                                             families.SPECS[arch].items)

    def prompt(self, *items, plain: bool = False, text: str = "what happens", **kwargs) -> dict:
        path = self.plain if plain else self.ours
        return path.prompt(tiny.messages(*items, text=text), **kwargs)

    def stats(self) -> dict[str, int]:
        return self.cache.stats().get(SECTION, {})

    def seed(self, prompt: dict) -> dict[bytes, torch.Tensor]:
        """Store each miss's features as the model would (every deepstack level)."""
        stored = {}
        for item in prompt["multimodal"]:
            ref = item[REF_KEY]
            if ref.hit:
                continue
            start, end = item["offset"]
            stored[ref.key] = torch.randn(end - start, 256 * n_levels(self.arch))
            self.cache.put(ref.key, stored[ref.key], meta=ref.meta)
        return stored

    def close(self) -> None:
        self.plain.close()
        self.ours.close()
        gc.collect()
        self.cache.close()


@pytest.fixture(params=ARCHS, ids=["qwen3vl", "qwen3_5"])
def rig(request, tmp_path_factory):
    r = VideoRig(request.param, vt.checkpoint(tmp_path_factory, request.param))
    yield r
    r.close()


def video(raw: bytes = CLIP) -> dict:
    return vt.video_item(vt.data_url(raw))


def is_video(item: dict) -> bool:
    return getattr(item["modality"], "value", item["modality"]) == "video"


def assert_same(plain: dict, ours: dict) -> None:
    """featcache's output equals lmdeploy's: ids, offsets, every item's fields; a miss's pixels
    equal, a hit's a 0-row placeholder of the same trailing shape and dtype."""
    assert_prompt_is_lmdeploys(plain, ours, hits_have_pixels=False)


# -- the frontend --------------------------------------------------------------------------------

def test_the_startup_probe_passes_and_videos_are_cached(rig):
    assert rig.frontend.videos and rig.frontend.expands
    assert "video_probe_failed" not in rig.stats()


@pytest.mark.parametrize("shape", ["one", "two", "image-and-video"])
def test_a_new_video_is_lmdeploys_own_output(rig, shape):
    items = {"one": [video()], "two": [video(), video(OTHER)],
             "image-and-video": [tiny.image_item(tiny.noise_image(100, 80)), video(OTHER)]}[shape]
    ours = rig.prompt(*items, text="first <then> second")
    assert_same(rig.prompt(*items, plain=True, text="first <then> second"), ours)
    frames = [m for m in ours["multimodal"] if is_video(m)]
    assert frames and all(REF_KEY in m and not m[REF_KEY].hit for m in frames)


def test_a_repeated_video_is_served_without_decoding_or_preprocessing(rig, monkeypatch):
    first = rig.prompt(video(), text="turn one")
    rig.seed(first)
    rig.given.clear()

    def no_decode(*args, **kwargs):
        raise AssertionError("a held video was decoded")

    monkeypatch.setattr("featcache.lmdeploy.request.video.resolve.decode", no_decode)
    again = rig.prompt(video(), text="turn two")
    monkeypatch.undo()
    assert_same(rig.prompt(video(), plain=True, text="turn two"), again)
    assert all(m[REF_KEY].hit for m in again["multimodal"])
    assert rig.given == []  # the video processor never saw it
    assert rig.stats()["video_hits"] == 1 and rig.stats()["video_decode_skipped"] == 1


def test_a_held_video_beside_a_new_one(rig):
    rig.seed(rig.prompt(video()))
    rig.given.clear()
    ours = rig.prompt(video(OTHER), video(), text="compare")
    assert_same(rig.prompt(video(OTHER), video(), plain=True, text="compare"), ours)
    hits = [m[REF_KEY].hit for m in ours["multimodal"]]
    assert any(hits) and not all(hits)
    assert rig.given == [1]  # only the new video was preprocessed


@pytest.mark.parametrize("change", [
    {"media_io_kwargs": {"video": {"num_frames": 4}}},
    {"media_io_kwargs": {"video": {"fps": 1}}},
    {"mm_processor_kwargs": {"video": {"min_pixels": tiny.QWEN3_MIN_PIXELS, "max_pixels": 32 * 32 * 8}}},
], ids=["num_frames", "fps", "size"])
def test_another_sampling_of_the_same_video_is_a_miss(rig, change):
    rig.seed(rig.prompt(video()))
    ours = rig.prompt(video(), **change)
    assert_same(rig.prompt(video(), plain=True, **change), ours)
    assert not any(m[REF_KEY].hit for m in ours["multimodal"])
    rig.seed(ours)
    again = rig.prompt(video(), **change)  # that sampling is held now, under its own keys
    assert all(m[REF_KEY].hit for m in again["multimodal"])
    assert_same(rig.prompt(video(), plain=True, **change), again)


def test_the_same_bytes_as_an_image_and_as_a_video_never_share_an_entry(rig):
    buf = io.BytesIO()
    tiny.noise_image(64, 48).save(buf, format="PNG")
    raw = buf.getvalue()
    image = {"type": "image_url", "image_url": {"url": vt.data_url(raw, "image/png")}}
    got = rig.prompt(image)
    with pytest.raises(BadVideoError):  # (a PNG is no video: refused, the image's entry untouched)
        rig.prompt(vt.video_item(vt.data_url(raw, "video/mp4")))
    assert rig.prompt(image)["input_ids"] == got["input_ids"]


def test_a_failure_inside_featcache_is_a_miss_never_a_wrong_answer(rig, monkeypatch):
    rig.seed(rig.prompt(video()))

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr("featcache.lmdeploy.request.processor.plan_videos", broken)
    ours = rig.prompt(video())
    plain = rig.prompt(video(), plain=True)
    assert ours["input_ids"] == plain["input_ids"]
    assert all(torch.equal(x["pixel_values_videos"], y["pixel_values_videos"])
               for x, y in zip(plain["multimodal"], ours["multimodal"], strict=True))
    assert rig.stats()["frontend_errors"] == 1


# -- hostile videos ------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"", b"\x00\x00\x00\x18ftypmp42" + bytes(200), CLIP[: len(CLIP) // 3],
                                 b"<html>not a video</html>"],
                         ids=["empty", "header-only", "truncated", "not-a-video"])
def test_bytes_that_are_no_video_are_a_400(rig, raw):
    item = video(raw) if raw else vt.video_item("data:video/mp4;base64,")
    with pytest.raises(ValueError):
        rig.prompt(item)
    assert_same(rig.prompt(video(), plain=True), rig.prompt(video()))  # the server goes on


@pytest.mark.parametrize("limits, match", [
    (VideoLimits(max_video_bytes=len(CLIP) - 1), "--max-video-bytes"),
    (VideoLimits(max_frame_pixels=96 * 64 - 1), "--max-video-frame-pixels"),
    (VideoLimits(max_video_frames=11), "--max-video-frames"),
    (VideoLimits(max_video_seconds=2.5), "--max-video-seconds"),
    (VideoLimits(max_sampled_frames=6), "--max-sampled-frames"),
], ids=["bytes", "resolution", "frames", "duration", "sampled"])
def test_a_video_past_a_limit_is_refused_before_decoding(rig, limits, match, monkeypatch):
    rig.frontend.media = dataclasses.replace(rig.frontend.media, video=limits)
    decoded = []
    monkeypatch.setattr("featcache.lmdeploy.request.video.resolve.decode", lambda *a, **k: decoded.append(1))
    with pytest.raises(MediaError, match=match):
        rig.prompt(video())
    assert decoded == [] and rig.stats()["media_refused"] == 1
    rig.frontend.media = dataclasses.replace(rig.frontend.media, video=VideoLimits())
    monkeypatch.undo()
    assert_same(rig.prompt(video(), plain=True), rig.prompt(video()))


@pytest.mark.parametrize("limits, match", [
    (VideoLimits(max_frame_pixels=96 * 64 - 1), "--max-video-frame-pixels"),
    (VideoLimits(max_video_frames=11), "--max-video-frames"),
    (VideoLimits(max_video_seconds=2.5), "--max-video-seconds"),
    (VideoLimits(max_sampled_frames=6), "--max-sampled-frames"),
], ids=["resolution", "frames", "duration", "sampled"])
def test_a_held_video_is_checked_by_its_recorded_facts_not_probed_again(rig, limits, match, monkeypatch):
    """A hit's container is not opened again: what it states was recorded with its entries, and
    is checked against the limits of now (a held video past a lowered limit is refused alike)."""
    rig.seed(rig.prompt(video()))
    probed = []
    real = video_read.stated
    monkeypatch.setattr(video_read, "stated",
                        lambda raw: probed.append(1) or real(raw))
    assert all(m[REF_KEY].hit for m in rig.prompt(video())["multimodal"]) and probed == []
    rig.frontend.media = dataclasses.replace(rig.frontend.media, video=limits)
    with pytest.raises(MediaError, match=match):
        rig.prompt(video())
    assert probed == []
    rig.frontend.media = dataclasses.replace(rig.frontend.media, video=VideoLimits())
    assert all(m[REF_KEY].hit for m in rig.prompt(video())["multimodal"])  # (nothing left leased)
    rig.prompt(video(OTHER))  # a new video is probed
    assert probed == [1]


@pytest.mark.parametrize("options", [
    {"video": {"num_frames": "32"}}, {"video": {"num_frames": 2.5}}, {"video": {"num_frames": 0}},
    {"video": {"fps": [1]}}, {"video": {"fps": float("nan")}}, {"video": {"decoder": "x"}},
    {"video": "fast"}, {"video": {"num_frames": True}},
], ids=["str", "float-frames", "zero", "list", "nan", "unknown", "not-object", "bool"])
def test_bad_decode_options_are_refused(rig, options):
    with pytest.raises(MediaOptionError):
        rig.prompt(video(), media_io_kwargs=options)
    assert rig.stats()["options_refused"] == 1


def test_asking_for_every_frame_is_bounded(rig):
    rig.frontend.media = dataclasses.replace(rig.frontend.media, video=VideoLimits(max_sampled_frames=8))
    with pytest.raises(MediaError, match="--max-sampled-frames"):
        rig.prompt(video(), media_io_kwargs={"video": {"num_frames": -1}})


def test_local_video_files_follow_the_media_policy(rig, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(CLIP)
    rig.frontend.media = MediaPolicy(None)  # featcache serve's default: no local files
    with pytest.raises(MediaError, match="reads no local files"):
        rig.prompt(vt.video_item(str(path)))
    rig.frontend.media = MediaPolicy(str(tmp_path))
    ours = rig.prompt(vt.video_item(str(path)))
    assert_same(rig.prompt(vt.video_item(str(path)), plain=True), ours)


# -- a video as a data URL of frames (video/jpeg) -----------------------------------------------

def test_a_video_of_frames_is_lmdeploys_own_output_and_its_repeat_is_not_decoded(rig, monkeypatch):
    frames = vt.video_item(FRAMES)
    first = rig.prompt(frames, text="turn one")
    assert_same(rig.prompt(frames, plain=True, text="turn one"), first)
    assert all(not m[REF_KEY].hit for m in first["multimodal"])
    rig.seed(first)
    rig.given.clear()

    def no_decode(*args, **kwargs):
        raise AssertionError("a held video was decoded")

    monkeypatch.setattr("featcache.lmdeploy.request.video.resolve.decode", no_decode)
    again = rig.prompt(frames, text="turn two")
    monkeypatch.undo()
    assert_same(rig.prompt(frames, plain=True, text="turn two"), again)
    assert all(m[REF_KEY].hit for m in again["multimodal"]) and rig.given == []
    assert rig.stats()["video_hits"] == 1 and rig.stats()["video_decode_skipped"] == 1
    # the same frames at another rate: another video (lmdeploy's metadata, and the prompt, differ)
    other = rig.prompt(frames, text="turn two", media_io_kwargs={"video": {"fps": 4}})
    assert_same(rig.prompt(frames, plain=True, text="turn two", media_io_kwargs={"video": {"fps": 4}}),
                other)
    assert all(not m[REF_KEY].hit for m in other["multimodal"])


@pytest.mark.parametrize("limits, match", [
    (VideoLimits(max_video_bytes=len(FRAMES) // 2), "--max-video-bytes"),
    (VideoLimits(max_frame_pixels=96 * 64 - 1), "--max-video-frame-pixels"),
    (VideoLimits(max_sampled_frames=5), "--max-sampled-frames"),
    (VideoLimits(max_video_frames=5), "--max-video-frames"),
], ids=["bytes", "resolution", "sampled", "frames"])
def test_a_video_of_frames_past_a_limit_is_refused_before_decoding(rig, limits, match, monkeypatch):
    rig.frontend.media = dataclasses.replace(rig.frontend.media, video=limits)
    decoded = []
    monkeypatch.setattr("featcache.lmdeploy.request.video.resolve.decode", lambda *a, **k: decoded.append(1))
    with pytest.raises(MediaError, match=match):
        rig.prompt(vt.video_item(FRAMES))
    assert decoded == [] and rig.stats()["media_refused"] == 1


@pytest.mark.parametrize("url", [
    "data:video/jpeg;base64,AAAA," + FRAMES.split(",", 2)[1],
    "data:video/jpeg;base64,",
    "data:video/jpeg;utf8,abc",
    FRAMES.replace(",", ",\u00e9", 1),
    FRAMES + "," + vt.jpeg_frames(1, 64, 96).split(",", 1)[1],
], ids=["a-frame-no-image", "no-frames", "not-base64", "not-ascii", "frames-of-two-sizes"])
def test_a_video_of_frames_that_are_no_images_is_a_400(rig, url):
    with pytest.raises(ValueError):
        rig.prompt(vt.video_item(url))
    assert_same(rig.prompt(vt.video_item(FRAMES), plain=True), rig.prompt(vt.video_item(FRAMES)))


# -- the engine: the model is given a held video's features, computes a new one's ---------------

def test_a_step_serves_held_frames_and_computes_new_ones(rig, monkeypatch):
    cls = CLASSES[rig.arch]
    tiny.featcache_prepare(monkeypatch, cls, families.SPECS[rig.arch])
    stored = rig.seed(rig.prompt(video()))
    prompt = rig.prompt(video(OTHER), video(), text="compare")
    plain = rig.prompt(video(OTHER), video(), plain=True, text="compare")
    model = FAKES[rig.arch](rig.config)
    visual = vision_of(model)
    result = rig.processor.preprocess_input(prompt["input_ids"], prompt["multimodal"])
    context = step_context(prompt["input_ids"], [result.input_multimodals], rig.config)
    got = model.run(cls.prepare_inputs_for_generation(model, [None] * context._full, None, context))
    mask = torch.tensor(prompt["input_ids"]) == prompt["multimodal"][0]["video_token_id"]
    want = []
    for item, own in zip(prompt["multimodal"], plain["multimodal"], strict=True):
        ref = item[REF_KEY]
        want.append(stored[ref.key].chunk(n_levels(rig.arch), -1)[0] if ref.hit
                    else levels(own["pixel_values_videos"])[0])
    assert torch.equal(got["inputs_embeds"][0][mask].float(), torch.cat(want))
    misses = [own["pixel_values_videos"] for item, own in zip(prompt["multimodal"], plain["multimodal"],
                                                              strict=True) if not item[REF_KEY].hit]
    assert len(visual.calls) == 1 and torch.equal(visual.calls[0], torch.cat(misses).to(visual.calls[0]))


@pytest.mark.parametrize("form", ["mp4", "jpeg-frames"])
def test_several_processes_a_resent_video_travels_as_its_bytes(rig, monkeypatch, form):
    """lmdeploy's mp engine (tp > 1 too): the API process's frontend reads, keys and preprocesses a
    new video (its output lmdeploy's own) and tags each frame item with its pixels; sent again, the
    video is neither decoded nor preprocessed there: its items travel without pixels, their tags
    carrying the video's bytes. The model process serves them from its own cache; one that lost
    them rebuilds each item's pixels from the bytes (equal to lmdeploy's) and computes them."""
    import json
    import pickle

    from featcache.lmdeploy import counters_cache
    from featcache.lmdeploy.pytorch import ranks
    from featcache.lmdeploy.request.tags import FeatTag

    def video() -> dict:  # (the form this run sends)
        return vt.video_item(FRAMES) if form == "jpeg-frames" else vt.video_item(vt.data_url(CLIP))

    cls = CLASSES[rig.arch]
    tiny.featcache_prepare(monkeypatch, cls, families.SPECS[rig.arch])
    api_cache = counters_cache()
    api = tiny.PromptPath(rig.path)
    install_frontend(api.model, api_cache, f"test:{rig.arch}", api.processor, tags=True,
                     pack=True)
    ranks.configure(json.dumps({
        "feature_cache": {"device": "cpu", "device_bytes": 64 << 20, "host_bytes": 0},
        "rebuild": {"model_path": rig.path, "dtype": "float16", "device_type": "cpu",
                    "trust_remote_code": False}}))
    from featcache.lmdeploy.request.video import resolve as video_resolve

    decodes = []
    real_decode = video_resolve.decode
    monkeypatch.setattr(video_resolve, "decode", lambda *a, **k: decodes.append(1) or real_decode(*a, **k))
    try:
        model = FAKES[rig.arch](rig.config)
        model.get_input_processor = lambda: rig.processor.inner  # (the real model's method)
        visual = vision_of(model)
        plain = rig.prompt(video(), plain=True, text="what happens")
        want = torch.cat([levels(p["pixel_values_videos"])[0] for p in plain["multimodal"]])
        sizes: list[int] = []
        keys: list[bytes] = []
        for turn in range(3):
            if turn == 2:  # the model process lost them (evicted)
                for key in keys:
                    ranks.local_cache().discard(key)
            sent = api.prompt(tiny.messages(video(), text="what happens"))
            assert sent["input_ids"] == plain["input_ids"]
            assert all(isinstance(m[REF_KEY], FeatTag) for m in sent["multimodal"])
            blob = pickle.dumps(sent)  # (lmdeploy's RPC to the engine process)
            sizes.append(len(blob))
            sent = pickle.loads(blob)
            if turn == 0:
                assert_same(plain, {**sent, "multimodal": [
                    {k: v for k, v in m.items() if k != REF_KEY} for m in sent["multimodal"]]})
                keys = [m[REF_KEY].key for m in sent["multimodal"]]
            else:  # sent before: no pixels, the bytes in each tag
                assert all(m["pixel_values_videos"].shape[0] == 0 and m[REF_KEY].source is not None
                           for m in sent["multimodal"])
                assert [m[REF_KEY].key for m in sent["multimodal"]] == keys
            result = rig.processor.preprocess_input(sent["input_ids"], sent["multimodal"])
            context = step_context(sent["input_ids"], [result.input_multimodals], rig.config)
            inputs = cls.prepare_inputs_for_generation(model, [None] * context._full, None, context)
            mask = torch.tensor(sent["input_ids"]) == sent["multimodal"][0]["video_token_id"]
            assert torch.equal(model.run(inputs)["inputs_embeds"][0][mask].float(), want)
        assert decodes == [1]  # the API process decoded the video once
        assert sizes[1] < sizes[0] and len(visual.calls) == 2  # turn 1 served; turn 2 rebuilt
        rebuilt = torch.cat([p["pixel_values_videos"] for p in plain["multimodal"]])
        assert torch.equal(visual.calls[1], rebuilt.to(visual.calls[1]))
        stats = ranks.local_cache().stats()[SECTION]
        assert stats["pixels_rebuilt"] == len(keys) and stats["vision_skipped"] == len(keys)
    finally:
        ranks.reset_for_tests()
        api.close()
        api_cache.close()


def test_the_store_tools_say_what_a_video_entry_is(rig):
    from featcache.cli.render import meta_summary

    first = rig.prompt(video(), media_io_kwargs={"video": {"num_frames": 8}})
    shown = {meta_summary(m[REF_KEY].meta) for m in first["multimodal"]}
    assert len(shown) == 1
    (line,) = shown
    assert line.startswith(f"video item of {len(first['multimodal'])} (grid {len(first['multimodal'])}x")
    assert "8 of 12 frames at 4.0 fps; 96x64 px;" in line and '{"num_frames": 8}' in line
    start, end = first["multimodal"][0]["offset"]
    assert line.endswith(f"image_tokens={end - start}")


def test_a_container_that_lies_about_its_frame_count(rig):
    """Stating a million frames (it holds 12): refused before the decoder walks toward the last
    stated frame (plain lmdeploy grabs up to it, ~0.6 s a million here, and grows with the lie).
    Stating 2: featcache reads what lmdeploy reads of it (2 frames' worth), equal to lmdeploy."""
    with pytest.raises(MediaError, match="holds 1000000 frames.*--max-video-frames"):
        rig.prompt(vt.video_item(vt.data_url(vt.lying_avi(1_000_000), "video/x-msvideo")))
    fewer = vt.video_item(vt.data_url(vt.lying_avi(2), "video/x-msvideo"))
    assert_same(rig.prompt(fewer, plain=True), rig.prompt(fewer))


@pytest.mark.parametrize("how, raw, why", [
    ({"io": {}, "item": 0, "size": None}, CLIP, None),
    ({"io": {"num_frames": 4}, "item": 3, "size": {"shortest_edge": 1024, "longest_edge": 4096}}, CLIP, None),
    ({"io": {}, "item": -1, "size": None}, CLIP, "item index"),
    ({"io": {"num_frames": "x"}, "item": 0, "size": None}, CLIP, "cannot rebuild"),
    ({"io": {}, "item": 0, "size": {"shortest_edge": True}}, CLIP, "video size"),
    ({"io": {}, "item": 0}, CLIP, "not what the frontend sends"),
    ({"io": {}, "item": 0, "size": None}, b"<html>", "cannot rebuild"),
    ({"io": {"fps": 4}, "item": 1, "size": None, "form": "jpeg"}, FRAMES.encode(), None),
    ({"io": {}, "item": 0, "size": None, "form": "jpeg"}, b"data:video/jpeg;base64,AAAA", "cannot rebuild"),
    ({"io": {}, "item": 0, "size": None, "form": "jpeg"}, CLIP, "cannot rebuild"),
    ({"io": {}, "item": 0, "size": None, "form": "gif"}, CLIP, "not what the frontend sends"),
], ids=["plain", "options-and-size", "negative-item", "bad-options", "bad-size", "fields", "not-a-video",
        "frames", "frames-no-image", "frames-not-a-url", "unknown-form"])
def test_a_video_source_that_cannot_rebuild_is_found_without_decoding(how, raw, why):
    """What the engine asks of every item sent without pixels before scheduling its request
    (``engine.unservable``): a damaged video source fails its own request, never a step."""
    import json

    from featcache.lmdeploy.pytorch.rebuild import problem
    from featcache.lmdeploy.request.tags import Source

    got = problem(Source(raw, json.dumps({"video": how}), "{}"))
    assert (got is None) if why is None else (why in got), got


def test_an_image_beside_an_uncached_video_is_keyed_with_the_requests_size(rig):
    """Where videos are not cached (``videos`` off), the request's images still are, under the
    size the request asks: an image held at the processor's own size is not served for it."""
    image = tiny.image_item(tiny.noise_image(300, 200))
    rig.seed(rig.prompt(image))  # held at the processor's own size
    rig.frontend.videos = False
    small = {"image": {"min_pixels": tiny.QWEN3_MIN_PIXELS, "max_pixels": 32 * 32 * 8}}
    ours = rig.prompt(image, video(), mm_processor_kwargs=small)
    plain = rig.prompt(image, video(), plain=True, mm_processor_kwargs=small)
    assert ours["input_ids"] == plain["input_ids"]
    (mine,) = [m for m in ours["multimodal"] if not is_video(m)]
    assert not mine[REF_KEY].hit  # (its key holds the size: another entry)
    (theirs,) = [m for m in plain["multimodal"] if not is_video(m)]
    assert torch.equal(mine["pixel_values"], theirs["pixel_values"])
    assert rig.stats()["videos_uncached"] == 1
