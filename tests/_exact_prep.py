"""What the exactness tests of featcache's preprocessing share (tests/test_preprocess_exact_qwen.py,
tests/test_preprocess_exact_internvl_hf.py): requests of images, featcache's ``FastPreprocess``
over a vision model, the comparison of every per-image output (``torch.equal`` tensors, the same
keys in the same order, the same types) with the check that the fast path ran (its counter), and
the fallback's."""

from __future__ import annotations

import image_corpus as corpus
import lmdeploy_tiny as tiny
import pytest
import torch

from featcache import FeatureCache
from featcache.lmdeploy import fastprep


def encoder(path, pil_name):
    """lmdeploy's encoder of the checkpoint at ``path``, over transformers' PIL processor named
    ``pil_name`` (where torchvision imports, transformers picks its torchvision-backed one)."""
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.vl.engine import ImageEncoder

    made = ImageEncoder(path, "pytorch", backend_config=PytorchEngineConfig(dtype="float16"))
    with_pil(made.model, path, pil_name)
    return made


def with_pil(vision_model, path, pil_name):
    """``vision_model`` over transformers' PIL processor ``pil_name`` of ``path``."""
    import transformers

    pil_class = getattr(transformers, pil_name)
    if type(vision_model.processor.image_processor) is not pil_class:
        vision_model.processor.image_processor = pil_class.from_pretrained(path)


def tiny_vision_model(spec, pil_name, tmp_path_factory):
    """A module fixture's body: the vision model of tests/lmdeploy_tiny.py's checkpoint ``spec``
    over the PIL processor ``pil_name``, its encoder shut down after the module."""
    made = encoder(tiny.checkpoint(spec, tmp_path_factory), pil_name)
    yield made.model
    made.executor.shutdown(wait=True)


def corpus_images():
    """tests/image_corpus.py's files, decoded as lmdeploy decodes a request's image."""
    from lmdeploy.vl.media.image import ImageMediaIO

    return {name: ImageMediaIO().load_bytes(make()) for name, make in corpus.CASES.items()}


def messages(*items):
    return [dict(role="user", content=[dict(type="text", text="describe"), *items])]


def item(image, **params):
    return dict(type="image", data=image, **params)


def fast_preprocess(vision_model, monkeypatch, mode="auto"):
    monkeypatch.setenv(fastprep.ENV, mode)
    cache = FeatureCache(device="cpu", device_bytes=0, host_bytes=0)
    fast = fastprep.FastPreprocess(vision_model, vision_model.preprocess, cache)
    return fast, cache


def outputs(messages):
    return messages[-1]["content"]


def assert_same(got, want, what):
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w), what
        assert list(g.keys()) == list(w.keys()), what
        for key, value in w.items():
            mine = g[key]
            assert type(mine) is type(value), (what, key)
            if isinstance(value, torch.Tensor):
                assert mine.dtype == value.dtype and mine.device == value.device, (what, key)
                assert mine.shape == value.shape, (what, key, mine.shape, value.shape)
                assert torch.equal(mine, value), (what, key)
            else:
                assert mine == value, (what, key)


def stat(cache, name):
    return cache.stats().get("lmdeploy", {}).get(name, 0)


def check(fast, cache, vision_model, items, what):
    before = stat(cache, "preprocess_fast")
    got = outputs(fast(messages(*items)))
    want = outputs(vision_model.preprocess(messages(*items)))
    assert_same(got, want, what)
    assert stat(cache, "preprocess_fast") == before + len(items), what
    return got


def noise(w, h, seed=0):
    return tiny.noise_image(w, h, seed)


def assert_fallback(fast, cache, vision_model, items, what):
    before = stat(cache, "preprocess_fallback")
    try:
        want = outputs(vision_model.preprocess(messages(*items)))
    except Exception as e:  # lmdeploy refuses it: so must featcache's stand-in, the same way
        with pytest.raises(type(e)):
            fast(messages(*items))
    else:
        assert_same(outputs(fast(messages(*items))), want, what)
    assert stat(cache, "preprocess_fallback") == before + len(items), what


def torchvision_functional():
    try:
        from torchvision.transforms.v2 import functional
    except Exception:  # (none here, or one that does not load beside this torch: the CPU's)
        return None
    return functional


NEEDS_TORCHVISION = pytest.mark.skipif(
    torchvision_functional() is None,
    reason="torchvision does not load here: on the GPU run list (docs/benchmarks.md, 'The GPU run list')")
