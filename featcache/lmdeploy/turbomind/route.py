"""Which TurboMind path serves a request, in the combined configuration (``turbomind="combined"``):
the books and the policy, no tensors and no I/O.

Why a choice per request: lmdeploy 0.18's TurboMind indexes a request in its prefix cache only if
it carries no ``input_embeddings`` (C++ ``Scheduler::PrefixEligible``; docs/turbomind.md, "Why the
features path has no prefix reuse"), and the embedding ranges cannot carry a fingerprint. So one
request gets either TurboMind's prefix reuse (native path: pixels + fingerprints; TurboMind skips
its ViT where a prefix hit covers an image) or featcache's ViT skip (features path:
``input_embeddings``; full prefill, never indexed), never both. The combined configuration routes
each request to the one that serves it best, from what featcache has sent TurboMind before.

A *context* is a conversation up to and including one of its images: every message's role and
text, and each image as its featcache key, in order (``context_digests``). One chat template and
one tokenizer make equal contexts into equal token prefixes through the image's span, carrying the
same fingerprints (they are functions of the keys): what TurboMind's prefix key is made of. The
``RouteBook`` remembers, for the contexts of the requests it routed, how TurboMind was sent them:
``NATIVE`` (TurboMind indexed that prefix in its prefix cache, unless it evicted it since) or
``FEATURES`` (it did not: such requests are not indexed).

The policy (``decide``), first match wins:

1. an image without a key (not cacheable here): native (TurboMind's own ViT, lmdeploy's sha256);
2. the request continues a context sent natively (the digest of its first image is booked
   ``NATIVE``): native. A chat turn resending its history: TurboMind's prefix cache covers the
   history and its images, so neither its ViT nor the prefill of the history runs again;
3. the request continues a context sent as features (booked ``FEATURES``): native, once: the
   conversation came back, so it is indexed now (this turn pays TurboMind's ViT and a full
   prefill; its later turns reuse the prefix);
4. a fresh context whose every image featcache has seen before (its pixels or its features are
   in the cache): features. The ViT is skipped where features are held, and run once in Python
   (then stored) for an image held only as pixels;
5. otherwise (a fresh context with an image seen for the first time: a miss): native. TurboMind's
   own ViT computes it, as plain TurboMind would, and the context is indexed for its next turns.

A wrong guess costs speed, never correctness: a native request always carries every image's full
pixels and fingerprint, so where TurboMind evicted the prefix it runs its ViT on them; a features
request always carries every image's features. What a guess changes is which computation of the
vision model a request's output comes from: native requests are plain TurboMind's (token for
token), features requests the features path's (close to it, not identical; docs/turbomind.md).
TurboMind never mixes the two: features requests are never indexed, so a native request never
reuses KV computed from featcache's features.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ...eviction.lrumap import LruMap

NATIVE = "native"
FEATURES = "features"
ROUTES = (NATIVE, FEATURES)
BOOK_CONTEXTS = 65536  # contexts remembered (a digest and a word each: ~100 bytes)
_PERSON = b"featcache-tm-cx1"  # blake2b personalisation (16 bytes)
_SKIPPED_ROLES = ("preprocess", "forward")  # lmdeploy's own entries of the messages list


class Route(NamedTuple):
    """One request's path (``NATIVE`` or ``FEATURES``) and the rule that chose it (``REASONS``)."""

    path: str
    reason: str


# reason -> path: the rules of ``decide``, in order (their names are the stats counters' suffixes)
REASONS = {"unkeyed": NATIVE, "continued": NATIVE, "indexed": NATIVE, "repeat": FEATURES,
           "miss": NATIVE}


def context_digests(messages: Sequence[dict[str, Any]], keys: Sequence[bytes | None],
                    salt: str) -> list[bytes | None]:
    """Digest i: the conversation in ``messages`` up to and including its i-th image (blake2b-256 of
    every message's role, texts and images, length-prefixed), where ``keys[i]`` is the featcache key
    of image i in lmdeploy's order (``collect_multimodal_items``); None from the first image without
    a key on. ``salt`` (the model's namespace) keeps two models' contexts apart. Entries lmdeploy
    adds to the list (roles "preprocess", "forward") are not part of the conversation."""
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    _frame(h, b"s", salt.encode())
    out: list[bytes | None] = []
    images = iter(keys)
    broken = False
    for message in messages:
        role = message.get("role")
        if role in _SKIPPED_ROLES:
            continue
        _frame(h, b"r", str(role).encode())
        content = message.get("content")
        if not isinstance(content, list):
            _frame(h, b"t", str(content).encode())
            continue
        for item in content:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind in (None, "text"):
                text = item.get("text", "") if isinstance(item, dict) else item
                _frame(h, b"t", str(text).encode())
                continue
            key = next(images, None)
            broken = broken or key is None
            if broken:
                out.append(None)
                continue
            assert key is not None
            _frame(h, b"i", bytes(key))
            out.append(h.copy().digest())
    if len(out) != len(keys):
        raise ValueError(f"{len(keys)} image keys for {len(out)} images in the messages")
    return out


def _frame(h: Any, tag: bytes, data: bytes) -> None:
    h.update(tag + len(data).to_bytes(8, "little") + data)


class RouteBook:
    """Contexts featcache sent TurboMind, and how (``NATIVE`` or ``FEATURES``): at most ``capacity``
    of them, least recently used forgotten first. It knows what was sent, not what TurboMind still
    holds: TurboMind evicts its prefix blocks on its own, and a context booked ``NATIVE`` may be gone
    there (rule 2 then costs a ViT run, not a wrong answer). Thread-safe."""

    def __init__(self, capacity: int = BOOK_CONTEXTS) -> None:
        self._sent: LruMap[bytes, str] = LruMap(capacity)

    def sent_as(self, digest: bytes | None) -> str | None:
        """How the context was sent last (``NATIVE``, ``FEATURES``), or None (never, or forgotten)."""
        return None if digest is None else self._sent.get(digest)

    def record(self, digests: Sequence[bytes | None], path: str) -> None:
        """The request whose contexts are ``digests`` is sent along ``path``. ``NATIVE`` books every
        context native (TurboMind indexes the prompt); ``FEATURES`` books only contexts not booked
        native already (a prefix TurboMind indexed stays there whatever this request does)."""
        if path not in ROUTES:
            raise ValueError(f"path must be one of {ROUTES}, not {path!r}")
        for digest in digests:
            if digest is None:
                continue
            if path == FEATURES and self._sent.get(digest) == NATIVE:
                continue
            self._sent.put(digest, path)

    def __len__(self) -> int:
        return len(self._sent)


def decide(digests: Sequence[bytes | None], book: RouteBook,
           seen: Callable[[], Sequence[bool]]) -> Route:
    """The route of one request (module docstring, rules 1-5). ``digests``: its contexts
    (``context_digests``); ``seen()[i]``: whether image i's pixels or features are in the cache,
    asked only for a fresh context (rules 4 and 5)."""
    if not digests or any(d is None for d in digests):
        return Route(NATIVE, "unkeyed")
    sent = book.sent_as(digests[0])
    if sent == NATIVE:
        return Route(NATIVE, "continued")
    if sent == FEATURES:
        return Route(NATIVE, "indexed")
    if all(seen()):
        return Route(FEATURES, "repeat")
    return Route(NATIVE, "miss")
