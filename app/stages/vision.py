"""Stage 1, vision: one Chat Completions call that classifies the photo.

The reply is constrained by a json_schema whose enums come from the taxonomy
(see `Taxonomy.vision_schema`), so the model can only name categories and tags we
know. The image is our prepared JPEG data URL (or the client's https URL as is).
"""

from __future__ import annotations

import json
from typing import Any

from app.errors import UpstreamBadResponse
from app.limits.tokens import estimate_chat_tokens, estimate_text_tokens
from app.model_profiles import CallShape
from app.scan_context import ScanContext
from app.scan_input import ScanInput
from app.stages.results import VisionResult
from app.taxonomy import Classification, Taxonomy
from app.upstream import ChatCall, Upstream

MAX_TAGS = 8
MAX_ITEM_CHARS = 30
# A prepared photo at the default IMAGE_LONG_SIDE (4:3): what admission prices a new scan at.
TYPICAL_IMAGE_SIZE = (768, 576)

SYSTEM_PROMPT = (
    "당신은 한국 생활폐기물 분리배출 분류기입니다. 사진 속 주된 품목 하나의 category를 "
    "고르고(판단할 수 없으면 '미분류'), item에 품목 이름을 짧은 명사로 쓰세요(예: 우유팩). "
    "situation_tags에는 사진에 보이는 상태 중 배출 방법에 영향을 주는 것만 고르세요."
)


class VisionStage:
    name = "vision"
    progress_share = 25
    upstream_calls = 1

    def __init__(
        self, upstream: Upstream, taxonomy: Taxonomy, *, shape: CallShape, detail: str, timeout_s: float
    ) -> None:
        self.timeout_s = timeout_s
        self._upstream = upstream
        self._taxonomy = taxonomy
        self._shape = shape
        self._detail = detail
        self._response_format = {
            "type": "json_schema",
            "json_schema": {
                "name": "waste_classification",
                "strict": True,
                "schema": taxonomy.vision_schema(),
            },
        }
        # The schema is part of the prompt OpenAI counts; constant, so priced once.
        self._schema_tokens = estimate_text_tokens(json.dumps(self._response_format, ensure_ascii=False))
        # Asked on every admission: priced once.
        self._typical_tokens = self.typical_call_tokens()

    def typical_call_tokens(self) -> int:
        """Tokens a typical call reserves (an uploaded photo, no note): admission's yardstick."""
        image = self._shape.profile.image.tokens(*TYPICAL_IMAGE_SIZE, self._detail)
        messages = self._messages(ScanInput("upload", "", None))
        return estimate_chat_tokens(messages) + image + self._schema_tokens + self._shape.completion_cap

    def build_call(self, scan: ScanInput, *, safety_id: str | None = None) -> ChatCall:
        sizes = {scan.image_url: (scan.image.width, scan.image.height)} if scan.image else None
        messages = self._messages(scan)
        billing = self._shape.profile.image
        return ChatCall(
            stage="vision",
            shape=self._shape,
            messages=messages,
            prompt_estimate=estimate_chat_tokens(messages, image_sizes=sizes, image_billing=billing)
            + self._schema_tokens,
            response_format=self._response_format,
            safety_identifier=safety_id,
        )

    def _messages(self, scan: ScanInput) -> list[dict[str, Any]]:
        text = "이 물건을 분류해 주세요."
        if scan.user_input:
            text += f"\n사용자 메모: {scan.user_input}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {
                        "type": "image_url",
                        "image_url": {"url": scan.image_url, "detail": self._detail},
                    },
                ],
            },
        ]
        return messages

    def predicted_budget_wait(self, owed_calls: int) -> float:
        """How long a new scan's vision call would wait for the budget: admission's test."""
        return self._upstream.predicted_wait(self._shape.model, self._typical_tokens, ahead=owed_calls)

    async def run(self, ctx: ScanContext) -> VisionResult:
        call = self.build_call(ctx.scan.input, safety_id=ctx.safety_id)
        result = await self._upstream.complete(call, deadline=ctx.deadline)
        # The prepared image (~100 KB of base64) is only needed by this call; with
        # thousands of scans in flight, holding it through the answer adds up.
        ctx.scan.input = ctx.scan.input.without_image()
        classification, item, tags = self.parse(result.text)
        return VisionResult(classification, item, tags, result)

    def event_fields(self, result: VisionResult) -> dict[str, Any]:
        return result.to_json()

    result_fields = event_fields

    def queue_seconds(self, result: VisionResult) -> float:
        return result.call.queue_s

    def parse(self, text: str) -> tuple[Classification, str, list[str]]:
        try:
            reply = json.loads(text)
            path = reply["category"]
            item = reply.get("item")
            raw_tags = reply.get("situation_tags") or []
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UpstreamBadResponse("The classification reply was not the expected JSON.") from None
        item = " ".join(item.split())[:MAX_ITEM_CHARS] if isinstance(item, str) else ""
        classification = self._taxonomy.classify(path, item) if isinstance(path, str) else None
        if classification is None:
            raise UpstreamBadResponse("The classification named a category outside the taxonomy.")
        known = set(self._taxonomy.tag_names)
        tags: list[str] = []
        for tag in raw_tags if isinstance(raw_tags, list) else []:
            if isinstance(tag, str) and tag in known and tag not in tags:
                tags.append(tag)
        return classification, item, tags[:MAX_TAGS]
