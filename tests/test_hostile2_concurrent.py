"""Hostile clients, second round (issue 39 item 4): concurrent requests with one new image run the
vision model once, in every process model.

The engine side as lmdeploy 0.18 runs it (``test_lmdeploy_engine``'s rig: lmdeploy's real prompt
path with featcache's frontend, its real input processor wrapped in ``KeyedInputProcessor``, the
model class's real ``prepare_inputs_for_generation`` and ``forward`` with featcache's hooks, a fake
vision tower whose features are a function of each image's pixels):

- one process (``--engine-process in``): every concurrent request's frontend misses (nothing is
  cached until the engine ran the image), so the engine's steps get many misses of one key: in
  one step (a batch) and in the steps after the first computed it;
- a leader that fails (its step raises) leaves its followers to compute, right;
- two engines in one process sharing the cache (two threads): the second waits for the first's
  computation, bounded; a leader that never finishes is given up on, counted;
- several processes (``--engine-process mp``: ``tests/_ranks.py``'s model process): copies of
  one image in one step, sent with and without pixels, are computed (and rebuilt) once.

Every answer is compared with plain lmdeploy's: the token embeddings its language model gets.
"""

from __future__ import annotations

import threading

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import _ranks  # noqa: E402
import lmdeploy_tiny as tiny  # noqa: E402
import test_lmdeploy_engine as eng  # noqa: E402
from test_lmdeploy_engine import patched as patched  # noqa: E402,F401  (fixtures)
from test_lmdeploy_engine import rig as rig  # noqa: E402,F401
from test_lmdeploy_processes import data_url_request, png, sent_pixels  # noqa: E402
from test_lmdeploy_processes import path as path  # noqa: E402,F401
from test_lmdeploy_processes import side as side  # noqa: E402,F401
from test_lmdeploy_processes import sourced as sourced  # noqa: E402,F401

from featcache.lmdeploy.pytorch import models, ranks  # noqa: E402
from featcache.lmdeploy.request.frontend import SECTION  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.request.report import report_of  # noqa: E402

_ranks.stub_xgrammar()  # (lmdeploy's engine modules import it)

JOIN_S = 120  # how long a test waits for its threads before it fails (never reached when right)


def requests(rig, image, n: int) -> list[tuple[list[int], object, dict]]:
    """``n`` requests with ``image`` prepared at once, each on its own thread, as a server's
    concurrent clients are: (input ids, the engine's processed inputs, what lmdeploy's
    ``preprocess`` returned) each."""
    out: list = [None] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        prompt = rig.prompt(image)
        out[i] = (prompt["input_ids"], rig.processor.preprocess_input(prompt["input_ids"],
                                                                      prompt["multimodal"]),
                  prompt)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert all(o is not None for o in out), "a request was not prepared"
    return out


def step(cls, model, seqs) -> torch.Tensor:
    """One prefill step over ``seqs`` (lmdeploy batches concurrent prefills into one forward):
    the token embeddings the language model gets, [tokens, hidden]."""
    ids = [i for s in seqs for i in s[0]]
    ctx = eng.step_context(ids, [s[1].input_multimodals for s in seqs])
    inputs = cls.prepare_inputs_for_generation(model, None, context=ctx)
    return cls.forward(model, **inputs)[0].detach()


def plain_answer(rig, cls, image) -> torch.Tensor:
    """What plain lmdeploy's language model gets for one request with ``image``."""
    prompt = rig.prompt(image, plain=True)
    result = rig.inner.preprocess_input(prompt["input_ids"], prompt["multimodal"])
    ctx = eng.step_context(prompt["input_ids"], [result.input_multimodals])
    model = fake_model(rig)
    inputs = cls.prepare_inputs_for_generation.__wrapped__(model, None, None, ctx)
    return cls.forward(model, **inputs)[0].detach()


def fake_model(rig):
    """The rig's fake model, its token embeddings the same in every instance (two engines of one
    model, and plain lmdeploy's, embed the text alike)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return rig.fake_model()


def one_image_pixels(seq) -> torch.Tensor:
    (data,) = seq[1].input_multimodals["image"]
    return data.data


def hooked_vision(rig, model, before):
    """Run ``before()`` ahead of each call of ``model``'s (fake) vision tower."""
    if rig.arch in eng.INTERNVLS:
        inner = model.get_image_features

        def features(*args, **kwargs):
            before()
            return inner(*args, **kwargs)

        model.get_image_features = features
    else:
        inner_forward = model.visual.forward

        def forward(*args, **kwargs):
            before()
            return inner_forward(*args, **kwargs)

        model.visual.forward = forward


def counters(rig) -> dict[str, int]:
    return dict(rig.cache.stats().get(SECTION, {}))


# -- one process -----------------------------------------------------------------------------------

