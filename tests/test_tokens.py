from __future__ import annotations

from typing import Any

import pytest

from app.upstream.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    REPLY_PRIMING_TOKENS,
    estimate_chat_tokens,
    estimate_image_tokens,
    estimate_text_tokens,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", 0),
        ("a", 1),
        ("abcd", 1),
        ("hello world", 3),  # 11 ascii chars → ceil(11 / 4)
        ("안녕하세요", 5),  # one token per Hangul syllable
        ("abc 가", 2),  # 4 ascii → 1, plus 1 non-ascii
        ("페트병 label", 3 + 2),  # "페트병" + ceil(len(" label") / 4)
    ],
)
def test_text_estimate_is_quarter_ascii_plus_one_per_non_ascii(text: str, expected: int) -> None:
    assert estimate_text_tokens(text) == expected


def test_text_estimate_is_not_below_a_real_tokenizer_on_plain_english() -> None:
    # cl100k/o200k average ~4 ascii characters per token; never estimate fewer tokens than words.
    sentence = "Please sort this plastic bottle into the recycling bin."
    assert estimate_text_tokens(sentence) >= len(sentence.split())


@pytest.mark.parametrize(
    ("width", "height", "detail", "expected"),
    [
        (4096, 8192, "low", 85),  # low detail is flat, whatever the size
        (1024, 1024, "high", 765),  # → 768×768 → 4 tiles (OpenAI's documented example)
        (2048, 4096, "high", 1105),  # → 1024×2048 → 768×1536 → 6 tiles (documented example)
        (4032, 3024, "auto", 765),  # phone photo → 2048×1536 → 1024×768 → 4 tiles
        (1920, 1080, "high", 1105),  # → 1365×768 → 3×2 tiles
        (500, 300, "high", 255),  # small images are never upscaled → 1 tile
        (768, 2048, "high", 1445),  # worst case of the rule → 8 tiles
        (512, 512, "high", 255),  # exactly one tile, no float rounding into a second one
        (513, 512, "high", 425),
    ],
)
def test_image_estimate_follows_openai_tile_rule(width: int, height: int, detail: str, expected: int) -> None:
    assert estimate_image_tokens(width, height, detail) == expected


@pytest.mark.parametrize("detail", ["high", "auto", "HIGH", "something-new"])
def test_image_of_unknown_size_costs_the_worst_case(detail: str) -> None:
    assert estimate_image_tokens(None, None, detail) == 85 + 170 * 8
    assert estimate_image_tokens(0, 100, detail) == 1445


def test_chat_estimate_counts_overhead_text_and_image_parts() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "abcd"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "가나"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAA"}},
            ],
        },
    ]
    sizes = {"data:image/jpeg;base64,AAA": (1024, 1024)}
    expected = REPLY_PRIMING_TOKENS + 2 * MESSAGE_OVERHEAD_TOKENS + 1 + 2 + 765
    assert estimate_chat_tokens(messages, image_sizes=sizes) == expected


def test_chat_estimate_uses_worst_case_for_images_without_a_known_size() -> None:
    part = {"type": "image_url", "image_url": {"url": "https://x/y.jpg", "detail": "high"}}
    messages = [{"role": "user", "content": [part]}]
    assert estimate_chat_tokens(messages) == 3 + 4 + 1445


def test_chat_estimate_honours_low_detail_images() -> None:
    part = {"type": "image_url", "image_url": {"url": "https://x/y.jpg", "detail": "low"}}
    assert estimate_chat_tokens([{"role": "user", "content": [part]}]) == 3 + 4 + 85


def test_chat_estimate_adds_the_completion_budget() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert estimate_chat_tokens(messages, max_completion_tokens=500) == 3 + 4 + 1 + 500


def test_chat_estimate_counts_name_and_tool_call_arguments() -> None:
    messages = [
        {
            "role": "assistant",
            "content": None,
            "name": "bot1",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            ],
        }
    ]
    assert estimate_chat_tokens(messages) == 3 + 4 + 1 + 2 + 1


def test_chat_estimate_ignores_unknown_and_malformed_parts() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_audio"}, "stray", {"type": "text"}]},
        {"role": "user"},
    ]
    assert estimate_chat_tokens(messages) == 3 + 4 + 4


def test_chat_estimate_of_no_messages_is_the_reply_priming() -> None:
    assert estimate_chat_tokens([]) == REPLY_PRIMING_TOKENS
