"""Stage 3, answer: a streamed Chat Completions call that writes the guidance.

Streaming text *and* structure: the model streams JSON that follows a strict schema
(`user_answer`, then `steps`, then `insufficiencies`, generated in that order), and
we re-render the partial JSON as readable text as it grows. jiter's partial mode
parses an incomplete document (including a half-written last string), and because
fields arrive in schema order the rendering of a longer prefix always extends the
rendering of a shorter one, so each `delta` is just the new tail. The final JSON is
the structured answer. This needs nothing from the model beyond the schema, and
works the same against OpenAI and any compatible server.

A photo of several items (app/stages/items.py) is still one call: its prompt holds every
item and each distinct rule document once, and asks for what to separate first, then item
by item; the schema is the same, so the rendering and the parse are too. A photo of one
item sends exactly the single-item prompt.

Deltas are coalesced (`delta_flush_ms`): one SSE event per token would cost more
event-loop time than the answer is worth to a reader.

Retries: a call that fails after its first token starts again from nothing, on another
deployment when one can take it (app/upstream/client.py); the client gets a `discard`
event (what it showed of the answer is void) and then the new text's deltas. `done`
carries the answer as it was finally written.

Economy. The prompt puts what scans share first, for OpenAI's prompt cache: the system
prompt (after the schema, which OpenAI places before it), then the rule document, the
same for every scan of its category, then what this scan saw and asked. And a scan
without a question of its own gets the answer an identical request already got (the
reply cache, app/upstream/reply_cache.py): the key is a digest of the whole request — model,
parameters, schema, classification, item, tags (sorted), the rule document as sent.
The rule's content is in the key, so a changed rule (NOTIFY clears the rule cache, the
next scan reads the new document) can never be answered from the old one. The cached
text reaches the client as a `delta` of its whole rendering, then as usual.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import jiter
import orjson
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from app.errors import UpstreamBadResponse
from app.stages.base import StageEnv, StageResult
from app.stages.context import ScanContext
from app.stages.rule import DisposalRules, RuleResult
from app.stages.vision import VisionResult
from app.upstream.call import ChatRequest, ChatResult
from app.upstream.client import Upstream
from app.upstream.reply_cache import ReplyCache, request_digest
from app.upstream.stage_call import StageCall
from app.upstream.tokens import estimate_text_tokens

ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "user_answer": {
            "type": "string",
            "description": "사용자 질문에 대한 한두 문장의 답 또는 핵심 요약",
        },
        "steps": {
            "type": "array",
            "items": {"type": "string"},
            "description": "배출 단계, 순서대로",
        },
        "insufficiencies": {
            "type": "array",
            "items": {"type": "string"},
            "description": "사진의 상태로 보아 사용자가 배출 전에 아직 해야 하는 일만",
        },
    },
    "required": ["user_answer", "steps", "insufficiencies"],
    "additionalProperties": False,
}

SYSTEM_PROMPT = (
    "당신은 한국 생활폐기물 분리배출 안내 도우미입니다. 주어진 분류, 상황 태그, 배출 규칙만 "
    "근거로 짧고 정확하게 답하세요. user_answer: 사용자의 질문에 대한 답(질문이 없으면 핵심 "
    "요약), steps: 지금 따라 할 배출 단계, insufficiencies: 상황 태그로 보아 배출 전에 "
    "사용자가 아직 해야 하는 일만(이미 준비됐으면 빈 배열)."
)

# A photo of several items (app/stages/items.py): still one call, whose prompt holds every
# item and each distinct rule document once; the same schema, its steps item by item.
ITEMS_SYSTEM_PROMPT = (
    "당신은 한국 생활폐기물 분리배출 안내 도우미입니다. 사진에는 여러 품목이 있습니다. 주어진 "
    "품목별 분류, 상황 태그, 배출 규칙만 근거로 짧고 정확하게 답하세요. user_answer: 사용자의 "
    "질문에 대한 답(질문이 없으면 무엇을 먼저 분리해 어디에 버리는지 요약), steps: 먼저 떼어 "
    "분리할 것부터 품목 순서대로, 각 단계는 '품목 이름: 할 일' 형식, insufficiencies: 상황 "
    "태그로 보아 배출 전에 사용자가 아직 해야 하는 일만(이미 준비됐으면 빈 배열)."
)

EmitDelta = Callable[[str], Awaitable[None]]


def render(answer: dict[str, Any]) -> str:
    """Readable text of a (possibly partial) answer document; prefix-stable as it grows."""
    out = str(answer.get("user_answer") or "")
    steps = [s for s in answer.get("steps") or [] if isinstance(s, str)]
    if steps:
        out += "\n\n" + "\n".join(f"{i}. {s}" for i, s in enumerate(steps, 1))
    missing = [s for s in answer.get("insufficiencies") or [] if isinstance(s, str)]
    if missing:
        out += "\n\n배출 전에 확인하세요:\n" + "\n".join(f"- {s}" for s in missing)
    return out


class _DeltaWriter:
    """Turns the growing JSON text of the current attempt into coalesced deltas."""

    def __init__(self, emit: EmitDelta, discard: Callable[[], Awaitable[None]], flush_s: float) -> None:
        self._emit = emit
        self._discard = discard
        self._flush_s = flush_s
        self._last_flush = 0.0
        self.sent = ""

    async def restart(self) -> None:
        """The call starts again from nothing: what the client saw of it is void (a
        `discard` event, only if it saw any), and the new text is sent from its start."""
        if self.sent:
            self.sent, self._last_flush = "", 0.0  # the new text's first delta goes at once
            await self._discard()

    async def update(self, raw: str, *, final: bool = False) -> float:
        """Send what `raw` adds to the rendering, at most every `flush_s` (unless `final`);
        returns how long until it would send again, for the reader to let the tokens of
        that time pile up: 0 while there is nothing new to show, so the first text goes
        out as soon as there is some."""
        now = time.perf_counter()
        if not final and (wait_s := self._last_flush + self._flush_s - now) > 0:
            return wait_s
        try:
            partial = jiter.from_json(raw.encode(), partial_mode="trailing-strings")
        except ValueError:
            return 0.0  # not even a JSON prefix yet (or garbage: the final parse reports it)
        if not isinstance(partial, dict):
            return 0.0
        text = render(partial)
        # The rendering of a longer prefix extends that of a shorter one (module docstring).
        if text.startswith(self.sent) and len(text) > len(self.sent):
            delta, self.sent = text[len(self.sent) :], text
            self._last_flush = now
            await self._emit(delta)
            return self._flush_s
        return 0.0


class Answer(BaseModel):
    model_config = ConfigDict(frozen=True)

    steps: list[str]
    insufficiencies: list[str] = Field(description="What the user still has to do.")
    user_answer: str


class AnswerResult(StageResult):
    """The guidance is written (the `delta` texts were its rendering)."""

    answer: Answer
    # The call behind it (usage, queue time); None when the cache or another scan's call served it.
    _call: ChatResult | None = PrivateAttr(default=None)

    def served_by(self) -> str | None:
        return self._call.upstream if self._call is not None else None

    def queue_seconds(self) -> float:
        return self._call.queue_s if self._call is not None else 0.0


class AnswerStage:
    name = "answer"
    label = "안내 작성"
    progress_share = 45
    upstream_calls = 1
    streams_text = True
    result_type = AnswerResult
    call = StageCall("answer")  # the model's default sampling; the rest is ANSWER_* (`Settings.stage_call`)

    @classmethod
    async def start(cls, env: StageEnv) -> AnswerStage:
        call = env.call(cls.name)
        flush_s = env.settings.delta_flush_ms / 1000
        return cls(env.upstream, call, delta_flush_s=flush_s, cache=env.reply_cache(call.stage))

    def __init__(
        self,
        upstream: Upstream,
        call: StageCall,
        *,
        delta_flush_s: float,
        cache: ReplyCache | None = None,
    ) -> None:
        self.timeout_s = call.timeout_s
        self._upstream = upstream
        self._cache = cache
        self._delta_flush_s = delta_flush_s
        self._response_format = {
            "type": "json_schema",
            "json_schema": {"name": "disposal_answer", "strict": True, "schema": ANSWER_SCHEMA},
        }
        # The schema is part of the prompt OpenAI counts; constant, so priced once.
        self._schema_tokens = estimate_text_tokens(json.dumps(self._response_format, ensure_ascii=False))
        # What shapes every request but its messages: the models that may answer it, the schema.
        self._request_shape = request_digest(upstream.models(self.name), self._response_format)

    def build_request(
        self, vision: VisionResult, rule: RuleResult, user_input: str | None, safety_id: str | None = None
    ) -> ChatRequest:
        if len(vision.items) > 1:
            system, facts = ITEMS_SYSTEM_PROMPT, _items_facts(vision, rule, user_input)
        else:
            c = vision.classification
            # The rule first: every scan of its category sends it (see the module docstring).
            system, facts = (
                SYSTEM_PROMPT,
                {
                    "배출 규칙": _condensed(rule.disposal_rules) if rule.disposal_rules else rule.reason,
                    "분류": {"대분류": c.major, "중분류": c.middle, "품목": c.minor or vision.item_name},
                    "상황 태그": sorted(vision.situation_tags),
                    "사용자 질문": user_input or "(없음)",
                },
            )
        messages = [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": orjson.dumps(facts).decode(),  # compact, non-ASCII as it is
            },
        ]
        return ChatRequest(
            self.name,
            messages,
            response_format=self._response_format,
            safety_identifier=safety_id,
            extra_prompt_tokens=self._schema_tokens,
        )

    def cache_key(self, request: ChatRequest) -> str:
        return request_digest(self._request_shape, request.messages)

    async def run(self, ctx: ScanContext) -> AnswerResult:
        writer = _DeltaWriter(ctx.emit_delta, ctx.discard_text, self._delta_flush_s)
        user_input = ctx.scan.input.user_input
        request = self.build_request(
            ctx.result(VisionResult), ctx.result(RuleResult), user_input, ctx.safety_id
        )
        made: list[ChatResult] = []

        async def write() -> str:
            # Deltas go out at most every `delta_flush_s`, and the stream is read when the
            # next may go: the tokens of the meantime are parsed in one wake-up.
            made.append(
                await self._upstream.stream(
                    request, deadline=ctx.current_deadline, on_text=writer.update, on_restart=writer.restart
                )
            )
            await writer.update(made[0].text, final=True)
            parse_answer(made[0].text)  # an unusable reply raises here: never kept, never shared
            return made[0].text

        if self._cache is None or user_input:
            text = await write()
        else:
            text = await self._cache.get_or_call(self.cache_key(request), write)
        # From the cache or another scan's call: the whole rendering as one delta (after a
        # call of this scan's own, everything was sent already and this sends nothing).
        await writer.update(text, final=True)
        result = AnswerResult(answer=parse_answer(text))
        if made:
            result._call = made[0]
        return result


def parse_answer(text: str) -> Answer:
    try:
        doc = orjson.loads(text)
        user_answer = doc["user_answer"]
        steps = doc["steps"]
        missing = doc["insufficiencies"]
    except (ValueError, KeyError, TypeError):
        raise UpstreamBadResponse("The answer was not the expected JSON.") from None
    if not (isinstance(user_answer, str) and _strings(steps) and _strings(missing)):
        raise UpstreamBadResponse("The answer JSON had fields of the wrong type.")
    return Answer(
        user_answer=user_answer.strip(),
        steps=[s.strip() for s in steps],
        insufficiencies=[s.strip() for s in missing],
    )


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _items_facts(vision: VisionResult, rule: RuleResult, user_input: str | None) -> dict[str, Any]:
    """The facts of a photo of several items: each distinct rule once (keyed by its
    category), then the items in order, each naming its rule's key."""
    by_index = {r.index: r for r in rule.item_rules}
    rules: dict[str, Any] = {}
    items: list[dict[str, Any]] = []
    for item in vision.items:
        c = item.classification
        key = f"{c.major} > {c.middle}" if c.middle else c.major
        found = by_index.get(item.index)
        if found is not None and key not in rules:
            rules[key] = _condensed(found.disposal_rules) if found.disposal_rules else found.reason
        entry = {
            "번호": item.index + 1,
            "분류": {"대분류": c.major, "중분류": c.middle, "품목": c.minor or item.item_name},
            "상황 태그": sorted(item.situation_tags),
            "규칙": key,
        }
        if item.main:
            entry["주 품목"] = True
        items.append(entry)
    return {"배출 규칙": rules, "품목들": items, "사용자 질문": user_input or "(없음)"}


def _condensed(rules: DisposalRules) -> dict[str, Any]:
    """The parts of a rule document the answer is written from. Every token here is paid
    on every scan (and counted against TPM): titles, tips and the not-accepted list are
    left out; the client gets the whole document in the `rule` event anyway."""
    return {"summary": rules.summary, "preparation": rules.preparation, "disposal": rules.disposal}
