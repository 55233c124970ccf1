"""The requests the speed modes send and how each is timed: a series of single requests, a
request's first token (streamed), 4-turn chats resending their image (with text-only twins),
concurrent clients through the engine's async API, and the warm-up that runs every path once."""

from __future__ import annotations

import asyncio
import time
from typing import Any, NamedTuple

from bench.lib.images import clip_data_url, image, user_message
from bench.lib.timing import summary


def timed(prompts: list[Any], pipe: Any, gen: Any) -> list[float]:
    walls = []
    for p in prompts:
        t = time.perf_counter()
        pipe(p, gen_config=gen)
        walls.append((time.perf_counter() - t) * 1e3)
    return walls


def first_token(pipe: Any, prompt: Any, gen: Any) -> tuple[float, Any]:
    """Time to the first streamed output (ms), and the whole response (the stream is drained)."""
    t = time.perf_counter()
    ttft, out = None, None
    for chunk in pipe.stream_infer([prompt], gen_config=gen):
        if ttft is None:
            ttft = (time.perf_counter() - t) * 1e3
        out = chunk if out is None else out.extend(chunk)
    assert ttft is not None and out is not None
    return ttft, out


def chat_turn(chat: int, turn: int, im: Any) -> dict[str, Any]:
    """The user message of ``turn`` in chat ``chat``: the image (or a video's content item, a dict)
    comes with the first one."""
    if turn == 0 and isinstance(im, dict):
        return dict(role="user", content=[dict(type="text", text=f"chat {chat}: describe this"), im])
    if turn == 0:
        return user_message(f"chat {chat}: describe this", im)
    return dict(role="user", content=f"and what about detail {turn}?")


class ChatSeries(NamedTuple):
    """Per turn (4 lists): time to first token (ms), cached and input prompt tokens; the last
    response; with ``twins``, the same for each chat's text-only twin."""

    walls: list[list[float]]
    cached: list[list[int]]
    input_tokens: list[list[int]]
    out: Any
    twin_walls: list[list[float]]
    twin_cached: list[list[int]]
    twin_input_tokens: list[list[int]]


def _ask(pipe: Any, hist: list[dict[str, Any]], gen: Any) -> tuple[float, Any]:
    """Time to first token (ms; the wall time when one token is asked for) and the response."""
    if gen.max_new_tokens == 1:
        t = time.perf_counter()
        out = pipe([hist], gen_config=gen)[0]
        return (time.perf_counter() - t) * 1e3, out
    return first_token(pipe, hist, gen)


def prompt_tokens(pipe: Any, hist: list[dict[str, Any]]) -> int:
    """Tokens of a text-only conversation's prompt, as lmdeploy renders and tokenises it."""
    eng = pipe.async_engine
    return len(eng.tokenizer.encode(eng.chat_template.messages2prompt(hist)))