def test_in_process_concurrent_requests_of_one_new_image_run_vision_once(rig, patched):
    """16 concurrent requests with one new image (was: the vision model ran on it 16 times, 8 in
    the first step's one call and once for each later request): one vision call on one image's
    pixels; every answer what plain lmdeploy's is."""
    (image,) = eng.images(3)
    seqs = requests(rig, image, 16)
    assert not any(s[1].input_multimodals["image"][0].meta[REF_KEY].hit for s in seqs)
    model = fake_model(rig)
    want = plain_answer(rig, patched, image)

    answers = [step(patched, model, seqs[:8])]  # the first prefill batch
    answers += [step(patched, model, seqs[8:12]), step(patched, model, seqs[12:])]

    counts = counters(rig)
    assert counts.get("vision_images") == 1, counts
    assert counts.get("vision_skipped") == 15, counts
    # 7 shared the first step's one computation, 8 were served from the cache at their step
    assert (counts.get("vision_shared"), counts.get("vision_joined")) == (7, 8), counts
    calls = list(model.vision_inputs)
    assert len(calls) == 1 and torch.equal(calls[0], one_image_pixels(seqs[0]))
    got = torch.cat(answers).reshape(16, *want.shape)
    for i in range(16):
        assert torch.equal(got[i], want), f"request {i} answered other than plain lmdeploy"
    # what each response's usage says the vision model cost it: the first its call, the others 0
    computed = [report_of(s[2], "in").vision_computed_s for s in seqs]
    assert computed[0] > 0 and computed[1:] == [0.0] * 15, computed


def test_in_process_a_leader_step_that_fails_leaves_its_followers_to_compute(rig, patched):
    """The step that first runs the image fails (its vision call raises): the requests after it
    with the same image compute it themselves, once, and are answered right."""
    (image,) = eng.images(4)
    seqs = requests(rig, image, 4)
    model = fake_model(rig)
    failures = [RuntimeError("the vision tower failed")]

    def fail_once():
        if failures:
            raise failures.pop()

    hooked_vision(rig, model, fail_once)
    want = plain_answer(rig, patched, image)

    with pytest.raises(RuntimeError, match="vision tower failed"):
        step(patched, model, seqs[:1])
    model.vision_inputs.clear()
    answer = step(patched, model, seqs[1:])  # the followers, in one step

    counts = counters(rig)
    assert counts.get("vision_images") == 1, counts
    calls = list(model.vision_inputs)
    assert len(calls) == 1 and torch.equal(calls[0], one_image_pixels(seqs[1]))
    got = answer.reshape(3, *want.shape)
    for i in range(3):
        assert torch.equal(got[i], want)
    assert rig.cache.acquire(seqs[0][1].input_multimodals["image"][0].meta[REF_KEY].key) is not None


def test_in_process_a_step_that_never_reached_its_vision_call_holds_nobody(rig, patched,
                                                                         monkeypatch):
    """lmdeploy's forward may fail between ``prepare`` and the vision call: the image's next step,
    on the same engine thread or another, computes it at once (it never waits for a step that is
    over, nor for its own thread)."""
    monkeypatch.setattr(models, "FLIGHT_WAIT_S", 3600.0, raising=False)  # a wait would hang
    (image,) = eng.images(2)
    seqs = requests(rig, image, 3)
    model = fake_model(rig)
    want = plain_answer(rig, patched, image)
    answers: list[torch.Tensor] = []

    def engine_thread():
        ctx = eng.step_context(seqs[0][0], [seqs[0][1].input_multimodals])
        patched.prepare_inputs_for_generation(model, None, context=ctx)  # the forward then fails
        answers.append(step(patched, model, seqs[1:2]))

    worker = threading.Thread(target=engine_thread, daemon=True)
    worker.start()
    worker.join(JOIN_S)
    assert answers, "the engine thread's next step waited for its own abandoned one"
    assert torch.equal(answers[0], want)
    other = fake_model(rig)
    assert torch.equal(step(patched, other, seqs[2:]), want)  # (stored: served)
    counts = counters(rig)
    assert counts.get("vision_images") == 1 and not counts.get("vision_waits"), counts


# -- two engines in one process, one cache ---------------------------------------------------------

class Engines:
    """A leader engine whose vision call is held until released, and a follower engine stepping
    the same image on another thread (two pipelines of one model sharing a cache)."""

    def __init__(self, rig, cls, image, monkeypatch) -> None:
        self.rig, self.cls = rig, cls
        self.seqs = requests(rig, image, 3)
        self.leader_model, self.follower_model = fake_model(rig), fake_model(rig)
        self.in_vision, self.release = threading.Event(), threading.Event()
        self.progressed = threading.Event()  # the follower waits for the leader, or is done
        self.waited = False
        self.results: dict[str, object] = {}
        hooked_vision(rig, self.leader_model, self._hold)
        original = getattr(models, "_wait_for", None)
        if original is not None:
            def wait_for(*args, **kwargs):
                self.waited = True
                self.progressed.set()
                return original(*args, **kwargs)

            monkeypatch.setattr(models, "_wait_for", wait_for)

    def _hold(self) -> None:
        self.in_vision.set()
        self.release.wait(JOIN_S)

    def _run(self, name: str, model, seqs) -> None:
        try:
            self.results[name] = step(self.cls, model, seqs)
        except BaseException as e:  # noqa: BLE001  (the test reports it)
            self.results[name] = e
        finally:
            if name == "follower":
                self.progressed.set()

    def start(self, failing: bool = False) -> threading.Thread:
        if failing:
            def fail() -> None:
                self._hold()
                raise RuntimeError("the leader's vision tower failed")

            hooked_vision(self.rig, self.leader_model, fail)
        leader = threading.Thread(target=self._run, args=("leader", self.leader_model,
                                                          self.seqs[:1]), daemon=True)
        leader.start()
        self.leader = leader
        assert self.in_vision.wait(JOIN_S)
        follower = threading.Thread(target=self._run, args=("follower", self.follower_model,
                                                            self.seqs[1:2]), daemon=True)
        follower.start()
        assert self.progressed.wait(JOIN_S)
        return follower


