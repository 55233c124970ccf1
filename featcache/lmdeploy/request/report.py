"""What each request got from the cache (``RequestReport``): its images, how many were served from
the cache, from which tier, and the vision time that saved; for ``featcache serve``'s responses
(``featcache.server.report``: the ``X-Featcache`` header, the ``usage`` object) and the pipeline's
(``Response.featcache``).

Decided where lmdeploy 0.18 prepares a request, ``AsyncEngine.preprocess`` (the server's chat,
completion and generate endpoints and the pipeline all go through it before generation, and it
returns once every image has been looked up), from the per-image dicts it hands the engine: each
carries featcache's ref of its image (``REF_KEY``). ``install_reports`` wraps the engine's
``preprocess`` to read them, and its ``generate`` to hand the report on with each output.

- One process (``mode`` "in": the engine in this process): a hit is an image the frontend leased
  from the cache (a ``FeatRef`` with a lease: neither preprocessed nor run through the vision
  model); its tier is where the lookup found it (``Lease.tier``), its saving the vision time its
  entry records (``cost_s``, measured when its features were computed: ``visioncost``). A miss's
  own vision time is known once the model ran it (``FeatRef.cost_s``): ``vision_computed_s``.
- Several processes (``mode`` "mp": lmdeploy's engine process, tp > 1, an mp or ray executor):
  the cache that serves the features is each model process's own, and lmdeploy 0.18 has no way
  back from it per request (the forward's outputs carry tokens and logits only). What this
  process knows: an image sent without its pixels (a ``FeatTag`` with a ``source``: sent before,
  neither decoded nor preprocessed again here) is a hit; tiers and savings are unknown (None).
  The model process serves such an image from its cache, or rebuilds its pixels from the bytes
  where it lost it; an image sent with its pixels may still hit there (a store warmed before, or
  this server restarted): docs/cli.md says what a client can rely on.

Per request, never per process: the server's report travels in a ``ReportSlot`` that the HTTP
layer puts in a context variable (``REQUEST``) around each request; ``preprocess`` runs in the
request's own task, so concurrent requests never see each other's slot (lmdeploy's executor
threads, where context variables do not reach, are not involved: the report is read from
``preprocess``'s result, after they ran). The pipeline's report goes from ``preprocess`` to
``generate`` keyed by the prepared request itself. A report holds no lease.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ...entrymeta import cost_of
from ...eviction.lrumap import LruMap
from .refs import REF_KEY, FeatRef
from .tags import FeatTag

log = logging.getLogger("featcache")

MODES = ("in", "mp")  # the model in this process; in other processes (featcache serve's --engine-process)
TIERS = ("device", "host", "disk", "remote")  # the order tiers are reported in (the chain's)
HEADER = "X-Featcache"
PENDING = 4096  # prepared requests whose report waits for their generate (a bound, not a target)


@dataclasses.dataclass(frozen=True)
class RequestReport:
    """One request's images and what the cache served of them.

    ``hits``: images served from the cache (mode "mp": sent without pixels, see the module's
    docstring). ``tiers``: the hits per tier, or None where not known here (mode "mp").
    ``vision_saved_s``: the vision time the hits' entries record (None: not known here, or no hit
    records one); ``unknown_cost``: hits whose entry records none (counted in no saving).
    ``misses``: refs of the images the model computes, read for ``vision_computed_s`` (mode "in";
    a miss holds no lease)."""

    mode: str
    images: int = 0
    hits: int = 0
    tiers: Mapping[str, int] | None = None
    vision_saved_s: float | None = None
    unknown_cost: int = 0
    misses: tuple[FeatRef, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def vision_computed_s(self) -> float | None:
        """The vision time the model spent on this request's misses, once it ran them: the sum of
        what the model hook measured (mode "in"); None where not known (mode "mp", a miss not
        run yet or not timed yet, e.g. on CUDA before the first timed call finished). 0 for no
        miss."""
        if self.mode != "in":
            return None
        costs = [ref.cost_s for ref in self.misses]
        return None if any(c is None for c in costs) else sum((c for c in costs if c is not None), 0.0)

    def header(self) -> str:
        """The ``X-Featcache`` header's value (docs/cli.md): ``mode=in; images=2; hits=1;
        tiers=device:1; vision_saved_ms=271``. Every value is featcache's own (a count, a tier
        name, a fixed word): nothing a client sent."""
        if self.tiers is None:
            tiers = "unknown"
        else:
            tiers = ",".join(f"{t}:{n}" for t, n in _ordered(self.tiers)) or "-"
        fields = [f"mode={self.mode}", f"images={self.images}", f"hits={self.hits}",
                  f"tiers={tiers}", f"vision_saved_ms={_ms(self.vision_saved_s)}"]
        if self.mode == "in" and self.unknown_cost:
            fields.append(f"unknown_cost={self.unknown_cost}")
        return "; ".join(fields)

    def usage(self) -> dict[str, Any]:
        """The report as the ``usage`` object's ``featcache`` member (JSON; None: not known)."""
        computed = self.vision_computed_s
        saved = self.vision_saved_s
        return {"mode": self.mode, "images": self.images, "hits": self.hits,
                "tiers": None if self.tiers is None else dict(_ordered(self.tiers)),
                "vision_saved_ms": None if saved is None else round(saved * 1e3, 1),
                "unknown_cost": self.unknown_cost if self.mode == "in" else None,
                "vision_computed_ms": None if computed is None else round(computed * 1e3, 1)}


