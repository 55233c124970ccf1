"""What the per-family lmdeploy tests share (tests/test_lmdeploy_kimi.py, _llama4, _glm4v_9b,
_cogvlm): lmdeploy's real prompt path for a family's tiny checkpoint, plain and with featcache's
frontend installed; the family's real input processor inside ``KeyedInputProcessor``; one prefill
step through its ``prepare`` (featcache's, or lmdeploy's own for plain) and a stand-in model; the
features a previous step would have stored; the prompt check; and the several-process (tag) mode's
API side with a model process's cache."""

from __future__ import annotations

import contextlib
import gc
import json
import types
from collections.abc import Callable, Iterator
from typing import Any

import lmdeploy_tiny as tiny
import torch
from transformers import AutoConfig

from featcache import FeatureCache
from featcache.lmdeploy import families
from featcache.lmdeploy.pytorch.engine import KeyedInputProcessor
from featcache.lmdeploy.request.frontend import install_frontend
from featcache.lmdeploy.request.refs import REF_KEY


class Recorder:
    """A language model that records what reaches it (the input embeddings and every other input)
    and hands back the embeddings; its own prepare is lmdeploy's minimal one."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        self.calls: list[dict[str, Any]] = []
        self.embed = torch.nn.Embedding(vocab, hidden).to(dtype)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def prepare_inputs_for_generation(self, past_key_values: Any = None, inputs_embeds: Any = None,
                                      context: Any = None) -> dict[str, Any]:
        return dict(input_ids=context.input_ids, position_ids=context.position_ids,
                    past_key_values=past_key_values, attn_metadata=None, inputs_embeds=inputs_embeds)

    def __call__(self, input_ids: Any = None, position_ids: Any = None, inputs_embeds: Any = None,
                 **kwargs: Any) -> Any:
        self.calls.append(dict(inputs_embeds=inputs_embeds, **kwargs))
        return inputs_embeds

    forward = __call__


class FakeEVA2CLIP(torch.nn.Module):
    """Stands in for GLM-4V's and CogVLM's ``EVA2CLIPModel``: [images, tokens, hidden] from each
    image's own pixels, its calls recorded (an nn.Module: featcache wraps its ``forward``, as it
    wraps the real one's)."""

    def __init__(self, tokens: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tokens, self.hidden, self.dtype = tokens, hidden, dtype
        self.calls: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls.append(images)
        flat = images.float().reshape(images.shape[0], -1)
        return flat[:, :self.tokens * self.hidden].reshape(-1, self.tokens, self.hidden).to(self.dtype)


def _transforms(needed: bool) -> Any:
    """torchvision's transforms while lmdeploy builds a frontend that needs them (GLM-4V, CogVLM)."""
    if not needed:
        return contextlib.nullcontext()
    from bench.lib import torchvision_ref

    return torchvision_ref.installed()


class FamilyRig:
    """``inner``: the family's lmdeploy input processor, made from the config; ``cls``: its
    lmdeploy model class (its ``prepare_inputs_for_generation`` patched by the test's fixture);
    ``transforms``: its frontend is built from torchvision's transforms."""

    def __init__(self, arch: str, path: str, cls: type, inner: Callable[[Any], Any],
                 transforms: bool = False) -> None:
        self.arch, self.path, self.cls, self.transforms = arch, path, cls, transforms
        self.spec = families.SPECS[arch]
        self.config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        self.cache = FeatureCache(device="cpu", device_bytes="64MiB", host_bytes=0)
        self.plain = self.path_of()
        self.frontend = self.path_of()
        install_frontend(self.frontend.model, self.cache, f"test:{arch}")
        self.frontend.record_featcache()
        self.inner = inner(self.config)
        self.processor = KeyedInputProcessor(self.inner, self.spec.items, self.spec.token_rows)

    def path_of(self) -> tiny.PromptPath:
        with _transforms(self.transforms):  # (lmdeploy builds its transforms once, here)
            return tiny.PromptPath(self.path, trust_remote_code=True)

    def close(self) -> None:
        self.plain.close()
        self.frontend.close()
        gc.collect()
        self.cache.close()

    def prompt(self, *images: Any, plain: bool = False, path: Any = None) -> dict[str, Any]:
        path = path or (self.plain if plain else self.frontend)
        return path.prompt(tiny.messages(*(tiny.image_item(i) for i in images), text="compare"))

    def step(self, model: Any, prompt: dict[str, Any], processor: Any = None, prepare: Any = None) -> Any:
        """One prefill step of ``prompt``: the input processor, ``prepare`` (default: the class's,
        featcache's where patched), the stand-in model's ``run``."""
        result = (processor or self.processor).preprocess_input(prompt["input_ids"], prompt["multimodal"])
        n = len(prompt["input_ids"])
        context = types.SimpleNamespace(
            input_ids=torch.tensor([prompt["input_ids"]]), position_ids=torch.arange(n)[None],
            attn_metadata=None, input_embeddings=None, input_embedding_indexing=None,
            is_decoding=False, vision_inputs=None, input_multimodals=[result.input_multimodals])
        return model.run((prepare or self.cls.prepare_inputs_for_generation)(model, None, None, context))

    def plain_step(self, model: Any, prompt: dict[str, Any]) -> Any:
        """The same step as plain lmdeploy runs it: its own input processor and prepare."""
        own = getattr(self.cls.prepare_inputs_for_generation, "__wrapped__",
                      self.cls.prepare_inputs_for_generation)
        return self.step(model, prompt, self.inner, own)


def seed(rig: FamilyRig, *images: Any, hidden: int, dtype: torch.dtype,
         rows: Callable[[dict[str, Any], list[int]], int] | None = None) -> dict[bytes, torch.Tensor]:
    """Store features for ``images`` as a previous step's model would have (``rows``: an image's
    feature rows; default its token count)."""
    stored = {}
    prompt = rig.prompt(*images)
    for item in prompt["multimodal"]:
        ref = item[REF_KEY]
        n = rows(item, prompt["input_ids"]) if rows else tiny.tokens(item)
        stored[ref.key] = torch.randn(n, hidden).to(dtype)
        rig.cache.put(ref.key, stored[ref.key], meta=ref.meta)
    return stored


def assert_prompt_is_lmdeploys(plain: dict[str, Any], ours: dict[str, Any], hits_have_pixels: bool) -> None:
    """featcache's prompt equals lmdeploy's: ids, every per-image field; a miss's pixels equal, a
    hit's lmdeploy's own (``hits_have_pixels``: its preprocessing ran) or a 0-row placeholder."""
    assert ours["input_ids"] == plain["input_ids"]
    assert len(ours["multimodal"]) == len(plain["multimodal"])
    for x, y in zip(plain["multimodal"], ours["multimodal"], strict=True):
        assert set(y) - {REF_KEY} == set(x)
        for name in x:
            a, b = x[name], y[name]
            if name in ("pixel_values", "pixel_values_videos"):  # (an image's; a video item's)
                ref = y.get(REF_KEY)
                if ref is not None and ref.hit and not hits_have_pixels:
                    assert b.shape[1:] == a.shape[1:] and b.shape[0] == 0 and b.dtype == a.dtype
                else:
                    assert torch.equal(a, b) and a.dtype == b.dtype
            elif isinstance(a, torch.Tensor):
                assert torch.equal(a, b), name
            else:
                assert a == b, name


@contextlib.contextmanager
def tag_mode(rig: Any) -> Iterator[Callable[..., dict[str, Any]]]:
    """Several processes (lmdeploy's mp engine, tp > 1): an API process's prompt path whose frontend
    tags every image, and a model process's cache (``ranks``). Yields ``send(*images)``: the API
    process's prompt (its ids plain lmdeploy's, every image tagged) as lmdeploy's RPC hands it to
    the engine (pickled and back). ``rig``: a ``FamilyRig``, or any rig with its ``arch``,
    ``path_of()`` (a new prompt path of its checkpoint) and ``prompt(*images, plain=, path=)``."""
    import pickle

    from featcache.lmdeploy import counters_cache
    from featcache.lmdeploy.pytorch import ranks
    from featcache.lmdeploy.request.tags import FeatTag

    api_cache = counters_cache()
    api = rig.path_of()
    install_frontend(api.model, api_cache, f"test:{rig.arch}", tags=True, pack=True)
    ranks.configure(json.dumps({"feature_cache": {"device": "cpu", "device_bytes": 64 << 20,
                                                   "host_bytes": 0},
                                # what the engine tells the model processes (processes.rank_settings)
                                "rebuild": {"model_path": api.model.model_path, "dtype": "float16",
                                            "device_type": "cpu", "trust_remote_code": False}}))

    def send(*images: Any) -> dict[str, Any]:
        sent = rig.prompt(*images, path=api)
        assert sent["input_ids"] == rig.prompt(*images, plain=True)["input_ids"]
        assert all(isinstance(m[REF_KEY], FeatTag) for m in sent["multimodal"])
        return pickle.loads(pickle.dumps(sent))

    try:
        yield send
    finally:
        ranks.reset_for_tests()
        api.close()
        api_cache.close()


def model_cache_stats() -> dict[str, int]:
    """The model process's counters (inside ``tag_mode``)."""
    from featcache.lmdeploy.pytorch import ranks
    from featcache.lmdeploy.request.frontend import SECTION

    return ranks.local_cache().stats()[SECTION]


def assert_hits_skip_preprocessing(rig: FamilyRig, images: tuple[Any, ...], held: Any,
                                   per_image: bool) -> None:
    """A request mixing ``held`` (seeded before) with new images: its prompt is lmdeploy's, its
    refs say which hit, and lmdeploy's preprocessing ran on the new images only (``per_image``:
    one call an image, as Llama 4's frontend; else one call a request)."""
    rig.frontend.calls.clear()
    ours = rig.prompt(*images)
    assert_prompt_is_lmdeploys(rig.prompt(*images, plain=True), ours, hits_have_pixels=False)
    assert [item[REF_KEY].hit for item in ours["multimodal"]] == [im is held for im in images]
    misses = [im.size for im in images if im is not held]
    want = [[m] for m in misses] if per_image else ([misses] if misses else [])
    assert rig.frontend.calls == want  # a hit is never preprocessed