def test_a_second_engine_waits_for_the_first_engines_computation(rig, patched, monkeypatch):
    (image,) = eng.images(1)
    engines = Engines(rig, patched, image, monkeypatch)
    want = plain_answer(rig, patched, image)
    follower = engines.start()
    engines.release.set()
    follower.join(JOIN_S)

    assert torch.equal(engines.results["follower"], want)
    assert engines.follower_model.vision_inputs == []  # served from the leader's computation
    counts = counters(rig)
    assert counts.get("vision_images") == 1 and counts.get("vision_waits") == 1, counts


def test_a_leader_that_fails_or_never_finishes_leaves_the_follower_to_compute(rig, patched,
                                                                             monkeypatch):
    """A leader that fails: the waiting follower computes the image itself; one that never
    answers (hung): the follower gives up after ``FLIGHT_WAIT_S`` and computes it; counted
    either way (``vision_wait_failed``), answered right."""
    (image,) = eng.images(2)
    want = plain_answer(rig, patched, image)
    engines = Engines(rig, patched, image, monkeypatch)
    follower = engines.start(failing=True)
    engines.release.set()
    follower.join(JOIN_S)
    assert engines.waited and torch.equal(engines.results["follower"], want)
    assert isinstance(engines.results.get("leader"), RuntimeError)

    (hung_image,) = eng.images(4)
    monkeypatch.setattr(models, "FLIGHT_WAIT_S", 0.05, raising=False)
    hung = Engines(rig, patched, hung_image, monkeypatch)
    follower = hung.start()  # (the leader is released only at the end)
    follower.join(JOIN_S)
    try:
        assert hung.waited and torch.equal(hung.results["follower"], plain_answer(rig, patched,
                                                                                  hung_image))
        assert hung.follower_model.vision_inputs, "the follower computed the image itself"
        counts = counters(rig)
        assert counts.get("vision_wait_failed") == 2 and counts.get("vision_waits") == 2, counts
    finally:
        hung.release.set()
        hung.leader.join(JOIN_S)  # (it stores the image too, late; before the cache closes)


# -- several processes: the model process ----------------------------------------------------------

def test_model_process_computes_one_image_repeated_in_a_step_once(sourced, side):
    """Copies of one image in one step (the first request sent with its pixels, the others
    without, as the tag-mode frontend sends an image again): one vision call on one image, no
    pixels rebuilt; after the process lost the features, copies all without pixels: one rebuild,
    one vision call. Every row what the pixels give."""
    prompts, _ = sourced
    raw = png(tiny.noise_image(120, 90, seed=7))
    first, blob1 = data_url_request(prompts, raw)
    blobs = [blob1] + [data_url_request(prompts, raw)[1] for _ in range(5)]
    pixels = sent_pixels(first["multimodal"][0])
    features = eng.per_image(tiny.INTERNVL, pixels)

    rows, calls = side.step(blobs)

    assert [c.shape[0] for c in calls] == [pixels.shape[0]]
    assert torch.equal(rows, features.repeat(6, 1))
    cache = ranks.local_cache()
    counts = dict(cache.stats()[SECTION])
    assert counts.get("vision_images") == 1 and not counts.get("pixels_rebuilt"), counts

    cache.discard(first["multimodal"][0][REF_KEY].key)
    rows, calls = side.step(blobs[1:4])
    assert [c.shape[0] for c in calls] == [pixels.shape[0]]
    assert torch.equal(rows, features.repeat(3, 1))
    counts = dict(cache.stats()[SECTION])
    assert counts.get("vision_images") == 2 and counts.get("pixels_rebuilt") == 1, counts


# -- the flights the model hook claims -------------------------------------------------------------

def test_a_forgotten_flight_ending_late_leaves_the_next_one_claimed():
    """``SingleFlight.lead``/``forget``/``finish``: after a waiter gave up on a hung flight, a new
    step claims the key; the hung one ending later wakes its own waiters and releases nothing of
    the new one's."""
    from featcache.core.singleflight import SingleFlight

    flights: SingleFlight[None] = SingleFlight()
    hung = flights.lead(b"k")
    assert hung is not None and flights.lead(b"k") is None and flights.running(b"k") is hung
    flights.forget(b"k", hung)
    fresh = flights.lead(b"k")
    assert fresh is not None and fresh is not hung
    flights.finish(b"k", hung)
    assert hung.done.is_set() and flights.running(b"k") is fresh
    flights.finish(b"k", fresh)
    assert flights.running(b"k") is None and flights.lead(b"k") is not None
