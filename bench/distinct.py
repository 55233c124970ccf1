"""A stream of new images (lmdeploy #2604's workload: 100 different documents, one
prompt each): plain lmdeploy against featcache in the same run, ratios per repetition.

    python3 -m bench distinct stages --model M [--size WxH] [--max-pixels N] [--min-pixels N]
        [--n 16] [--batch 32] [--reps 3] [--json F]
    python3 -m bench distinct pipeline --model M [--engine pytorch|turbomind] [--paths ...]
        [--n 16] [--batch 32] [--reps 3] [--no-disk] [--ceiling] [--json F]
    python3 -m bench distinct serve --model M [--engine pytorch|turbomind] [--clients 16]
        [--servers plain,featcache,featcache_in] [--n 16] [--batch 64] [--reps 3] [--bound]
        [--stages] [--json F]

Images: photo-like 1344x1008 JPEGs (``bench.lib.images.photo_jpeg``, ~0.4 MB, 12 tiles and a
thumbnail), a new seed for every request of every repetition, the same seeds for every engine,
decoded as lmdeploy decodes a request's image (``ImageMediaIO``) before the clock starts.

``stages`` (no engine: the CPU, or the GPU machine): lmdeploy's own ``preprocess`` of the model
against featcache's (``fastprep.FastPreprocess``), each image's ``pixel_values`` compared with
``torch.equal`` (and every other output: ``outputs_differ``); sequential (per image, ms) and a
batch of ``--batch`` requests at once through each side's executor (lmdeploy's one worker;
featcache's ``widen``), images/s. ``--size``: the photos' size; ``--max-pixels`` /
``--min-pixels``: each image's ``max_pixels`` / ``min_pixels`` (Qwen2-VL's per-image
parameters, which lmdeploy passes to its processor; transformers 5.17 honours either only with
the other).
``--model tiny-qwen2vl`` (or ``tiny-internvl-hf``): tests/lmdeploy_tiny.py's Qwen2-VL (InternVL-HF)
checkpoint, built in a temporary directory (transformers' own processors: the PIL ones where
torchvision does not import, as on this CPU); with ``--max-pixels 12845056`` its preprocessing is
Qwen2-VL-7B-Instruct's.

``pipeline`` (the GPU machine): the real engine, one new token per request (so the wall time is
the time to first token); sequential (``--n`` new images, one at a time) and a batch of
``--batch`` new images in one call; featcache with its bench cache (device, host and an LMDB disk
tier; the path ``fc_nodisk`` leaves the disk out); every sequential answer's tokens compared with
plain's. Each engine is built, run and closed alone (``--paths``: the TurboMind paths, ``plain``
first). ``--ceiling``: each featcache path also runs a second batch of new images whose
preprocessing was done before the clock (``_prepped``): what the engine and the vision model
allow a batch when preprocessing costs nothing, the bound on any preprocessing speedup.

``serve`` (the GPU machine, the server wheels carried): plain ``lmdeploy serve api_server``
against ``featcache serve`` in its default process model (``featcache``: the engine in lmdeploy's
engine process, as plain runs it; ``--engine-process`` picks another) and in the server's process
(``featcache_in``), each over a store in a temporary directory, the same engine flags, prefix
caching off, through the ``openai`` client with the images as JPEG data URLs. Every server of
``--servers`` is up at once (on the one GPU: each takes its KV share of what is free); each of
``--reps`` repetitions runs them one after another in a rotating order (no side always first),
each ``--n`` new images one at a time (time to first token; the answers, ``--answer-tokens``
tokens, compared with plain's), then ``--batch`` new images from ``--clients`` clients at once
(requests/s, time to first token p50 and max). Every repetition's ratios against plain's same
repetition are printed as it ends; the report keeps them and their spread (``vs_plain``; the
default mode against the in-process one: ``vs_featcache_in``). ``--bound``: each server's
requests/s as a fraction of the GPU's compute bound for these requests (bench/lib/bound.py: the
tower's and the prefill's FLOPs, image tokens from plain's prompt tokens less the text alone's,
at a bf16 matrix rate measured in the same run). ``--stages``: every server runs under
bench/serve_stages.py, which times every request's stages in the server's own process; the
report gets, per server, each phase's median per stage (``stages``: ``sequential``,
``concurrent``), so that where a loaded server's time goes is measured beside its rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.lib.images import CHAT_SIZE, photo_jpeg
from bench.lib.results import emit
from bench.lib.timing import rep_medians, spread

PROMPT = "Describe this document."


def decoded(seed: int, size: tuple[int, int] = CHAT_SIZE) -> tuple[Any, float]:
    """The new image of ``seed``, decoded as lmdeploy decodes a request's, and the decode's ms."""
    from lmdeploy.vl.media.image import ImageMediaIO

    raw = photo_jpeg(seed, size)
    t = time.perf_counter()
    image = ImageMediaIO().load_bytes(raw)
    return image, (time.perf_counter() - t) * 1e3


def _messages(image: Any, **params: Any) -> list[dict[str, Any]]:
    return [dict(role="user", content=[dict(type="text", text=PROMPT),
                                       dict(type="image", data=image, **params)])]


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether two per-image dicts hold the same keys in the same order and equal values."""
    import torch

    if list(got) != list(want):
        return False
    return all(torch.equal(a, b) if isinstance(b, torch.Tensor) else type(a) is type(b) and a == b
               for a, b in zip(got.values(), want.values(), strict=True))


