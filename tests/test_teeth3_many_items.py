"""Tests with teeth, third round (issue 40 item 6 and what survived planting since): requests of
many items, checked item by item, not only the first or the last.

Each test was seen failing with its bug planted in a copy of the tree (the closing note of issue
40 says which bug for which test).
"""

from __future__ import annotations

import io

import _lmdeploy_stack
import pytest
import torch

_lmdeploy_stack.require()  # a skip naming the missing module; CI fails instead

import lmdeploy_tiny as tiny  # noqa: E402

from featcache.lmdeploy.pytorch.engine import unservable  # noqa: E402
from featcache.lmdeploy.request.refs import REF_KEY  # noqa: E402
from featcache.lmdeploy.request.tags import FeatTag, Source  # noqa: E402


def _png_bytes(seed: int = 40) -> bytes:
    buf = io.BytesIO()
    tiny.noise_image(32, 24, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


PIXELS = torch.zeros(1, 3, 448, 448)
EMPTY = torch.empty(0, 3, 448, 448)


def _with_pixels(n: int) -> dict:
    return {"pixel_values": PIXELS, REF_KEY: FeatTag(bytes([n]) * 16, b"{}", None)}


def _rebuildable(n: int) -> dict:
    return {"pixel_values": EMPTY,
            REF_KEY: FeatTag(bytes([n]) * 16, b"{}", Source(_png_bytes(n), '{"io": {}}', "{}"))}


DAMAGED = {  # each is unservable wherever it stands in a request
    "no pixels, bytes not an image": {"pixel_values": EMPTY, REF_KEY: FeatTag(
        b"d" * 16, b"{}", Source(b"garbage", '{"io": {}}', "{}"))},
    "no pixels, no source": {"pixel_values": EMPTY, REF_KEY: FeatTag(b"e" * 16, b"{}", None)},
    "metadata not storable": {"pixel_values": PIXELS, REF_KEY: FeatTag(
        b"f" * 16, b"[1, 2]", None)},
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
@pytest.mark.parametrize("position", [0, 1, 3])
def test_a_damaged_image_anywhere_in_a_request_makes_it_unservable(damage, position):
    """Issue 40 item 6: three servable images (with pixels, and without pixels but
    rebuildable) and one damaged, at the start, after an image with pixels, or last: the request
    is refused, naming the damage. (Planted: the loop returning at the first image with pixels;
    the tests of one image per request passed.)"""
    good = [_with_pixels(1), _rebuildable(2), _with_pixels(3)]
    items = good[:position] + [DAMAGED[damage]] + good[position:]
    why = unservable(items)
    assert why is not None and why.startswith("featcache:"), (damage, position, why)


def test_a_request_of_servable_images_is_servable():
    """The other side: many servable images, in any order, are not refused."""
    items = [_with_pixels(1), _rebuildable(2), _with_pixels(3), _rebuildable(4)]
    assert unservable(items) is None
    assert unservable(list(reversed(items))) is None


def test_the_report_of_a_request_to_model_processes_counts_every_image_sent_without_pixels():
    """The X-Featcache report in mp mode: of five images, the three the frontend sent without
    pixels (a source to rebuild them: the model process holds their features) are the hits,
    wherever they stand. (Planted: the count as ``int(any(...))``; a request of one image
    passed.)"""
    from featcache.lmdeploy.request.report import report_of

    items = [_rebuildable(1), _with_pixels(2), _rebuildable(3), _with_pixels(4), _rebuildable(5)]
    report = report_of({"multimodal": items}, "mp")
    assert (report.mode, report.images, report.hits) == ("mp", 5, 3)
    assert report_of({"multimodal": items[1::2]}, "mp").hits == 0
    assert report_of({"multimodal": list(reversed(items))}, "mp").hits == 3
