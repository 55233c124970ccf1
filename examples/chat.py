"""A multi-turn chat that resends its images every turn, as real OpenAI clients do.

    featcache serve MODEL --backend pytorch --enable-prefix-caching &     # or lmdeploy serve api_server
    python examples/chat.py [--base-url http://localhost:23333/v1] [--image a.png ...] [--turns 4]

The images go in the first user message as base64 data URLs and stay in the history, so every
turn sends them again; each turn's time to first token (streamed) is printed. Against
`featcache serve`, turn 1 computes the images' features and every later turn gets them from the
cache (and, with --enable-prefix-caching, reuses the KV of the history). Needs `pip install openai`.

Exit codes: 0 done, 1 the server could not be reached or answered with an error (one line on
stderr, naming the address), 2 bad usage (e.g. an image file that cannot be read), 130 interrupted.
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time


def data_url(path: str | None, seed: int) -> str:
    """The image at ``path`` (or a generated 1344x1008 noise image) as a data URL."""
    if path is not None:
        with open(path, "rb") as f:
            raw = f.read()
        kind = "png" if raw[:8] == b"\x89PNG\r\n\x1a\n" else "jpeg"
    else:
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(seed)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (1008, 1344, 3), dtype=np.uint8)).save(buf, "PNG")
        raw, kind = buf.getvalue(), "png"
    return f"data:image/{kind};base64,{base64.b64encode(raw).decode()}"


QUESTIONS = ["What is in this picture?", "Describe the colours.", "What stands out most?",
             "Summarise it in five words.", "What would you title it?", "Anything unusual?"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://localhost:23333/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", help="served model name (default: the server's first)")
    p.add_argument("--image", action="append", help="image file (repeatable; default: one generated)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the generated image")
    args = p.parse_args(argv)
    if args.turns < 1:
        p.error(f"argument --turns: {args.turns} is not a number of turns (1 or more)")
    try:
        images = [data_url(path, args.seed) for path in (args.image or [None])]
    except OSError as e:  # a missing or unreadable --image
        p.error(f"argument --image: cannot read {e.filename!r}: {e.strerror or e}")
    try:
        import openai
    except ModuleNotFoundError:
        print("chat.py: error: this example needs the openai client: pip install openai",
              file=sys.stderr)
        return 1
    try:
        return chat(openai.OpenAI(base_url=args.base_url, api_key=args.api_key), args, images)
    except openai.APIConnectionError as e:  # no server there (refused, no route, timed out)
        cause = e.__cause__ or e
        why = " ".join(str(cause).split()) or type(cause).__name__
        print(f"chat.py: error: cannot reach {args.base_url} ({why}): start the server "
              "(featcache serve MODEL ...) or pass --base-url", file=sys.stderr)
    except openai.APIStatusError as e:  # the server answered with an error status
        print(f"chat.py: error: {args.base_url} answered HTTP {e.status_code}: "
              f"{' '.join(str(e.message).split())[:300]}", file=sys.stderr)
    except openai.OpenAIError as e:
        print(f"chat.py: error: {args.base_url}: {type(e).__name__}: "
              f"{' '.join(str(e).split())[:300]}", file=sys.stderr)
    except KeyboardInterrupt:
        print("chat.py: interrupted", file=sys.stderr)
        return 130
    return 1


def chat(client, args: argparse.Namespace, images: list[str]) -> int:
    """The conversation: ``args.turns`` turns, each resending the history with its images."""
    if args.model:
        model = args.model
    else:
        served = client.models.list().data
        if not served:
            print(f"chat.py: error: {args.base_url} serves no model: pass --model",
                  file=sys.stderr)
            return 1
        model = served[0].id
    history: list[dict] = []
    for turn in range(args.turns):
        question = QUESTIONS[turn % len(QUESTIONS)]
        content: list[dict] | str = question
        if turn == 0:
            content = [{"type": "text", "text": question},
                       *({"type": "image_url", "image_url": {"url": u}} for u in images)]
        history.append({"role": "user", "content": content})
        start = time.perf_counter()
        ttft, parts, usage = None, [], None
        stream = client.chat.completions.create(model=model, messages=history, stream=True,
                                                max_tokens=args.max_tokens, temperature=0,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            usage = chunk.usage or usage
            if not chunk.choices:
                continue
            if ttft is None:  # the first token's chunk (its text may be empty: special tokens)
                ttft = time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content or "")
        answer = "".join(parts)
        total = time.perf_counter() - start
        ttft_ms = f"{ttft * 1e3:.1f} ms" if ttft is not None else "n/a"
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None)
        tokens = f"{usage.prompt_tokens} prompt tokens ({cached} cached)" if usage else "usage n/a"
        print(f"turn {turn + 1}: time to first token {ttft_ms}, whole answer {total * 1e3:.1f} ms, "
              f"{tokens}: {answer[:60]!r}", flush=True)
        history.append({"role": "assistant", "content": answer})
    return 0


if __name__ == "__main__":
    sys.exit(main())