TINY = {"tiny-qwen2vl": "QWEN2VL", "tiny-internvl-hf": "INTERNVL",  # tests/lmdeploy_tiny.py's
        "tiny-qwen3vl": "QWEN3VL", "tiny-qwen3_5": "QWEN3_5", "tiny-glm4v": "GLM4V"}


def _stages_model(name: str, root: str) -> str:
    """``name``'s checkpoint directory (``TINY``'s names: built under ``root``)."""
    if name not in TINY:
        return name
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))
    import lmdeploy_tiny as tiny

    tiny.register_processors()
    return tiny.build(root, getattr(tiny, TINY[name]))


def _ms(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, (time.perf_counter() - t) * 1e3


def _ratios(num: list[float], den: list[float]) -> list[float]:
    """Per repetition, ``num / den`` (a speedup: the baseline's time over ours, our rate over its)."""
    return [round(a / b, 2) for a, b in zip(num, den, strict=True)]


def _batch_ips(executor: Any, fn: Any, images: list[Any], **params: Any) -> float:
    """Images/s of ``len(images)`` requests preprocessed at once through ``executor``, as
    lmdeploy's ``ImageEncoder.preprocess`` runs them (``run_in_executor``)."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(executor, fn, _messages(im, **params))
                               for im in images))

    t = time.perf_counter()
    asyncio.run(run())
    return len(images) / (time.perf_counter() - t)


def _bare(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` without the images' own parameters (the processor-level API takes sizes per
    request: ``_NewApi.options``)."""
    return [dict(m, content=[{k: v for k, v in c.items() if k in ("type", "text", "data")}
                             for c in m["content"]]) for m in messages]


class _NewApi:
    """lmdeploy's processor-level ``preprocess`` of one image's request (``plain``), and
    featcache's (``__call__``: ``ProcessorFrontend``, every image a miss, the cache having no
    room), both over ``messages`` with the model's image placeholder as the prompt; ``why`` says
    how featcache makes the pixels."""

    def __init__(self, vm: Any, cache: Any, params: dict[str, int]) -> None:
        from featcache.lmdeploy import fastprep
        from featcache.lmdeploy.request.frontend import ProcessorFrontend

        self.prompt = "".join(str(getattr(vm, name, None) or "") for name in
                              ("vision_start_token", "image_token", "vision_end_token")) + PROMPT
        # a per-image min_pixels/max_pixels is the API's per-request size option here
        self.options = {"image": dict(params)} if params else None
        self.original = vm.preprocess
        self.frontend = ProcessorFrontend(vm, cache, self.original, "bench:stages")
        maker = self.frontend.maker
        self.why = (f"featcache's PatchMaker {fastprep._on_cpu(maker.spec)}" if maker is not None
                    else "lmdeploy's image processor (featcache does not reproduce it)")

    def plain(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        return self.original(_bare(messages), self.prompt, self.options)

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        from featcache.lmdeploy.request.refs import REF_KEY

        out = self.frontend(_bare(messages), self.prompt, self.options)
        for item in out["multimodal"]:
            ref = item.pop(REF_KEY, None)
            if ref is not None and ref.lease is not None:  # (a hit's: released, as the engine would)
                ref.lease.release()
        return out

    def hit(self, image: Any) -> tuple[dict[str, Any], float]:
        """The same image again, its features stored (as the model's put after its miss): the
        frontend's output and ms for it (keying the image, the expansion from its entry's metadata)."""
        import torch

        from featcache.lmdeploy.request.refs import REF_KEY

        again = self.frontend(_bare(_messages(image)), self.prompt, self.options)
        ref = again["multimodal"][0].pop(REF_KEY)
        start, end = again["multimodal"][0]["offset"]
        self.frontend.cache.put(ref.key, torch.zeros(end - start, 8), meta=ref.meta)
        out, ms = _ms(self, _messages(image.copy()))
        assert not out["multimodal"][0]["pixel_values"].shape[0]  # a hit: no pixels made
        return out, ms


def stages(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.vl.engine import ImageEncoder

    from bench.lib import torchvision_ref
    from featcache import FeatureCache
    from featcache.lmdeploy import fastprep

    dtype = "bfloat16" if torch.cuda.is_available() else "float16"
    root = tempfile.mkdtemp(prefix="featcache-stages-")
    model = _stages_model(args.model, root)
    # (lmdeploy builds InternVL's transforms from torchvision's; the tiny Qwen2-VL's processors
    # must not see it)
    aside = contextlib.nullcontext() if model != args.model else torchvision_ref.installed()
    with aside:
        encoder = ImageEncoder(model, "pytorch", backend_config=PytorchEngineConfig(dtype=dtype),
                               trust_remote_code=True)
    vm = encoder.model
    plain = vm.preprocess
    new_api = encoder._uses_new_preprocess
    # (the processor-level API: room for the hits series, whose features the bench puts itself)
    cache = FeatureCache(device="cpu", device_bytes="256MiB" if new_api else 0, host_bytes=0)
    if new_api:  # the processor-level API: featcache's frontend on misses, and on hits
        fast = _NewApi(vm, cache, {k: v for k, v in (("min_pixels", args.min_pixels),
                                                       ("max_pixels", args.max_pixels)) if v is not None})
        plain = fast.plain
    else:
        fast = fastprep.FastPreprocess(vm, plain, cache)
    wide = ThreadPoolExecutor(fastprep.THREADS)
    size = args.size
    params = {k: v for k, v in (("min_pixels", args.min_pixels), ("max_pixels", args.max_pixels))
              if v is not None}
    report: dict[str, Any] = dict(bench="distinct stages", model=args.model, where=fast.why,
                                  size=list(size), image_params=params,
                                  threads=fastprep.THREADS, torch_threads=torch.get_num_threads())
    raw: dict[str, list[Any]] = dict(decode=[], plain=[], featcache=[], plain_ips=[], featcache_ips=[],
                                     hit=[])
    differ = outputs_differ = 0
    for warm in range(2):  # coefficients, CUDA context, allocator
        fast(_messages(decoded(900 + warm, size)[0], **params))
    for rep in range(args.reps):
        base = 1_000 * (rep + 1)
        seq, seq_fc, dec, hits = [], [], [], []
        for i in range(args.n):
            image, d = decoded(base + i, size)
            want, t_plain = _ms(plain, _messages(image, **params))
            got, t_fc = _ms(fast, _messages(image, **params))
            if isinstance(want, dict):  # (the processor-level API: the request's ids and items)
                assert want["input_ids"] == got["input_ids"]
                hit, t_hit = fast.hit(image)
                outputs_differ += hit["input_ids"] != want["input_ids"]
                hits.append(t_hit)
                want, got = [dict(content=want["multimodal"])], [dict(content=got["multimodal"])]
            w, g = want[-1]["content"][0], got[-1]["content"][0]
            differ += not torch.equal(w["pixel_values"], g["pixel_values"])
            outputs_differ += not _same(g, w)
            del want, got, w, g
            dec.append(d)
            seq.append(t_plain)
            seq_fc.append(t_fc)
        batch = [decoded(base + 500 + i, size)[0] for i in range(args.batch)]
        raw["plain_ips"].append(round(_batch_ips(encoder.executor, plain, batch, **params), 2))
        raw["featcache_ips"].append(round(_batch_ips(wide, fast, batch, **params), 2))
        raw["decode"].append(dec)
        raw["plain"].append(seq)
        raw["featcache"].append(seq_fc)
        raw["hit"].append(hits)
        print(f"[distinct] rep {rep}: preprocess {statistics.median(seq):.1f} -> "
              f"{statistics.median(seq_fc):.1f} ms" + (f" (a hit: {statistics.median(hits):.2f} ms)"
                                                       if hits else "") +
              f"; batch {raw['plain_ips'][-1]} -> {raw['featcache_ips'][-1]} images/s", flush=True)
    per_rep = rep_medians(raw["plain"]), rep_medians(raw["featcache"])
    report.update(
        decode_ms=spread([x for r in raw["decode"] for x in r]),
        sequential=dict(plain=spread([x for r in raw["plain"] for x in r]),
                        featcache=spread([x for r in raw["featcache"] for x in r]),
                        speedup_per_rep=_ratios(*per_rep)),
        batch=dict(size=args.batch, plain_images_per_s=raw["plain_ips"],
                   featcache_images_per_s=raw["featcache_ips"],
                   speedup_per_rep=_ratios(raw["featcache_ips"], raw["plain_ips"])),
        pixel_values_differ=differ, outputs_differ=outputs_differ, compared=args.n * args.reps,
        **(dict(hit=dict(featcache=spread([x for r in raw["hit"] for x in r]),
                         speedup_per_rep=_ratios(per_rep[0], rep_medians(raw["hit"]))))
           if any(raw["hit"]) else {}),
        counters=cache.stats().get("lmdeploy", {}))
    wide.shutdown()
    encoder.executor.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    return report


def _engine(path: str, args: argparse.Namespace, store: str) -> Any:
    """The engine of ``path``: ``plain``; on the PyTorch engine ``fc`` (the bench cache, with its
    LMDB disk tier at ``store``) or ``fc_nodisk`` (the same without the disk); on TurboMind a
    ``turbomind=`` path over a host cache (and the disk, unless ``--no-disk``)."""
    from bench.lib import engines

    if args.engine == "pytorch":
        if path not in ("plain", "fc", "fc_nodisk"):
            raise SystemExit(f"--paths for the PyTorch engine: plain, fc, fc_nodisk (not {path!r})")
        cache = None
        if path == "fc":
            cache = engines.bench_cache("cuda", store)
        elif path == "fc_nodisk":
            from featcache import FeatureCache

            cache = FeatureCache(device="cuda", device_bytes="2GiB", host_bytes="4GiB")
        return engines.build("plain" if path == "plain" else "fc", args.model, prefix=False,
                             cache=cache, eager=args.eager, kv_fraction=args.kv_fraction)
    config = engines.turbomind_config(prefix=False, kv_fraction=args.kv_fraction)
    disk = None if args.no_disk else store
    cache = None if path == "plain" else engines.host_cache(4 << 30, disk, 8 << 30)
    return engines.build_turbomind(path, args.model, config, cache)


class _Prepped:
    """A featcache pipeline's preprocessing with some images' done before the clock (``--ceiling``):
    ``prepare(images)`` runs featcache's own preprocessing of each now; a request for one of
    them is then answered from that memo (keyed by the image object), any other as usual."""

    def __init__(self, pipe: Any) -> None:
        self.frontend = pipe.async_engine.vl_encoder.model.preprocess.frontend
        self.inner = self.frontend.original  # featcache's FastPreprocess
        self.memo: dict[int, dict[str, Any]] = {}
        self.served = 0  # requests answered from the memo (the report's check that it was used)
        self.frontend.original = self

    def prepare(self, images: list[Any]) -> None:
        self.memo = {id(im): self.inner(_messages(im))[-1] for im in images}

    def __call__(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from lmdeploy.vl.model.base import VisionModel

        items = VisionModel.collect_multimodal_items(messages)
        if len(items) == 1 and id(items[0][1]) in self.memo:
            self.served += 1
            return [*messages, self.memo[id(items[0][1])]]
        return self.inner(messages)


def pipeline(args: argparse.Namespace) -> dict[str, Any]:
    from bench.lib import engines

    gen = engines.greedy(1)
    paths = args.paths.split(",")
    report: dict[str, Any] = dict(bench="distinct pipeline", model=args.model, engine=args.engine,
                                  paths=paths, n=args.n, batch=args.batch)
    results: dict[str, Any] = {}
    tokens: dict[str, list[Any]] = {}
    for path in paths:
        # an engine that hangs leaves every thread's stack in the log and the run, not the call
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
        with tempfile.TemporaryDirectory() as store:
            t = time.time()
            pipe = _engine(path, args, store)
            built = round(time.time() - t, 1)
            print(f"[distinct] {path}: built in {built} s", flush=True)
            for w in range(3):  # the engine's first calls, and featcache's coefficients
                pipe((PROMPT, decoded(800 + w)[0]), gen_config=gen)
            seq: list[list[float]] = []
            ips: list[float] = []
            bound: list[float] = []
            prepped = _Prepped(pipe) if args.ceiling and path != "plain" else None
            toks: list[Any] = []
            for rep in range(args.reps):
                base = 1_000 * (rep + 1)
                images = [decoded(base + i)[0] for i in range(args.n)]
                walls = []
                for image in images:
                    out, ms = _ms(pipe, (PROMPT, image), gen_config=gen)
                    walls.append(ms)
                    toks.append(list(out.token_ids))
                batch = [(PROMPT, decoded(base + 500 + i)[0]) for i in range(args.batch)]
                _, ms = _ms(pipe, batch, gen_config=gen)
                seq.append(walls)
                ips.append(round(args.batch / ms * 1e3, 2))
                if prepped is not None:
                    more = [decoded(base + 700 + i)[0] for i in range(args.batch)]
                    prepped.prepare(more)
                    _, ms = _ms(pipe, [(PROMPT, im) for im in more], gen_config=gen)
                    bound.append(round(args.batch / ms * 1e3, 2))
                print(f"[distinct] {path} rep {rep}: sequential {statistics.median(walls):.1f} ms, "
                      f"batch {ips[-1]} images/s"
                      + (f" (preprocessed before: {bound[-1]})" if bound else ""), flush=True)
            fc = getattr(pipe, "featcache", None)
            results[path] = dict(build_s=built, sequential=spread([x for r in seq for x in r]),
                                 per_rep_median_ms=rep_medians(seq), batch_images_per_s=ips,
                                 batch_preprocessed_before_images_per_s=bound or None,
                                 preprocessed_before_served=prepped.served if prepped else None,
                                 counters=fc.stats().get("lmdeploy", {}) if fc is not None else None)
            tokens[path] = toks
            if args.json:  # what ran so far survives a later engine's hang or the call's end
                from bench.lib.results import write_report

                write_report(args.json, dict(report, results=results, partial=True))
            engines.close_pipeline(pipe)
            del pipe
            engines.free_gpu()
        faulthandler.cancel_dump_traceback_later()
    base_path = paths[0]
    for path in paths[1:]:
        mine, ref = results[path], results[base_path]
        mine["vs_" + base_path] = dict(
            sequential_speedup_per_rep=_ratios(ref["per_rep_median_ms"], mine["per_rep_median_ms"]),
            batch_speedup_per_rep=_ratios(mine["batch_images_per_s"], ref["batch_images_per_s"]),
            token_identical=sum(a == b for a, b in zip(tokens[path], tokens[base_path], strict=True)),
            compared=len(tokens[path]))
    report["results"] = results
    return report


def _url(seed: int) -> str:
    from bench.lib.images import data_url

    return data_url(photo_jpeg(seed), "jpeg")


def _ask(c: Any, model: str, url: str | None, max_tokens: int = 1) -> dict[str, Any]:
    """``PROMPT`` with the image at ``url`` (None: the text alone), streamed."""
    from bench.lib.client import stream_turn

    content = [dict(type="text", text=PROMPT)]
    if url is not None:
        content.append(dict(type="image_url", image_url=dict(url=url)))
    return stream_turn(c, model, [dict(role="user", content=content)], max_tokens=max_tokens)


def _concurrent(base: str, model: str, urls: list[str], clients: int) -> tuple[float, list[float]]:
    """``urls`` sent by ``clients`` clients at once (each its own connection, a share of the
    urls in turn): requests/s over the whole, and each request's time to first token (ms)."""
    from bench.lib.client import connect

    shares = [urls[i::clients] for i in range(clients)]

    def one(share: list[str]) -> list[float]:
        c = connect(base)
        return [_ask(c, model, u)["ttft_ms"] for u in share]

    t = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        ttfts = [x for part in ex.map(one, shares) for x in part]
    return len(urls) / (time.perf_counter() - t), ttfts


def _records(path: str | None, start: int, count: int, wait_s: float = 5.0) -> list[dict[str, Any]]:
    """serve_stages' records ``start:start + count`` of ``path`` (a request's is written as it
    ends, a moment after its client has the answer: waited for up to ``wait_s``); [] without."""
    from bench.lib.stages import read

    if path is None:
        return []
    deadline = time.monotonic() + wait_s
    rows = read(path) if os.path.exists(path) else []
    while len(rows) < start + count and time.monotonic() < deadline:
        time.sleep(0.1)
        rows = read(path) if os.path.exists(path) else []
    return rows[start:start + count]


SERVE_PORTS = {"plain": 23400, "featcache": 23401, "featcache_in": 23404}  # (distinct serve's own)


def _server_command(name: str, args: argparse.Namespace, flags: list[str], store: str) -> list[str]:
    from bench.lib import servers

    port = SERVE_PORTS[name]
    if name == "plain":
        return servers.lmdeploy_command(args.model, port, flags)
    mode = "in" if name == "featcache_in" else args.engine_process
    return servers.featcache_command(args.model, store, port, flags,
                                     None if args.engine == "turbomind" else mode)


def _side(name: str, base: str, model: str, args: argparse.Namespace, rep: int,
          profile: tuple[int, str] | None = None) -> dict[str, Any]:
    """One server's share of a repetition: ``--n`` new images one at a time (time to first token;
    the answers' tokens, ``--answer-tokens`` of them, kept for the identity check), then
    ``--batch`` new images from ``--clients`` clients at once (one token each). ``profile``
    (the server's pid, a path prefix): each phase under py-spy (bench/pyspy.py), its summary
    under ``profile`` in the result, its samples in PREFIX-sequential.txt / -concurrent.txt."""
    from bench import pyspy
    from bench.lib import client

    def recording(phase: str) -> Any:
        return None if profile is None else pyspy.Profile(profile[0], 3600, f"{profile[1]}-{phase}.txt")

    c = client.connect(base)
    base_seed = 1_000 * (rep + 1)
    profiles: dict[str, Any] = {}
    profiler = recording("sequential")
    turns = [_ask(c, model, _url(base_seed + i), args.answer_tokens) for i in range(args.n)]
    if profiler is not None:
        profiles["sequential"] = profiler.stop()
    many = [_url(base_seed + 500 + i) for i in range(args.batch)]
    profiler = recording("concurrent")
    rps, ttfts = _concurrent(base, model, many, args.clients)
    if profiler is not None:
        profiles["concurrent"] = profiler.stop()
    out = dict(sequential_ms=[t["ttft_ms"] for t in turns], tokens=[t["output_ids"] for t in turns],
               prompt_tokens=[t["prompt_tokens"] for t in turns], requests_per_s=round(rps, 2),
               ttft_p50_ms=round(statistics.median(ttfts), 1), ttft_max_ms=round(max(ttfts), 1))
    return {**out, "profile": profiles} if profile is not None else out


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """Every server of ``--servers`` up at once (each its own port and store), then ``--reps``
    repetitions, each running the servers one after another in an order that rotates from one
    repetition to the next (rep 0: a b c, rep 1: b c a, ...): no server always runs first or last
    on a warmer or busier machine. Each repetition's ratios against plain's same repetition are
    printed as they come; the report gives them all and their spread. ``--bound``: the new-image
    requests' compute bound (bench/lib/bound.py, a matrix rate measured before the servers start)
    and each server's requests/s as a fraction of it."""
    from bench.lib import bound, client, servers
    from bench.lib.models import remote_code
    from bench.lib.stages import medians, summarize

    names = args.servers.split(",")
    if args.profile and not set(args.profile.split(",")) <= set(names):
        raise SystemExit(f"--profile: servers of --servers ({args.servers}), not {args.profile}")
    unknown = [n for n in names if n not in SERVE_PORTS]
    if unknown or names[0] != "plain" or len(set(names)) != len(names):
        raise SystemExit(f"--servers: plain first, then any of featcache, featcache_in; not {args.servers}")
    rate = bound.matrix_rate() if args.bound else None  # (before the servers hold the GPU)
    extra = ["--trust-remote-code"] if remote_code(args.model) else []
    flags = servers.server_flags(args.engine, args.eager, extra, prefix=False)
    os.makedirs(args.logs, exist_ok=True)
    report: dict[str, Any] = dict(bench="distinct serve", model=args.model, engine=args.engine,
                                  n=args.n, batch=args.batch, clients=args.clients, flags=flags,
                                  servers=names, order="rotating")
    results: dict[str, dict[str, Any]] = {name: {} for name in names}
    reps: list[dict[str, dict[str, Any]]] = []
    text_tokens = None  # the prompt's tokens without its image (plain's count): image tokens by difference
    stage_files = {name: os.path.join(args.logs, f"distinct-stages-{name}.jsonl") if args.stages else None
                   for name in names}
    try:
        with contextlib.ExitStack() as stack:
            bases: dict[str, str] = {}
            for name in names:
                store = stack.enter_context(tempfile.TemporaryDirectory())
                cmd = _server_command(name, args, flags, store)
                if stage_files[name] is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(stage_files[name])
                    cmd = servers.under_stages(cmd, stage_files[name])
                log = f"{args.logs}/distinct-serve-{name}.log"
                bases[name] = stack.enter_context(servers.running(
                    name, cmd, SERVE_PORTS[name], log, args.ready_timeout, results[name]))
            model = client.served_model(client.connect(bases["plain"]))
            text_tokens = _ask(client.connect(bases["plain"]), model, None)["prompt_tokens"]
            for name in names:  # each server's first requests, untimed
                c = client.connect(bases[name])
                for w in range(3):
                    _ask(c, model, _url(800 + w))
            profiled = set(args.profile.split(",")) if args.profile else set()
            for rep in range(args.reps):
                order = names[rep % len(names):] + names[:rep % len(names)]
                row = {name: _side(name, bases[name], model, args, rep, profile=(
                    results[name]["pid"], os.path.join(args.logs, f"pyspy-{name}"))
                    if rep == 0 and name in profiled else None) for name in order}
                for name in order:
                    if "profile" in row[name]:
                        results[name]["profile"] = row[name].pop("profile")
                reps.append(row)
                print(f"[distinct] serve rep {rep} (order {' '.join(order)}): "
                      + "; ".join(_rep_line(name, row) for name in names), flush=True)
            for name in names:
                if name != "plain":
                    results[name]["counters"] = client.short(client.counters(bases[name]))
    except Exception as e:  # noqa: BLE001 - what ran is kept; the servers' logs say more
        report["error"] = f"{type(e).__name__}: {e}"
        print(f"[distinct] serve ERROR {report['error']}", flush=True)
    for name in names:
        mine = [r[name] for r in reps]
        if not mine:
            continue
        results[name].update(
            sequential=spread([x for r in mine for x in r["sequential_ms"]]),
            per_rep_median_ms=rep_medians([r["sequential_ms"] for r in mine]),
            requests_per_s=[r["requests_per_s"] for r in mine],
            concurrent_ttft_p50_ms=[r["ttft_p50_ms"] for r in mine],
            concurrent_ttft_max_ms=[r["ttft_max_ms"] for r in mine])
        if stage_files[name] is not None:  # (its records in the order its phases ran)
            rows = _records(stage_files[name], 0, 10 ** 9, wait_s=0)
            first = 4 if name == "plain" else 3  # the untimed requests (plain: the text-only one too)
            phases: dict[str, list[dict[str, Any]]] = dict(sequential=[], concurrent=[])
            for i in range(len(mine)):
                at = first + i * (args.n + args.batch)
                phases["sequential"] += rows[at:at + args.n]
                phases["concurrent"] += rows[at + args.n:at + args.n + args.batch]
            results[name]["stages"] = {
                phase: dict(records=len(rs), medians=medians([summarize(r) for r in rs]))
                for phase, rs in phases.items()}
        if name != "plain":
            results[name]["vs_plain"] = _versus(mine, [r["plain"] for r in reps])
    if "featcache" in results and "featcache_in" in results and reps:
        results["featcache"]["vs_featcache_in"] = _versus([r["featcache"] for r in reps],
                                                          [r["featcache_in"] for r in reps])
    if args.bound and reps and text_tokens is not None:
        prompt = round(statistics.median(t for r in reps for t in r["plain"]["prompt_tokens"] if t))
        report["bound"] = bound.bound_report(
            args.model, rate, prompt - text_tokens, prompt,
            {n: statistics.median(results[n]["requests_per_s"]) for n in names
             if results[n].get("requests_per_s")})
        print(f"[distinct] bound: {json.dumps(report['bound'])}", flush=True)
    report["results"] = results
    return report


def _rep_line(name: str, row: dict[str, dict[str, Any]]) -> str:
    """One server's figures in a repetition, and its ratios against plain's in the same one."""
    mine, plain = row[name], row["plain"]
    seq = statistics.median(mine["sequential_ms"])
    line = f"{name} {mine['requests_per_s']} req/s, sequential {seq:.1f} ms"
    if name == "plain":
        return line
    return (line + f" ({mine['requests_per_s'] / plain['requests_per_s']:.2f}x req/s, "
            f"{statistics.median(plain['sequential_ms']) / seq:.2f}x sequential)")


def _versus(mine: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """Per repetition, ``mine`` against ``ref`` (the same repetition): requests/s and sequential
    time-to-first-token ratios (> 1: ``mine`` faster), their spread, and the identity of the
    sequential answers' tokens."""
    rps = [round(a["requests_per_s"] / b["requests_per_s"], 3) for a, b in zip(mine, ref, strict=True)]
    seq = [round(statistics.median(b["sequential_ms"]) / statistics.median(a["sequential_ms"]), 3)
           for a, b in zip(mine, ref, strict=True)]
    ours = [t for r in mine for t in r["tokens"]]
    theirs = [t for r in ref for t in r["tokens"]]
    return dict(requests_per_s_per_rep=rps, sequential_speedup_per_rep=seq,
                requests_per_s_spread=[min(rps), max(rps)], sequential_spread=[min(seq), max(seq)],
                token_identical=sum(a == b for a, b in zip(ours, theirs, strict=True)), compared=len(theirs))


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    try:
        size = int(w), int(h)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is WxH, such as 1344x1008, not {text!r}") from None
    if min(size) < 1:
        raise argparse.ArgumentTypeError(f"a size's sides are at least 1, not {text!r}")
    return size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench distinct", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("stages", "pipeline", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True, help="checkpoint directory (bench/lib/models.py)")
        p.add_argument("--n", type=int, default=16, help="new images one at a time, per repetition")
        p.add_argument("--batch", type=int, default=64, help="new images at once, per repetition")
        p.add_argument("--reps", type=int, default=3)
        p.add_argument("--json", help="write the report here too")
        if name == "stages":
            p.add_argument("--size", type=_size, default=CHAT_SIZE, help="WxH of the photos")
            p.add_argument("--max-pixels", type=int, default=None,
                           help="each image's max_pixels (Qwen2-VL's per-image parameter)")
            p.add_argument("--min-pixels", type=int, default=None,
                           help="each image's min_pixels (transformers 5.17 honours a call's "
                                "max_pixels only with it)")
        if name in ("pipeline", "serve"):
            p.add_argument("--engine", choices=("pytorch", "turbomind"), default="pytorch")
            p.add_argument("--eager", action="store_true",
                           help="no CUDA graphs (2026-12-02: with --eager and --kv-fraction 0.3 "
                                "plain lmdeploy took 13.9 s per sequential request at the 2B)")
        if name == "serve":
            p.add_argument("--clients", type=int, default=16, help="clients at once for --batch")
            p.add_argument("--logs", default=tempfile.gettempdir(), help="the servers' logs go here")
            p.add_argument("--ready-timeout", type=float, default=300)
            p.add_argument("--stages", action="store_true",
                           help="time every request's stages in each server's process "
                                "(bench/serve_stages.py); the report gets each phase's medians")
            p.add_argument("--engine-process", choices=("mp", "in"), default=None,
                           help="server featcache's (PyTorch); default featcache serve's own: mp, "
                                "lmdeploy's engine process, as plain lmdeploy serve runs it")
            p.add_argument("--servers", default="plain,featcache,featcache_in",
                           help="plain first; featcache (its --engine-process), featcache_in "
                                "(--engine-process in): all up at once, run in a rotating order")
            p.add_argument("--answer-tokens", type=int, default=16,
                           help="tokens of each sequential answer, compared with plain's (the "
                                "time to first token is measured as it streams)")
            p.add_argument("--profile", default="", metavar="SERVERS",
                           help="these servers (e.g. plain,featcache) under py-spy in repetition 0, "
                                "each phase apart: where their processes' time goes (the report's "
                                "profile; the samples in --logs)")
            p.add_argument("--bound", action="store_true",
                           help="each server's requests/s as a fraction of the GPU's compute bound "
                                "(bench/lib/bound.py; a matrix rate measured before the servers start)")
        if name == "pipeline":
            p.add_argument("--paths", default="plain,fc",
                           help="plain first; pytorch: fc, fc_nodisk; turbomind: native, features, "
                                "combined")
            p.add_argument("--no-disk", action="store_true",
                           help="TurboMind: featcache without its disk tier (PyTorch: path fc_nodisk)")
            p.add_argument("--kv-fraction", type=float, default=0.05,
                           help="cache_max_entry_count (the seed bench's 0.05)")
            p.add_argument("--ceiling", action="store_true",
                           help="featcache paths: a second batch preprocessed before the clock")
            p.add_argument("--watchdog", type=float, default=400,
                           help="s an engine may take (build, run, close) before the run dumps "
                                "every thread's stack and exits")
    args = ap.parse_args(argv)
    if args.n < 1 or args.batch < 1 or args.reps < 1:
        ap.error("--n, --batch and --reps must be at least 1")
    if getattr(args, "clients", 1) < 1:
        ap.error("--clients must be at least 1")
    report = dict(stages=stages, pipeline=pipeline, serve=serve)[args.cmd](args)
    return emit(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