def twin_first_message(pipe: Any, chat: int, tokens: int) -> dict[str, Any]:
    """A text-only first user message whose prompt is ``tokens`` long (or just under), made of
    words no other prompt uses: the image turn's length, without an image."""
    def msg(n: int) -> dict[str, Any]:
        return dict(role="user", content=f"chat {chat}: describe this "
                    + " ".join(f"t{chat}w{i}" for i in range(n)))

    lo, hi = 0, tokens
    while lo < hi:  # the longest message not over ``tokens``
        mid = (lo + hi + 1) // 2
        if prompt_tokens(pipe, [msg(mid)]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return msg(lo)


VIDEO_FPS = 4.0  # the clips of ``chats(video_s=...)``: lmdeploy samples 32 frames of them by default


def chats(pipe: Any, gen: Any, size: tuple[int, int], count: int, seed: int = 100,
          twins: bool = False, observe: Any = None, video_s: float = 0) -> ChatSeries:
    """``count`` 4-turn chats, each resending its image (in its first user message) every turn:
    time to first token (ms), cached and input prompt tokens per turn. With one new token the
    time is the request's wall time; with more, the first token's, by streaming.

    ``twins``: after each chat, its text-only twin through the same engine: a first message as
    many tokens long as the image turn's prompt (no image), then the same user turns and the same
    answers, so that every turn has the chat's cached and new token counts (both recorded): what
    lmdeploy itself spends on such a prompt (issue 15's reference).

    ``observe(kind, turn, ms, response)``, kind "chat" or "twin": called after every request
    (``breakdown`` reads its stage timers there). ``video_s``: each chat is about a clip of that
    many seconds (``size``, ``VIDEO_FPS``, an MP4 data URL) instead of an image (issue 52)."""
    walls: list[list[float]] = [[] for _ in range(4)]
    cached: list[list[int]] = [[] for _ in range(4)]
    lens: list[list[int]] = [[] for _ in range(4)]
    t_walls: list[list[float]] = [[] for _ in range(4)]
    t_cached: list[list[int]] = [[] for _ in range(4)]
    t_lens: list[list[int]] = [[] for _ in range(4)]
    out = None

    def ask(kind: str, turn: int, hist: list[dict[str, Any]], into: tuple[list[list[Any]], ...]) -> Any:
        """One turn: its time, cached and input tokens into ``into``'s lists for the turn."""
        ms, response = _ask(pipe, hist, gen)
        if observe is not None:
            observe(kind, turn, ms, response)
        for series, value in zip(into, (ms, response.cached_tokens, response.input_token_len), strict=True):
            series[turn].append(value)
        return response

    for c in range(count):
        im = (image(seed + c, size) if not video_s else
              dict(type="video_url", video_url=dict(url=clip_data_url(
                  seed + c, frames=max(1, round(video_s * VIDEO_FPS)), size=size, fps=VIDEO_FPS))))
        hist: list[dict[str, Any]] = []
        answers = []
        for turn in range(4):
            hist.append(chat_turn(seed + c, turn, im))
            out = ask("chat", turn, hist, (walls, cached, lens))
            answers.append(out.text or "x")
            hist.append(dict(role="assistant", content=answers[-1]))
        if not twins:
            continue
        hist = [twin_first_message(pipe, seed + c, lens[0][-1])]
        for turn in range(4):
            if turn:
                hist.append(chat_turn(seed + c, turn, None))
            ask("twin", turn, hist, (t_walls, t_cached, t_lens))
            hist.append(dict(role="assistant", content=answers[turn]))
    return ChatSeries(walls, cached, lens, out, t_walls, t_cached, t_lens)


def warm(pipe: Any, gen: Any, size: tuple[int, int], clients: int = 4) -> None:
    """Every path the series take, once, before anything is timed: misses, a hit in a fresh
    context, a 2-turn chat, a short concurrent burst."""
    ims = [image(900 + i, size) for i in range(3)]
    timed([(f"warm {i}", im) for i, im in enumerate(ims + ims[:1])], pipe, gen)
    hist = [chat_turn(900, 0, ims[1])]
    pipe([hist], gen_config=gen)
    pipe([hist + [dict(role="assistant", content="ok"), chat_turn(900, 1, ims[1])]], gen_config=gen)
    concurrent(pipe, [(f"warm client {i}", ims[i % 3]) for i in range(2 * clients)], gen,
                clients=clients, session_base=90_000)



def concurrent(pipe: Any, prompts: list[Any], gen: Any, clients: int,
                session_base: int = 10_000) -> dict[str, Any]:
    """``clients`` concurrent sessions through the engine's async API; TTFT per request."""
    engine = pipe.async_engine
    ttfts: list[float] = []

    async def one(i: int, prompt: Any) -> None:
        t = time.perf_counter()
        request = await engine.preprocess([user_message(*prompt)], session_id=session_base + i,
                                          gen_config=gen)
        first = True
        async for _ in engine.generate(request, stream_response=True):
            if first:
                ttfts.append((time.perf_counter() - t) * 1e3)
                first = False

    async def main() -> float:
        sem = asyncio.Semaphore(clients)

        async def gated(i: int, p: Any) -> None:
            async with sem:
                await one(i, p)

        t = time.perf_counter()
        await asyncio.gather(*(gated(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t

    wall = pipe._run(coro=main()).result()  # on the pipeline's own event-loop thread
    return {**summary(ttfts), "requests_per_s": round(len(prompts) / wall, 2), "wall_s": round(wall, 2),
            "clients": clients, "ttft_ms": [round(x, 2) for x in ttfts]}

