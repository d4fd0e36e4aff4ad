"""What a deployment refused is dropped or converted from then on, once, never looping."""

from __future__ import annotations

import asyncio
from typing import Any

from app.upstream.negotiation import Negotiation, without_keywords
from app.upstream.providers import PROVIDERS
from app.upstream.providers.base import ErrorInfo

BODY: dict[str, Any] = {
    "model": "m",
    "messages": [],
    "temperature": 0.0,
    "max_completion_tokens": 120,
    "safety_identifier": "s",
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "strict": True,
            "schema": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"additionalProperties": {"type": "string", "additionalProperties": False}},
            },
        },
    },
}


def test_a_refused_parameter_is_dropped_and_a_token_cap_converted() -> None:
    n = Negotiation("d/m")
    assert n.apply(BODY) is BODY  # nothing refused yet: the body as it is
    assert n.learn("temperature") and n.learn("max_completion_tokens")
    body = n.apply(BODY)
    assert "temperature" not in body and body["max_tokens"] == 120 and "max_completion_tokens" not in body
    assert BODY["temperature"] == 0.0  # the shared body is never changed


def test_a_schema_keyword_is_dropped_at_every_level_but_property_names_stay() -> None:
    n = Negotiation("d/m")
    assert n.learn("response_format.json_schema.additionalProperties") is True
    schema = n.apply(BODY)["response_format"]["json_schema"]["schema"]
    assert "additionalProperties" not in schema
    assert schema["properties"]["additionalProperties"] == {"type": "string"}
    assert without_keywords([{"strict": 1}], {"strict"}) == [{}]


def test_each_parameter_is_given_up_once_and_only_optional_ones() -> None:
    n = Negotiation("d/m")
    assert n.learn("safety_identifier") is True
    assert n.learn("safety_identifier") is False  # a second 400 naming it is not about it
    assert n.learn("messages") is False and n.learn("model") is False


def test_the_400_wordings_of_each_provider_name_the_parameter() -> None:
    openai = PROVIDERS["openai"]
    said = "Unsupported parameter: 'temperature' is not supported with this model."
    assert openai.refused_parameter(400, ErrorInfo(message=said)) == "temperature"
    gemini = PROVIDERS["gemini"]
    body = [
        {
            "error": {
                "code": 400,
                "message": (
                    'Invalid JSON payload received. Unknown name "safety_identifier": Cannot find field.'
                ),
                "status": "INVALID_ARGUMENT",
            }
        }
    ]
    assert gemini.refused_parameter(400, gemini.error_info(body)) == "safety_identifier"
    assert openai.refused_parameter(429, ErrorInfo(message=said)) is None
    assert openai.refused_parameter(400, ErrorInfo(message="Invalid image.")) is None


async def test_one_call_finds_out_while_calls_of_the_same_parameters_wait_for_it() -> None:
    n = Negotiation("d/m")
    names = n.names_in(BODY)
    assert {"temperature", "safety_identifier", "strict", "additionalProperties"} <= names
    trial, waited = await n.turn(names, wait_s=30.0)
    assert trial is not None and waited == "none"
    follower = asyncio.create_task(n.turn(names, wait_s=30.0))
    await asyncio.sleep(0)
    assert not follower.done()  # it waits for the trial's answer
    assert n.learn("temperature")  # the trial was refused: it ends, the follower looks again
    n.end(trial)
    second, waited = await follower
    assert second is not None and waited == "answered"  # still unanswered names: its turn
    third = asyncio.create_task(n.turn(names, wait_s=30.0))
    await asyncio.sleep(0)
    n.accept(names - {"temperature"})  # a 2xx: every name answered, the waiter goes at once
    assert await third == (None, "answered")
    assert await n.turn(names, wait_s=30.0) == (None, "none")


async def test_a_trial_that_ends_without_an_answer_hands_the_turn_on_and_a_wait_is_bounded() -> None:
    n = Negotiation("d/m")
    names = frozenset({"temperature"})
    trial, _ = await n.turn(names, wait_s=30.0)
    assert trial is not None
    assert await n.turn(names, wait_s=0.0) == (None, "timed_out")  # goes as it is
    waiter = asyncio.create_task(n.turn(names, wait_s=30.0))
    await asyncio.sleep(0)
    n.end(trial)  # a 5xx, a timeout, a cancel: no answer, the next call tries
    nxt, waited = await waiter
    assert nxt is not None and waited == "answered"
    # Other parameters do not wait for it, nor does a model whose outcomes are known.
    assert (await n.turn(frozenset({"top_p"}), wait_s=30.0))[0] is not None
    assert await Negotiation("d/m", settled=True).turn(names, wait_s=30.0) == (None, "none")
