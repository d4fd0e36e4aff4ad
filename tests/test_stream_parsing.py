"""Our reading of the Chat Completions event stream, fed awkwardly split bytes."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Mapping

import aiohttp
import pytest
from aiohttp.base_protocol import BaseProtocol

from app.upstream.call import AttemptFailed, ChatResult
from app.upstream.endpoint import StallWatch, until_eof
from app.upstream.wire import read_chunks, read_completion


def sse(chunk: Mapping[str, object]) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


def content(piece: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish}]}


async def feed(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("size", [1, 3, 7, 64, 10_000])
async def test_chunks_split_anywhere_give_the_same_text_and_usage(size: int) -> None:
    body = (
        b": keepalive\n\n"
        + sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        + sse(content("분리"))
        + sse(content("배출 "))
        + sse(content("하세요", "stop"))
        + sse({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}})
        + b"data: [DONE]\n\n"
    )
    seen: list[str] = []

    async def on_text(text: str) -> float:
        seen.append(text)
        return 0.0

    result = ChatResult()
    usage = await read_chunks(on_text, feed(body, size), asyncio.sleep, result)
    assert usage == (12, 3, 0, 0)
    assert result.text == "분리배출 하세요"
    # After each read, the text so far: once per piece when the pieces come one by one.
    assert seen[-1] == "분리배출 하세요"
    assert all(a != b and b.startswith(a) for a, b in itertools.pairwise(seen))
    if size <= 7:
        assert seen == ["분리", "분리배출 ", "분리배출 하세요"]
    assert result.finish_reason == "stop"


async def test_the_reader_pauses_as_long_as_the_consumer_asks_and_nothing_is_lost() -> None:
    pulls: list[float] = []
    pauses: list[float] = []
    loop = asyncio.get_running_loop()

    async def timed(data: bytes) -> AsyncIterator[bytes]:
        async for piece in feed(data, 40):
            pulls.append(loop.time())
            yield piece

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        await asyncio.sleep(seconds)

    async def every_other(text: str) -> float:
        return 0.02 if len(text) % 2 else 0.0  # a pause after odd lengths only

    pieces = [sse(content(str(i))) for i in range(9)] + [sse(content("!", "stop")), b"data: [DONE]\n\n"]
    result = ChatResult()
    await read_chunks(every_other, timed(b"".join(pieces)), pause, result)
    assert result.text == "012345678!"
    assert pauses and all(p == 0.02 for p in pauses)
    assert len(pulls) > len(pauses) + 1  # no pause after a 0, nor after the end
    assert sum(b - a >= 0.019 for a, b in itertools.pairwise(pulls)) >= len(
        pauses
    )  # a timer may fire a hair early


async def test_an_error_inside_the_stream_is_a_retryable_failure() -> None:
    body = sse(content("a")) + sse({"error": {"message": "overloaded"}})

    with pytest.raises(AttemptFailed) as failed:
        await read_chunks(ignore, feed(body, 5), asyncio.sleep, ChatResult())
    assert failed.value.retry and failed.value.reason == "stream_error"


async def ignore(_text: str) -> float:
    return 0.0


async def test_a_chunk_that_is_not_json_is_a_retryable_bad_chunk() -> None:
    body = sse(content("a")) + b"data: not json\n\n" + sse(content("b", "stop")) + b"data: [DONE]\n\n"
    with pytest.raises(AttemptFailed) as failed:
        await read_chunks(ignore, feed(body, 4096), asyncio.sleep, ChatResult())
    assert failed.value.retry and failed.value.reason == "bad_chunk"


@pytest.mark.parametrize(
    "odd",
    [
        b"[1, 2]",
        json.dumps(content(12)).encode(),  # type: ignore[arg-type]
        json.dumps({"choices": [{"index": 0, "delta": {"refusal": ["no"]}}]}).encode(),
        json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": 5}]}).encode(),
        json.dumps({"choices": ["a"]}).encode(),
        json.dumps({"choices": [{"index": 0, "delta": "a"}]}).encode(),
        json.dumps({"choices": [], "usage": {"prompt_tokens": "many"}}).encode(),
        json.dumps({"choices": [], "usage": {"prompt_tokens": "12"}}).encode(),
        json.dumps({"choices": [], "usage": {"prompt_tokens": -3, "completion_tokens": 1}}).encode(),
        json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1.5}}).encode(),
        json.dumps({"choices": [], "usage": {"prompt_tokens": True}}).encode(),
        json.dumps({"choices": [], "usage": {"prompt_tokens": 10**12}}).encode(),
        json.dumps({"choices": [], "usage": [1]}).encode(),
    ],
)
async def test_a_chunk_of_another_shape_fails_the_call_without_a_retry(odd: bytes) -> None:
    """Valid JSON that is not a chunk: never a crash of our own, and not retried (the
    same server would answer the same way, and each attempt is billed)."""
    body = sse(content("a")) + b"data: " + odd + b"\n\n" + sse(content("b", "stop")) + b"data: [DONE]\n\n"
    with pytest.raises(AttemptFailed) as failed:
        await read_chunks(ignore, feed(body, 4096), asyncio.sleep, ChatResult())
    assert not failed.value.retry and failed.value.reason == "bad_shape"


async def test_refusal_pieces_are_collected_apart_from_content() -> None:
    refusal = {"choices": [{"index": 0, "delta": {"content": None, "refusal": "I can't"}}]}
    tail = {"choices": [{"index": 0, "delta": {"refusal": " help."}, "finish_reason": "stop"}]}
    usage = {
        "prompt_tokens": 2048,
        "completion_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 1920},
        "completion_tokens_details": {"reasoning_tokens": 4},
    }
    body = sse(refusal) + sse(tail) + sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n"
    result = ChatResult()
    assert await read_chunks(ignore, feed(body, 6), asyncio.sleep, result) == (2048, 9, 4, 1920)
    assert (result.refusal, result.text, result.finish_reason) == ("I can't help.", "", "stop")


def stream_reader() -> aiohttp.StreamReader:
    loop = asyncio.get_running_loop()
    return aiohttp.StreamReader(BaseProtocol(loop), 2**16, loop=loop)


async def test_a_pause_ends_on_its_timer_or_at_once_when_the_stream_ends() -> None:
    loop = asyncio.get_running_loop()
    content = stream_reader()
    started = loop.time()
    await until_eof(content, 0.05)  # nothing ends it early
    assert loop.time() - started >= 0.04
    pausing = asyncio.create_task(until_eof(content, 30))
    await asyncio.sleep(0.01)
    content.feed_eof()
    async with asyncio.timeout(1):  # woken by the end, not after 30 s
        await pausing
    async with asyncio.timeout(1):  # ended already: no wait at all
        await until_eof(content, 30)


async def test_a_stall_watch_fails_a_body_only_after_a_whole_timeout_without_a_byte() -> None:
    loop = asyncio.get_running_loop()
    content = stream_reader()
    content._protocol.transport = object()  # type: ignore[assignment]  # "connected": reads may wait
    watch = StallWatch(content, 0.2)
    for _ in range(6):  # a byte every 0.1 s for 0.6 s: slow, never stalled
        await asyncio.sleep(0.1)
        content.feed_data(b".")
        assert content.exception() is None
    last_byte = loop.time()
    assert await content.readany() == b"......"
    async with asyncio.timeout(5):
        with pytest.raises(aiohttp.SocketTimeoutError):
            await content.readany()  # woken by the watch's error, not by a byte
    assert loop.time() - last_byte >= 0.2
    watch.stop()


async def test_a_stall_watch_leaves_an_ended_or_stopped_body_alone() -> None:
    ended = stream_reader()
    StallWatch(ended, 0.04)
    ended.feed_data(b"all of it")
    ended.feed_eof()
    stopped = stream_reader()
    StallWatch(stopped, 0.04).stop()
    await asyncio.sleep(0.2)
    assert await ended.read() == b"all of it" and ended.exception() is None
    assert stopped.exception() is None


def test_a_whole_reply_gives_its_first_choice_and_usage() -> None:
    result = ChatResult()
    reply = {
        "choices": [{"index": 0, "message": {"content": "{}", "refusal": None}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "completion_tokens_details": {"reasoning_tokens": 1},
        },
    }
    assert read_completion(json.dumps(reply).encode(), result) == (5, 2, 1, 0)
    assert (result.text, result.refusal, result.finish_reason) == ("{}", "", "stop")


@pytest.mark.parametrize("odd", [b"", b"not json", b'{"choices": [{"message"'])
def test_a_whole_reply_that_is_not_json_is_a_retryable_bad_body(odd: bytes) -> None:
    with pytest.raises(AttemptFailed) as failed:
        read_completion(odd, ChatResult())
    assert failed.value.retry and failed.value.reason == "bad_body"


@pytest.mark.parametrize(
    "odd",
    [
        b"[1]",
        b'"text"',
        b'{"choices": {"a": 1}}',
        b'{"choices": [{"message": "hello"}]}',
        b'{"choices": [{"message": {"content": 12}}]}',
        b'{"choices": [{"message": {"content": "{}", "refusal": ["no"]}}]}',
        b'{"choices": [{"message": {"content": "{}"}, "finish_reason": 5}]}',
        b'{"choices": [], "usage": {"prompt_tokens": "many"}}',
        b'{"choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": 2}}',
        b'{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens_details": [1]}}',
    ],
)
def test_a_whole_reply_of_another_shape_fails_the_call_without_a_retry(odd: bytes) -> None:
    with pytest.raises(AttemptFailed) as failed:
        read_completion(odd, ChatResult())
    assert not failed.value.retry and failed.value.reason == "bad_shape"
