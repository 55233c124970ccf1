"""What the frontend does for lmdeploy's processor-level preprocessing API (``ProcessorLevel``,
made ``frontend.ProcessorFrontend`` over ``frontend.Frontend``), and its startup probe:
featcache's output for a request, made from entries' metadata and featcache's own pixels, is used
only where it is shown equal to lmdeploy's on this installation."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import torch

from ..families import reproduces_expansion
from ..fastprep import PatchMaker, processor_patch_maker, processor_patches
from .entry_meta import PIXEL_FIELDS, decode_item, processor_item_meta
from .media import image_size
from .messages import decoded, image_items, media_items
from .refs import REF_KEY
from .resolve import SECTION
from .video.entries import INFO, VIDEO_FIELD, KeyedVideo, VideoHit, entry_meta, item_key, lookup, sent_hit
from .video.expand import merged_kwargs, plan_videos, video_replacements

log = logging.getLogger("featcache")


class ProcessorLevel:
    """The frontend hook for lmdeploy's processor-level preprocessing API, over ``Frontend``'s
    keying, lookups and fallbacks (``frontend.ProcessorFrontend``: ``__call__`` is the vision
    model's new-API ``preprocess``).

    Qwen3-VL, Qwen3.5 and the other families lmdeploy 0.18 added lately preprocess a request with
    ``preprocess(messages, input_prompt, mm_processor_kwargs)`` (``VisionModel.preprocess`` in
    ``lmdeploy/vl/model/base.py``): one call of the checkpoint's HF processor tokenizes the rendered
    prompt, runs the image processor over every image and expands each image's placeholder to its
    token count; ``get_expanded_mm_items`` then splits the bundle into one dict per image
    (``modality, pixel_values, image_grid_thw, offset, image_token_id``). There is no per-image call
    to skip, so ``ProcessorFrontend`` makes that output itself when any image hits:

    - every image is keyed (as the legacy frontend keys it, ``Frontend._lookup``), with the request's
      image size override (``mm_processor_kwargs["image"]``'s ``min_pixels``/``max_pixels``, checked
      by ``media.image_size``: ints, or the request is refused) in its key where it changes the
      pixels;
    - a hit's expansion (its ``image_grid_thw``, so its token count) comes from its entry's metadata;
    - the misses' pixels are made by featcache's ``PatchMaker`` where it reproduces the image
      processor (``fastprep.processor_patch_maker``, probed; plain RGB images; ``preprocess_fast``;
      then a request with no hit takes this path too), else by the image processor with the
      arguments its own call would give it (``preprocess_fallback``), cast as lmdeploy casts them;
    - the placeholders are expanded with the processor's own ``replace_image_token`` over every
      image's grid, by its own ``get_text_with_replacements``, and tokenized by its tokenizer with
      its text arguments, each run of placeholder tokens once (``tokenized``); a prompt of token
      ids (lmdeploy's ``/generate``) is expanded by lmdeploy's own ``get_expanded_input_ids``;
      offsets by lmdeploy's ``get_mm_items_offset``.

    Invariant: the output equals lmdeploy's own for the same request (input ids, offsets, every
    per-image field; tests/test_lmdeploy_newapi.py checks it against lmdeploy's real preprocessing
    for requests mixing hits and misses). Where this is not shown (a processor outside
    ``families.EXPANDING``, a request with audio or time series, videos where ``probe_video``
    failed) lmdeploy's own preprocessing runs for the whole request and featcache only tags its
    images: hits then skip the vision model but not preprocessing (counted,
    ``preprocess_not_skipped``). Any failure falls back to lmdeploy's own preprocessing
    (``Frontend.__call__``: counted, never a failed request). With ``tags`` (several processes)
    every image and video item gets a ``FeatTag``; one this frontend sent the model processes
    before travels without pixels, its tag carrying its source (encoded bytes, or a pipeline
    image's pixel bytes; a video's bytes), so it is neither decoded nor preprocessed again here,
    and a model process that no longer holds it rebuilds its pixels (``video.rebuild``); the model
    processes skip the vision model for what they hold (``ranks``). With a size override, images
    travel with their pixels (a source rebuilds an image at the processor's own size).
    """

    # ``Frontend``'s, which this class is used over
    cache: Any
    original: Any
    namespace: str
    tags: bool

    def __init__(self, vision_model: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = vision_model
        processor = getattr(vision_model, "processor", None)
        self.expands = reproduces_expansion(processor, vision_model)
        # featcache's exact preprocessing of misses (``fastprep.processor_patch_maker``), or None
        self.maker: PatchMaker | None = None
        if self.expands:
            self.maker, why = processor_patch_maker(processor.image_processor)
            log.info("featcache: preprocessing of new images: %s",
                     f"featcache's, {why}" if self.maker is not None else f"lmdeploy's ({why})")
            differs = self.probe()
            if differs is not None:  # lmdeploy preprocesses every request; hits still skip the tower
                self.expands, self.maker = False, None
                self.cache.count(SECTION, "expansion_probe_failed")
                log.warning("featcache: lmdeploy preprocesses every image of this model (featcache's "
                            "output differed from lmdeploy's at startup: %s)", differs)
        if self.expands and _takes_videos(processor):
            differs = self.probe_video()
            self.videos = differs is None
            if differs is not None:
                self.cache.count(SECTION, "video_probe_failed")
                log.warning("featcache: videos are not cached for this model (featcache's output "
                            "differed from lmdeploy's at startup: %s)", differs)

    def probe(self) -> str | None:
        """Where featcache's output for a request differs from lmdeploy's on this installation
        (its transformers, its processor's files), or None: one request of two small images of
        different sizes between text, made by lmdeploy, then by featcache with both images
        missing (its own pixels, ``maker``, where it has one) and with both held (their grids
        from the metadata lmdeploy's output gives their entries). Any difference, or a failure of
        featcache's side, leaves the model to lmdeploy's preprocessing."""
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(0)
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
                  for w, h in ((67, 45), (40, 90))]
        token = self.model.processor.image_token
        prompt = f"probe {token} between {token} end"
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt},
                                                 *({"type": "image", "data": im} for im in images)]}]
        cache, self.cache = self.cache, _Uncounted()  # (no request's counters)
        try:
            want = type(self.model).preprocess(self.model, messages, prompt, None)  # lmdeploy's own
            items = image_items(messages) or []
            missed = self._expand(items, [None] * len(items), {}, prompt, None)
            held = {i: {**decode_item(processor_item_meta(m, self.namespace)), REF_KEY: None}
                    for i, m in enumerate(want["multimodal"])}
            hit = self._expand(items, [None] * len(items), held, prompt, None)
        except Exception as e:  # noqa: BLE001 (any failure: featcache's output is not used)
            return f"{type(e).__name__}: {e}"
        finally:
            self.cache = cache
        return _difference(want, missed, pixels=True) or _difference(want, hit, pixels=False)

    def probe_video(self) -> str | None:
        """``probe`` for videos: one request of a short random video between text, made by
        lmdeploy, then by featcache with the video missing (the video processor's pixels) and held
        (from the entries featcache would have stored for it); the difference, or None."""
        import numpy as np

        rng = np.random.default_rng(1)
        frames = rng.integers(0, 256, (4, 40, 70, 3), dtype=np.uint8)
        metadata = {"total_num_frames": 8, "fps": 4.0, "duration": 2.0, "video_backend": "opencv",
                    "frames_indices": [0, 2, 5, 7]}
        token = self.model.processor.video_token
        prompt = f"probe {token} end"
        item = {"type": "video", "data": frames, "video_metadata": metadata}
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}, item]}]
        cache, self.cache = self.cache, _Uncounted()
        sent, self.sent = getattr(self, "sent", None), None
        try:
            want = type(self.model).preprocess(self.model, messages, prompt, None)
            miss = KeyedVideo(b"probe", b"", {}, frames=frames, metadata=metadata)
            missed = self._expand([], [], {}, prompt, None, [miss], None)
            held = [decode_item(m[REF_KEY].meta) for m in missed["multimodal"]]
            info = json.loads(held[0].pop(INFO))
            for x in held[1:]:
                x.pop(INFO)
            hit = KeyedVideo(b"probe", b"", {}, hit=VideoHit([None] * len(held), held, info))
            got = self._expand([], [], {}, prompt, None, [hit], None)
        except Exception as e:  # noqa: BLE001 (any failure: videos are not cached)
            return f"{type(e).__name__}: {e}"
        finally:
            self.cache, self.sent = cache, sent
        return _difference(want, missed, pixels=True) or _difference(want, got, pixels=False)

    def _preprocess(self, messages: list[dict[str, Any]], input_prompt: Any = None,
                    mm_processor_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        split = media_items(messages)
        if split is None or not any(split):  # no media, or audio or time series among them
            return self.original(decoded(messages), input_prompt, mm_processor_kwargs)
        items, video_items = split
        processor = self.model.processor
        size = image_size(processor.image_processor, mm_processor_kwargs) if items else None
        videos = self._videos(video_items, mm_processor_kwargs)
        keys, hits = self._lookup(items, None if size is None else {"processor_size": size})
        if videos is None:  # videos this frontend does not cache: lmdeploy's, untouched
            self.cache.count(SECTION, "videos_uncached", len(video_items))
            return self._plain(messages, input_prompt, mm_processor_kwargs, keys, hits)
        if self.tags and size is not None:  # (a sent image's source rebuilds it at the processor's
            hits = {}  # own size only: with another, it travels with its pixels)
        if (isinstance(input_prompt, str) and self.expands
                and (videos or self.tags or hits or self.maker is not None)):
            # several processes: an image or video sent before travels as its tag and source
            return self._expand(items, keys, hits, input_prompt, size, videos or None,
                                _video_size(processor, mm_processor_kwargs) if videos else None)
        return self._plain(messages, input_prompt, mm_processor_kwargs, keys, hits)

    def _plain(self, messages: list[dict[str, Any]], input_prompt: Any, mm_processor_kwargs: Any,
               keys: list[bytes | None], hits: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """lmdeploy's own preprocessing of the whole request, its images tagged (``_tag``)."""
        if not self.tags:  # lmdeploy's image processor makes the misses' pixels
            self.cache.count(SECTION, "preprocess_fallback", len(keys) - len(hits))
        if hits and not self.tags:
            self.cache.count(SECTION, "preprocess_not_skipped", len(hits))
        out = self.original(decoded(messages), input_prompt, mm_processor_kwargs)
        self._tag(out, keys, hits)
        return out

    def _videos(self, items: list[dict[str, Any]], mm_processor_kwargs: Any) -> list[KeyedVideo] | None:
        """Each video's ``KeyedVideo`` (looked up again under its processor size, where the
        request asks one), or None where any is not featcache's to cache."""
        videos = [item.get(VIDEO_FIELD) for item in items]
        if not videos:
            return []
        if not self.videos or not all(isinstance(v, KeyedVideo) and v.key for v in videos):
            return None
        size = _video_size(self.model.processor, mm_processor_kwargs)
        if size is None:
            return videos
        out = []
        for video in videos:  # keyed with the size: another grid, another entry
            if video.hit is not None:
                video.hit.release()
            sized = KeyedVideo(self.hasher.image_key(bytes(video.key), namespace=self.namespace,
                                                     params={"video_size": size}),
                               video.raw, video.options, frames=video.frames, metadata=video.metadata,
                               params=video.params, form=video.form)
            sized.hit = (sent_hit(self, sized.key, video.raw, video.options, video.params, size, video.form)
                         if self.tags else lookup(self.cache, self.hasher, self.namespace, sized.key))
            out.append(sized)
        return out

    def _tag(self, out: dict[str, Any], keys: list[bytes | None],
             hits: dict[int, dict[str, Any]]) -> None:
        """lmdeploy's output for the whole request: each image's dict gets its ``FeatRef`` (a
        hit's, holding its lease; a miss's, for the model to store its features) or ``FeatTag``."""
        images = [m for m in out["multimodal"] if _is_image(m)]
        if len(images) != len(keys):
            raise RuntimeError(f"preprocess returned {len(images)} images for {len(keys)}")
        for index, (item, key) in enumerate(zip(images, keys, strict=True)):
            if key is None:
                continue
            hit = hits.get(index)
            if hit is not None and not self.tags:
                item[REF_KEY] = hit[REF_KEY]
                continue
            # (several processes: it goes with its pixels)
            item[REF_KEY] = self._miss_ref(key, processor_item_meta(item, self.namespace))

    def _expand(self, items: list[tuple[int, int, dict[str, Any]]], keys: list[bytes | None],
                hits: dict[int, dict[str, Any]], input_prompt: Any,
                size: dict[str, int] | None, videos: list[KeyedVideo] | None = None,
                video_size: dict[str, int] | None = None) -> dict[str, Any]:
        """The request's output, the processor run on its misses only (module docstring)."""
        from lmdeploy.vl.constants import Modality
        from lmdeploy.vl.model.preprocess_utils import get_expanded_input_ids, get_mm_items_offset

        model = self.model
        processor = model.processor
        merged = merged_kwargs(processor, size, video_size)
        missed = [i for i in range(len(items)) if i not in hits]
        grid_of = {i: hit["image_grid_thw"] for i, hit in hits.items()}
        pixels: list[torch.Tensor] = []
        if missed:
            images = [items[i][2]["data"] for i in missed]
            made = None if self.maker is None else processor_patches(self.maker, images, size)
            if made is None:
                self.cache.count(SECTION, "preprocess_fallback", len(missed))
                out = processor.image_processor(images, **merged["images_kwargs"])
                values, thw = out["pixel_values"], out["image_grid_thw"]
            else:
                self.cache.count(SECTION, "preprocess_fast", len(missed))
                values, thw = made
            bundle = model._postprocess_mm_output(values, model.mm_feature_dtype)
            rows = [int(g.prod()) for g in thw]
            if sum(rows) != bundle.shape[0]:
                raise RuntimeError(f"the image processor made {bundle.shape[0]} rows for grids of {rows}")
            pixels = [bundle] if len(missed) == 1 else [p.clone() for p in bundle.split(rows)]
            grid_of.update(zip(missed, thw, strict=True))
        every = (torch.stack([torch.as_tensor(grid_of[i]) for i in range(len(items))]) if items
                 else torch.zeros((0, 3), dtype=torch.long))
        plans = plan_videos(model, videos, merged["videos_kwargs"]) if videos else []
        token_id = model.mm_tokens.image_token_id
        if isinstance(input_prompt, str):
            replacements = [processor.replace_image_token({"image_grid_thw": every}, image_idx=i)
                            for i in range(len(items))]
            text, _ = processor.get_text_with_replacements([input_prompt], replacements,
                                                           video_replacements(processor, plans))
            text_kwargs = dict(merged["text_kwargs"])
            for name in ("return_mm_token_type_ids", "return_text_replacement_offsets"):
                text_kwargs.pop(name, None)
            input_ids = tokenized(processor, model.mm_tokens, text, text_kwargs)
        else:  # token ids (lmdeploy's /generate): each placeholder id expanded (images only)
            collected = {Modality.IMAGE: {"image_grid_thw": every}}
            input_ids = get_expanded_input_ids(input_prompt, collected, processor, model.mm_tokens)
        offsets = get_mm_items_offset(input_ids=input_ids, mm_token_id=token_id) if items else []
        if len(offsets) != len(items):
            raise RuntimeError(f"the prompt holds {len(offsets)} image spans for {len(items)} images")
        multimodal = []
        miss_pixels = dict(zip(missed, pixels, strict=True))
        for i, offset in enumerate(offsets):
            hit = hits.get(i)
            item = dict(modality=Modality.IMAGE,
                        pixel_values=hit["pixel_values"] if hit is not None else miss_pixels[i],
                        image_grid_thw=every[i], offset=offset, image_token_id=token_id)
            key = keys[i]
            if hit is not None:
                item[REF_KEY] = hit[REF_KEY]
            elif key is not None:
                item[REF_KEY] = self._miss_ref(key, processor_item_meta(item, self.namespace))
            multimodal.append(item)
        if plans:
            multimodal.extend(self._video_items(plans, input_ids))
            multimodal.sort(key=lambda x: x["offset"][0])
        return dict(input_ids=input_ids.tolist(), multimodal=multimodal)

    def _video_items(self, plans: list[Any], input_ids: torch.Tensor) -> list[dict[str, Any]]:
        """Every video's items in the output, each with its offset and its ref (a hit's lease, or
        a miss's key for the model to store it under)."""
        from lmdeploy.vl.constants import Modality
        from lmdeploy.vl.model.preprocess_utils import get_mm_items_offset

        offsets = iter(get_mm_items_offset(input_ids=input_ids,
                                           mm_token_id=self.model.mm_tokens.video_token_id))
        total = sum(len(p.items) for p in plans)
        out = []
        for plan in plans:
            for j, fields in enumerate(plan.items):
                offset = next(offsets, None)
                if offset is None:
                    raise RuntimeError(f"the prompt holds fewer video spans than the {total} video items")
                item = dict(modality=Modality.VIDEO, pixel_values_videos=fields["pixel_values_videos"],
                            video_grid_thw=fields["video_grid_thw"], offset=offset,
                            second_per_grid=fields["second_per_grid"],
                            video_token_id=fields["video_token_id"])
                if plan.refs:
                    item[REF_KEY] = plan.refs[j]
                elif plan.video is not None and plan.video.key:
                    key = item_key(self.hasher, self.namespace, plan.video.key, j)
                    item[REF_KEY] = self._miss_ref(key, entry_meta(item, self.namespace, plan.info))
                out.append(item)
        if next(offsets, None) is not None:
            raise RuntimeError(f"the prompt holds more video spans than the {total} video items")
        return out


def tokenized(processor: Any, tokens: Any, text: Any, text_kwargs: dict[str, Any]) -> torch.Tensor:
    """``processor.tokenizer(text, **text_kwargs)``'s ids, made without tokenizing thousands of
    placeholders one by one: each run of the image or video token (an added token, which the
    tokenizer splits the text at: every occurrence is one id, whatever stands beside it) is
    tokenized once and its id repeated as many times as the run held. The ids are the same
    (``probe`` compares them with lmdeploy's at startup); where the text arguments could make
    them depend on the length (truncation, a maximum length) or the tokenizer does not give one
    id per run, the whole text is tokenized as it stands."""
    named = ((getattr(processor, "image_token", None), getattr(tokens, "image_token_id", None)),
             (getattr(processor, "video_token", None), getattr(tokens, "video_token_id", None)))
    pads = {t: i for t, i in named if isinstance(t, str) and t and isinstance(i, int)}
    one_text = isinstance(text, list) and len(text) == 1 and isinstance(text[0], str)  # (the processor's)
    if (not pads or not one_text
            or any(text_kwargs.get(k) not in (None, False) for k in ("truncation", "max_length"))):
        return processor.tokenizer(text, **text_kwargs)["input_ids"].flatten()
    runs: list[tuple[int, int]] = []

    def one(match: Any) -> str:
        run = match.group(0)
        token = next(t for t in pads if run.startswith(t))
        runs.append((pads[token], len(run) // len(token)))
        return token

    short = [re.sub("|".join(f"(?:{re.escape(t)})+" for t in pads), one, text[0])]
    ids = processor.tokenizer(short, **text_kwargs)["input_ids"].flatten()
    at = torch.isin(ids, torch.tensor(list(pads.values()), dtype=ids.dtype)).nonzero().flatten()
    if len(at) != len(runs) or any(int(ids[i]) != pad for i, (pad, _) in zip(at, runs, strict=True)):
        return processor.tokenizer(text, **text_kwargs)["input_ids"].flatten()
    counts = torch.ones(len(ids), dtype=torch.long)
    counts[at] = torch.tensor([n for _, n in runs], dtype=torch.long)
    return ids.repeat_interleave(counts)


class _Uncounted:
    def count(self, *args: Any, **kwargs: Any) -> None:
        pass


def _difference(want: dict[str, Any], got: dict[str, Any], pixels: bool) -> str | None:
    """What differs between lmdeploy's output ``want`` and featcache's ``got`` (a hit's pixels, a
    0-row placeholder, compared by their trailing shape and dtype), or None."""
    held = "" if pixels else " (images held)"
    if list(want["input_ids"]) != list(got["input_ids"]):
        return f"input ids{held}"
    if len(want["multimodal"]) != len(got["multimodal"]):
        return f"image count{held}"
    for i, (x, y) in enumerate(zip(want["multimodal"], got["multimodal"], strict=True)):
        if set(x) != set(y) - {REF_KEY}:
            return f"image {i}'s fields{held}: {sorted(set(x) ^ (set(y) - {REF_KEY}))}"
        for name in x:
            a, b = x[name], y[name]
            if name in PIXEL_FIELDS:
                same = a.dtype == b.dtype and (torch.equal(a, b) if pixels else a.shape[1:] == b.shape[1:])
            elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                same = torch.equal(torch.as_tensor(a), torch.as_tensor(b))
            else:
                same = a == b or list(a) == list(b)
            if not same:
                return f"image {i}'s {name}{held}"
    return None


def _is_image(item: dict[str, Any]) -> bool:
    modality = item.get("modality")
    return getattr(modality, "value", modality) == "image"


def _takes_videos(processor: Any) -> bool:
    """Whether the processor expands videos as featcache does (a video processor and its own
    ``replace_video_token``: the Qwen3-VL lineage's)."""
    from transformers import ProcessorMixin

    own = getattr(type(processor), "replace_video_token", None)
    return (getattr(processor, "video_processor", None) is not None
            and own is not None and own is not getattr(ProcessorMixin, "replace_video_token", None))


def _video_size(processor: Any, mm_processor_kwargs: Any) -> dict[str, int] | None:
    """The video size a request asks of the video processor (``media.image_size`` over its
    ``mm_processor_kwargs["video"]``), or None."""
    if not isinstance(mm_processor_kwargs, dict) or not mm_processor_kwargs.get("video"):
        return None
    return image_size(processor.video_processor, {"image": mm_processor_kwargs["video"]})
