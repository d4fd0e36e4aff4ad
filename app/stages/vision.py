"""Stage 1, vision: one Chat Completions call that finds the photo's items and classifies
each (up to `MAX_ITEMS`; app/stages/items.py has the reply's shape and its checks).

The reply is constrained by a json_schema whose enums come from the taxonomy
(see `Taxonomy.vision_schema`, one item's object), so the model can only name categories
and tags we know. The image is our prepared JPEG data URL (or the client's https URL as
is). The main item fills today's single-item fields; the stage tells the stream how many
items it found (an `items` event) and, for a photo of several, each one (`item` events)
before it completes.

Economy. The request is laid out for OpenAI's prompt cache: what every scan sends
(schema, system prompt, instruction) first, then the photo, then the user's note, so
the same photo with another note still reuses the cached prefix. And a photo already
classified is not sent again: the reply cache (app/upstream/reply_cache.py) keys the reply by a
SHA-256 of the prepared image as sent (the CPU lane's JPEG: re-encoded, or the upload
itself when it passes as it came), the note and everything else that shapes the request
(model, parameters, detail, schema — the taxonomy — and the prompt); concurrent scans of
one new photo share one call.
Scans of an https URL are not cached: what the model's server fetches there may change.
No perceptual hash either: a near-duplicate is not the same photo (another angle, a
label now peeled off), and a wrong classification served from memory costs more than
a call.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from pydantic import Field, PrivateAttr

from app.db.taxonomy import Classification, Taxonomy
from app.errors import UpstreamBadResponse
from app.stages.base import StageEnv, StageResult
from app.stages.context import ScanContext, ScanInput
from app.stages.items import MAX_ITEM_CHARS, MAX_TAGS, FoundItem, FoundItems, items_schema, parse_items
from app.upstream.call import ChatRequest, ChatResult
from app.upstream.client import Upstream
from app.upstream.reply_cache import ReplyCache, request_digest
from app.upstream.stage_call import StageCall
from app.upstream.tokens import estimate_text_tokens

__all__ = ["MAX_ITEM_CHARS", "MAX_TAGS", "VisionResult", "VisionStage"]
# A prepared photo at the default IMAGE_LONG_SIDE (4:3): what admission prices a new scan at.
TYPICAL_IMAGE_SIZE = (768, 576)

# Today's single-item prompt: what k6/lean_floor.py's one-item floor sends.
SYSTEM_PROMPT = (
    "당신은 한국 생활폐기물 분리배출 분류기입니다. 사진 속 주된 품목 하나의 category를 "
    "고르고(판단할 수 없으면 '미분류'), item에 품목 이름을 짧은 명사로 쓰세요(예: 우유팩). "
    "situation_tags에는 사진에 보이는 상태 중 배출 방법에 영향을 주는 것만 고르세요."
)
# The reply names items (app/stages/items.py): what to look for, and how boxes are measured.
ITEMS_PROMPT = (
    "당신은 한국 생활폐기물 분리배출 분류기입니다. 사진 속에서 따로 배출해야 하는 품목을 "
    "최대 {max_items}개까지 items에 나열하세요. 붙어 있어도 재질이 달라 따로 배출하는 부분"
    "(라벨, 뚜껑, 내용물 등)은 별도 품목입니다. 품목마다 category를 고르고(판단할 수 없으면 "
    "'미분류'), item에 품목 이름을 짧은 명사로 쓰고, situation_tags에는 그 품목에 보이는 상태 중 "
    "배출 방법에 영향을 주는 것만 고르세요. box는 이미지 너비와 높이에 대한 비율(0~1)로 왼쪽 위 "
    "x, y와 width, height이며, 위치를 알 수 없으면 null입니다. main_item은 사진의 주된 품목의 "
    "items 번호(0부터)입니다."
)
INSTRUCTION = "이 물건을 분류해 주세요."
MEMO_PREFIX = "사용자 메모: "


class VisionResult(StageResult):
    """The vision stage classified the photo's items; the single-item fields are the main one's."""

    classification: Classification
    item_name: str = Field(description="The model's own words for the item.")
    situation_tags: list[str]
    items: list[FoundItem] = Field(
        description="Every item found (at most MAX_ITEMS), the main one among them."
    )
    items_dropped: int = Field(
        description="Items the model named that were left out: past MAX_ITEMS, or outside the taxonomy."
    )
    # The call behind it (usage, queue time); an empty one when the cache or another
    # scan's call served it.
    _call: ChatResult = PrivateAttr(default_factory=ChatResult)

    def served_by(self) -> str | None:
        return self._call.upstream

    def queue_seconds(self) -> float:
        return self._call.queue_s


class VisionStage:
    name = "vision"
    label = "사진 분석"
    progress_share = 25
    upstream_calls = 1
    streams_text = False
    result_type = VisionResult
    # A classifier should give the same photo the same label (dropped where the model only
    # takes the default); the rest is VISION_* (`Settings.stage_call`).
    call = StageCall("vision", temperature=0.0, detail="low")

    @classmethod
    async def start(cls, env: StageEnv) -> VisionStage:
        call = env.call(cls.name)
        return cls(
            env.upstream,
            env.taxonomy,
            call,
            max_items=env.settings.max_items,
            cache=env.reply_cache(call.stage),
        )

    def __init__(
        self,
        upstream: Upstream,
        taxonomy: Taxonomy,
        call: StageCall,
        *,
        max_items: int = 1,
        cache: ReplyCache | None = None,
    ) -> None:
        self.timeout_s = call.timeout_s
        self._max_items = max_items
        self._system_prompt = ITEMS_PROMPT.format(max_items=max_items)
        self._upstream = upstream
        self._cache = cache
        self._taxonomy = taxonomy
        self._detail = call.detail or "low"
        self._response_format = {
            "type": "json_schema",
            "json_schema": {
                "name": "waste_classification",
                "strict": True,
                "schema": items_schema(taxonomy),
            },
        }
        # The schema is part of the prompt OpenAI counts; constant, so priced once.
        self._schema_tokens = estimate_text_tokens(json.dumps(self._response_format, ensure_ascii=False))
        # Asked on every admission: what a typical call (an uploaded photo, no note) would
        # reserve on each route; its prompt priced once, what the limiter charges for it
        # as learned at the time of asking.
        typical = ChatRequest(
            self.name,
            self._messages(ScanInput("upload", "<photo>", None)),
            image_sizes={"<photo>": TYPICAL_IMAGE_SIZE},
            extra_prompt_tokens=self._schema_tokens,
        )
        self._typical_prompt = {
            route.name: route.estimate(typical) for route in upstream.routes_for(self.name)
        }
        # What shapes every request but the photo and the note, laid out as sent: the
        # models that may answer it, the schema, the prompt.
        template = self._messages(ScanInput("upload", "<photo>", "<note>"))
        self._request_shape = request_digest(upstream.models(self.name), self._response_format, template)

    def build_request(self, scan: ScanInput, *, safety_id: str | None = None) -> ChatRequest:
        sizes = {scan.image_url: (scan.image.width, scan.image.height)} if scan.image else None
        return ChatRequest(
            self.name,
            self._messages(scan),
            response_format=self._response_format,
            safety_identifier=safety_id,
            image_sizes=sizes,
            extra_prompt_tokens=self._schema_tokens,
        )

    def _messages(self, scan: ScanInput) -> list[dict[str, Any]]:
        """Static parts first, the photo, then the note (see the module docstring)."""
        content: list[dict[str, Any]] = [
            {"type": "text", "text": INSTRUCTION},
            {"type": "image_url", "image_url": {"url": scan.image_url, "detail": self._detail}},
        ]
        if scan.user_input:
            content.append({"type": "text", "text": MEMO_PREFIX + scan.user_input})
        return [{"role": "system", "content": self._system_prompt}, {"role": "user", "content": content}]

    def cache_key(self, scan: ScanInput) -> str | None:
        """The reply cache's key for this scan's request; None for an https URL."""
        if scan.image is None:
            return None
        # The prepared bytes as sent, hashed in the CPU lane with the preparation.
        return request_digest(self._request_shape, scan.image.prepared_sha256, scan.user_input)

    def predicted_budget_wait(self, owed_calls: int) -> float:
        """How long a new scan's vision call would wait for the budget: admission's test."""
        return self._upstream.predicted_wait(
            self.name,
            lambda route: route.limiter_tokens(self._typical_prompt[route.name], "image"),
            ahead=owed_calls,
        )

    async def run(self, ctx: ScanContext) -> VisionResult:
        scan = ctx.scan.input
        made: list[ChatResult] = []

        async def classify() -> str:
            request = self.build_request(scan, safety_id=ctx.safety_id)
            made.append(await self._upstream.complete(request, deadline=ctx.current_deadline))
            self.parse(made[0].text)  # an unusable reply raises here: never kept, never shared
            return made[0].text

        key = None if self._cache is None else self.cache_key(scan)
        if key is None or self._cache is None:
            text = await classify()
        else:
            text = await self._cache.get_or_call(key, classify)
        # The prepared image (~100 KB of base64) is only needed by this call; with
        # thousands of scans in flight, holding it through the answer adds up.
        ctx.scan.input = scan.without_image()
        found = self.parse(text)
        main = found.main
        result = VisionResult(
            classification=main.classification,
            item_name=main.item_name,
            situation_tags=main.situation_tags,
            items=found.items,
            items_dropped=found.dropped,
        )
        if made:  # served by the cache or by another scan's call, this scan made none: no usage
            result._call = made[0]
        await announce(ctx, found)
        return result

    def parse(self, text: str) -> FoundItems:
        try:
            reply = orjson.loads(text)
        except ValueError:
            raise UpstreamBadResponse("The classification reply was not the expected JSON.") from None
        return parse_items(reply, self._taxonomy, self._max_items)


async def announce(ctx: ScanContext, found: FoundItems) -> None:
    """How many items the photo holds (`items`), then each of several (`item`): a photo of
    one streams today's events and the count, its item being the stage's own fields."""
    main = found.main.index
    await ctx.emit_item("items", {"count": len(found.items), "main": main, "dropped": found.dropped})
    if len(found.items) > 1:
        for item in found.items:
            await ctx.emit_item("item", item.model_dump(mode="json"))