def _ordered(tiers: Mapping[str, int]) -> list[tuple[str, int]]:
    known = [(t, tiers[t]) for t in TIERS if tiers.get(t)]
    return known + sorted((t, n) for t, n in tiers.items() if t not in TIERS and n)


def _ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else str(round(seconds * 1e3))


def report_of(inputs: Any, mode: str) -> RequestReport:
    """The report of a prepared request's inputs (``PreprocessedRequest.inputs``: lmdeploy's
    ``multimodal`` list of per-image dicts, absent for a text-only request)."""
    items = inputs.get("multimodal") if isinstance(inputs, dict) else None
    if not isinstance(items, list):
        items = []
    # (a Mapping: a miss of Qwen2-VL is a transformers BatchFeature, a UserDict)
    refs = [item.get(REF_KEY) if isinstance(item, Mapping) else None for item in items]
    if mode == "mp":
        hits = sum(1 for ref in refs if isinstance(ref, FeatTag) and ref.source is not None)
        return RequestReport("mp", len(items), hits)
    tiers: dict[str, int] = {}
    saved, unknown, misses = 0.0, 0, []
    for ref in refs:
        if not isinstance(ref, FeatRef):
            continue
        if ref.lease is None:
            misses.append(ref)
            continue
        tier = getattr(ref.lease, "tier", "device")
        tiers[tier] = tiers.get(tier, 0) + 1
        cost = cost_of(ref.meta)
        if cost is None:
            unknown += 1
        else:
            saved += cost
    hits = sum(tiers.values())
    return RequestReport("in", len(items), hits, tiers,
                         saved if hits == 0 or hits > unknown else None, unknown, tuple(misses))


def merged(reports: list[RequestReport]) -> RequestReport | None:
    """One report of several prepared for one HTTP request (lmdeploy prepares the prompt once
    per choice when ``n`` > 1): counts and savings summed; None for none."""
    if not reports:
        return None
    if len(reports) == 1:
        return reports[0]
    first = reports[0]
    tiers: dict[str, int] | None = {} if all(r.tiers is not None for r in reports) else None
    if tiers is not None:
        for r in reports:
            for t, n in (r.tiers or {}).items():
                tiers[t] = tiers.get(t, 0) + n
    known = [r.vision_saved_s for r in reports if r.vision_saved_s is not None]
    return RequestReport(first.mode, sum(r.images for r in reports), sum(r.hits for r in reports),
                         tiers, sum(known) if known else None,
                         sum(r.unknown_cost for r in reports),
                         tuple(ref for r in reports for ref in r.misses))


class ReportSlot:
    """Where one HTTP request's reports go (the HTTP layer reads them when it answers)."""

    __slots__ = ("reports",)

    def __init__(self) -> None:
        self.reports: list[RequestReport] = []

    @property
    def report(self) -> RequestReport | None:
        """The request's report (None: no featcache engine prepared it)."""
        return merged(self.reports)


REQUEST: contextvars.ContextVar[ReportSlot | None] = contextvars.ContextVar(
    "featcache_request_report", default=None)


def install_reports(engine: Any, mode: str) -> None:
    """Report what each request prepared by ``engine`` (lmdeploy's ``AsyncEngine``) got from the
    cache: its ``preprocess`` and ``generate`` are wrapped (instance attributes shadowing the
    methods). The report goes to the request's ``ReportSlot`` (``REQUEST``, set by the HTTP
    layer), and with each output of ``generate`` (``GenOut.featcache``), into each ``Response``
    its ``to_response`` makes (``Response.featcache``: the pipeline's). Idempotent; an engine
    without those methods is left alone. A failure here loses the report, never the request."""
    if mode not in MODES:
        raise ValueError(f"mode is one of {MODES}, not {mode!r}")
    prepare = getattr(engine, "preprocess", None)
    generate = getattr(engine, "generate", None)
    if prepare is None or generate is None or getattr(prepare, "_featcache_reports", False):
        return
    pending: LruMap[int, RequestReport] = LruMap(PENDING)

    async def preprocess(*args: Any, **kwargs: Any) -> Any:
        request = await prepare(*args, **kwargs)
        try:
            report = report_of(getattr(request, "inputs", None), mode)
        except Exception:  # noqa: BLE001 (a report lost, the request goes on)
            log.debug("featcache: no report for this request", exc_info=True)
            return request
        slot = REQUEST.get()
        if slot is not None:
            slot.reports.append(report)
        pending.put(id(request), report)  # (a later request at this id overwrites it first)
        return request

    async def reporting(request: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        report = pending.pop(id(request), None)
        outputs = generate(request, *args, **kwargs)
        try:
            async for out in outputs:
                if report is not None:
                    _attach(out, report)
                yield out
        finally:
            await outputs.aclose()  # lmdeploy's cleanup runs now, not when collected

    preprocess._featcache_reports = True  # type: ignore[attr-defined]
    engine.preprocess = preprocess
    engine.generate = reporting


def _attach(out: Any, report: RequestReport) -> None:
    """``out.featcache`` is the report, and so is each ``Response`` its ``to_response`` makes."""
    try:
        out.featcache = report
        to_response = out.to_response
    except AttributeError:  # an output that takes no attribute: no report on it
        return

    def reported(*args: Any, **kwargs: Any) -> Any:
        response = to_response(*args, **kwargs)
        try:
            response.featcache = report
        except AttributeError:
            pass
        return response

    out.to_response = reported
