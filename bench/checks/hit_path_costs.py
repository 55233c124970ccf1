"""What each step of a hit request's image handling costs on the CPU (no GPU, no server).

    PYTHONPATH=$PWD python bench/checks/hit_path_costs.py [--repeats N] [--json FILE]

One 1344x1008 noise PNG (bench/lib/images.py's: examples/chat.py's bytes; ~4 MB encoded, ~5.4 MB as
a data URL), sent as a data URL inside an OpenAI chat body. Per step, the median over --repeats of
a fresh input (a new string object each time, so no per-object cache, ``urlsplit``'s LRU included,
answers for it):

- lmdeploy's server path: the body's ``json.loads``; ``ChatCompletionRequest`` validation;
  ``urlparse`` of the data URL (``load_from_url``'s, and featcache's before it keyed the encoded bytes);
  base64 decoding (``pybase64``, as lmdeploy); PNG decoding; ``convert("RGB")`` (a copy when the
  image is RGB already: lmdeploy's ``ImageMediaIO.load_bytes`` always calls it); keying the decoded
  pixels (what a hit costs featcache when lmdeploy decoded the image: http URLs);
- featcache's: keying the encoded bytes (keyed blake3, framed; ``key_*`` rows: keyed blake3
  against xxh3_128 on a 5 MB encoded image, a 13-tile image's pixels, a data URL's text);
  ``encoded_bytes`` of the data URL (base64 decoding and the parsing around it);
  ``Frontend.resolve_sources`` on a hit, with a real ``FeatureCache`` (CPU device tier) holding
  the image: the whole of featcache's share of a hit before the engine;
- a new image's pixels pickled to lmdeploy's engine process (``pixels_*`` rows): as a tensor and
  as ``tags.Pixels``;
- a video hit's (``video_*`` rows; the GPU breakdown's clip: 10 s of 640x360 at 4 frames a second, an
  MP4 data URL of ~3.3 MB): telling a data URL of frames from one of a container (``is_frames``, its first
  4 KiB parsed; ``_whole_url``: the whole URL, as before), reading its
  bytes, keying them, and checking the limits: by OpenCV's read of the container's header
  (``probe``: what every video request cost before a held video's recorded facts were checked
  instead) or from the facts its entries recorded (``checked``: what a held video costs now);
- the client's: the ``openai`` client sending the image request (and a one-line text request) to
  a loopback socket server that answers at once: what a data URL costs before the server starts.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the checkout

from bench.lib.images import chat_url  # noqa: E402
from bench.lib.results import write_report  # noqa: E402
from bench.lib.timing import median_call_ms  # noqa: E402


def timed(fn: Callable[..., Any], repeats: int, make: Callable[[], Any] | None = None) -> float:
    """Median wall time in ms of ``fn()``, or of ``fn(make())`` with each ``make()`` made before
    the clock starts."""
    return round(median_call_ms(fn, repeats, make=make), 3)


def fresh(s: str) -> Callable[[], str]:
    """Makes equal strings that are new objects (hash not computed, no cache holds them)."""
    return lambda: (s + " ")[:-1]


def measure(repeats: int) -> dict[str, Any]:
    import pybase64
    import xxhash
    from PIL import Image

    from featcache import FeatureCache
    from featcache.keys import KeyHasher

    keyed = KeyHasher("blake3", os.urandom(32))  # what a FeatureCache keys with (its store's secret)
    url = chat_url(1)
    raw = base64.b64decode(url.split(",", 1)[1])
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                     {"type": "image_url", "image_url": {"url": url}}]},
        {"role": "assistant", "content": "a picture"},
        {"role": "user", "content": "Describe the colours."}]}).encode()
    decoded = Image.open(io.BytesIO(raw)).convert("RGB")
    ns = "bench:hit-path"
    rows: dict[str, float] = {
        "body_json_loads": timed(lambda: json.loads(body), repeats),
        "urlparse_data_url": timed(urlparse, repeats, fresh(url)),
        "b64decode_pybase64": timed(lambda u: pybase64.b64decode(u.split(",", 1)[1]), repeats, fresh(url)),
        "b64decode_stdlib": timed(lambda: base64.b64decode(url.split(",", 1)[1]), repeats),
        "xxh3_128_of_bytes": timed(lambda: xxhash.xxh3_128_digest(raw), repeats),
        "image_key_of_bytes": timed(lambda: keyed.image_key(raw, namespace=ns, params={}), repeats),
        "png_decode": timed(lambda: Image.open(io.BytesIO(raw)).load(), repeats),
        "convert_rgb_copy": timed(lambda: decoded.convert("RGB"), repeats),
        "image_key_of_pixels": timed(lambda: keyed.image_key(decoded, namespace=ns, params={}), repeats),
    }
    rows.update(key_rows(url, decoded, repeats))
    try:
        from lmdeploy.serve.openai.protocol import ChatCompletionRequest

        parsed = json.loads(body)
        rows["chat_request_validate"] = timed(lambda: ChatCompletionRequest.model_validate(parsed),
                                              repeats)
    except ImportError:
        pass
    try:
        rows.update(featcache_rows(url, raw, repeats, FeatureCache))
    except ImportError:
        pass
    try:
        rows.update(pixel_rows(repeats))
    except ImportError:
        pass
    try:
        rows.update(video_rows(repeats))
    except ImportError:
        pass
    try:
        rows.update(client_rows(json.loads(body)["messages"], repeats))
    except ImportError:
        pass
    return {"image_bytes": len(raw), "data_url_chars": len(url), "body_bytes": len(body),
            "repeats": repeats, "median_ms": rows}


def pixel_rows(repeats: int) -> dict[str, float]:
    """A new image's pixels on their way to lmdeploy's engine process (its RPC's ``pickle``): a 7-tile
    float16 tensor (8.4 MB) pickled and unpickled as a tensor (torch's legacy format, what they
    travelled as before) and as ``tags.Pixels`` (their raw bytes, made beforehand on the frontend's
    thread)."""
    import pickle

    import torch

    from featcache.lmdeploy.request.tags import Pixels

    pixels = torch.randn(7, 3, 448, 448).half()
    packed = Pixels(pixels)
    as_tensor, as_bytes = pickle.dumps(pixels), pickle.dumps(packed)
    return {
        "pixels_pickle_tensor": timed(lambda: pickle.dumps(pixels), repeats),
        "pixels_unpickle_tensor": timed(lambda: pickle.loads(as_tensor), repeats),
        "pixels_pickle_packed": timed(lambda: pickle.dumps(packed), repeats),
        "pixels_unpickle_packed": timed(lambda: pickle.loads(as_bytes), repeats),
    }


def video_rows(repeats: int) -> dict[str, float]:
    """The steps of a held video's request before lmdeploy's parser (module docstring)."""
    from bench.e2e.series import VIDEO_FPS
    from bench.lib.images import clip_data_url
    from featcache.keys import KeyHasher
    from featcache.lmdeploy.request.media import LOCAL_FILES, VideoLimits
    from featcache.lmdeploy.request.video.entries import video_key
    from featcache.lmdeploy.request.video.read import _frames_parts, checked, is_frames, probe, read_video

    url = clip_data_url(7, frames=round(10 * VIDEO_FPS), size=(640, 360), fps=VIDEO_FPS)
    limits = VideoLimits()
    raw = read_video(url, LOCAL_FILES, limits)
    assert raw is not None
    keyed = KeyHasher("blake3", os.urandom(32))
    facts = probe(raw, {}, limits)
    return {
        "video_is_frames": timed(is_frames, repeats, fresh(url)),  # (its head parsed)
        "video_is_frames_whole_url": timed(lambda u: _frames_parts(u)[0].lower() == "video/jpeg",
                                           repeats, fresh(url)),  # (what it parsed before)
        "video_read_bytes": timed(lambda u: read_video(u, LOCAL_FILES, limits), repeats, fresh(url)),
        "video_key": timed(lambda: video_key(keyed, "bench:hit-path", raw, {"io": {}}), repeats),
        "video_probe_container": timed(lambda: probe(raw, {}, limits), repeats),
        "video_check_recorded": timed(lambda: checked(facts, {}, limits), repeats),
    }


def key_rows(url: str, decoded: Any, repeats: int) -> dict[str, float]:
    """What keying costs per image, the default (keyed blake3 under a cache's secret, issue 26)
    against the xxh3_128 keys before it, on what a hit keys: a 5 MB encoded image (a file, or a
    data URL's bytes on its first sight), a data URL's text (the memo of a data URL seen before),
    the decoded pixels of a 13-tile image (a pipeline's PIL image) and, for the record, the
    preprocessed 13-tile pixel tensor (bf16, 13x3x448x448: never keyed on a hit)."""
    import numpy as np
    import torch
    import xxhash

    from featcache.keys import KeyHasher

    keyed, fast = KeyHasher("blake3", os.urandom(32)), KeyHasher("xxh3_128")
    five_mb = os.urandom(5_000_000)
    tiles = torch.randn(13, 3, 448, 448).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    pixels = np.asarray(decoded)
    text = url.encode()
    secret = os.urandom(32)
    rows: dict[str, float] = {}
    inputs = {"5MB_encoded": five_mb, "13tile_decoded_pixels": pixels, "13tile_pixel_tensor": tiles}
    for name, hasher in (("blake3_keyed", keyed), ("xxh3", fast)):
        for what, data in inputs.items():
            rows[f"key_{name}_{what}"] = timed(
                lambda h=hasher, d=data: h.image_key(d, namespace="n"), repeats)
    try:
        import blake3

        rows["memo_blake3_keyed_data_url_text"] = timed(
            lambda: blake3.blake3(text, key=secret, max_threads=blake3.blake3.AUTO).digest(), repeats)
    except ImportError:
        pass
    rows["memo_xxh3_data_url_text"] = timed(lambda: xxhash.xxh3_128_digest(text), repeats)
    return rows


def featcache_rows(url: str, raw: bytes, repeats: int, cache_class: Any) -> dict[str, float]:
    """featcache's share of a hit: ``encoded_bytes`` and the whole ``resolve_sources`` (needs
    lmdeploy for the frontend's imports)."""
    import torch

    from featcache.lmdeploy.request.entry_meta import encode_item
    from featcache.lmdeploy.request.frontend import Frontend
    from featcache.lmdeploy.request.sources import CachedImage, encoded_bytes

    ns = "bench:hit-path"
    cache = cache_class(device="cpu", device_bytes="64MiB", host_bytes=0)
    try:
        meta = encode_item({"pixel_values": torch.zeros(1, 3, 448, 448), "image_tokens": 256,
                            "image_token_id": 1, "offset": 0}, ns)
        frontend = Frontend(cache, lambda m: m, ns)
        cache.put(frontend._bytes_key(raw, {}, {}), torch.zeros(256, 64), meta=meta)

        def resolve(source: str) -> None:
            msgs = [{"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": source}}]}]
            out = frontend.resolve_sources(msgs, {})
            data = out[0]["content"][1]["image_data"]["data"]
            assert isinstance(data, CachedImage), "not a hit"
            data.ref.lease.release()

        return {"fc_encoded_bytes": timed(encoded_bytes, repeats, fresh(url)),
                "fc_resolve_sources_hit": timed(resolve, repeats, fresh(url))}
    finally:
        cache.close()


_SSE = (b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"m","choices":'
        b'[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\ndata: [DONE]\n\n')


def client_rows(messages: list[Any], repeats: int) -> dict[str, float]:
    """What sending the request costs the client before any server work: the ``openai`` client's
    time to its first streamed chunk from a loopback socket server that reads the whole body and
    answers at once, for the image request and for a one-line text request."""
    import socket
    import threading

    import openai

    def serve(sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as f:
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                f.read(length)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(_SSE), _SSE))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    threading.Thread(target=serve, args=(sock,), daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x",
                           max_retries=0)

    def first_chunk(msgs: list[Any]) -> None:
        stream = client.chat.completions.create(model="m", messages=msgs, stream=True, max_tokens=8)
        next(iter(stream))
        stream.close()

    text = [{"role": "user", "content": "Describe the colours."}]
    try:
        return {"client_send_image_request": timed(lambda: first_chunk(messages), repeats),
                "client_send_text_request": timed(lambda: first_chunk(text), repeats),
                "client_json_dumps_body": timed(lambda: json.dumps({"messages": messages}), repeats)}
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", metavar="FILE", help="also write the numbers here")
    args = p.parse_args(argv)
    res = measure(args.repeats)
    print(f"image {res['image_bytes']} bytes, data URL {res['data_url_chars']} chars, body "
          f"{res['body_bytes']} bytes; median of {res['repeats']}:")
    for name, ms in res["median_ms"].items():
        print(f"  {name:<26} {ms:>9.3f} ms")
    if args.json:
        write_report(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
