"""A stage is self-contained: a fifth stage, written here and nowhere else, is run,
streamed, stored, timed and documented by being put in the stage list; and so is a
stage that calls a model, whose calls are routed, budgeted, gated, cached and counted
by declaring its `StageCall`. Real service, real PostgreSQL, the simulator over HTTP."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import pytest
from httpx_sse import aconnect_sse
from pydantic import Field, PrivateAttr

from app.resources import lifespan_resources
from app.runtime.metrics import Metrics
from app.settings import SettingsError
from app.sim.server import RunningSimulator
from app.stages.answer import AnswerResult, AnswerStage
from app.stages.base import StageEnv, StageResult
from app.stages.context import ScanContext
from app.stages.order import STAGES, stage_names
from app.stages.reward import RewardStage
from app.stages.rule import RuleBook
from app.stages.vision import VisionResult, VisionStage
from app.upstream.call import ChatRequest, ChatResult
from app.upstream.client import Upstream
from app.upstream.reply_cache import CacheLimits, ReplyCache, request_digest
from app.upstream.stage_call import StageCall

from .conftest import SCAN_URL, Service, data_url, make_jpeg, running_service, settings_for, sim_stats

# Grams of CO2 a correct disposal saves, by major category: the stage's "small table".
IMPACT_TABLE = """
    SELECT * FROM (VALUES ('재활용폐기물', 120.0), ('음식물류폐기물', 35.5)) AS impact(major, grams)"""


class ImpactResult(StageResult):
    """The CO2 a correct disposal saves was estimated."""

    co2_saved_g: float = Field(description="Grams of CO2 saved by disposing of the item as guided.")
    based_on: str = Field(description="The category the estimate is for.")


class ImpactStage:
    name = "impact"
    label = "탄소 절감"
    progress_share = 5
    upstream_calls = 0
    streams_text = False
    result_type = ImpactResult

    def __init__(self, grams: dict[str, float], *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._grams = grams

    @classmethod
    async def start(cls, env: StageEnv) -> ImpactStage:
        async with env.pool.acquire() as conn:
            rows = await conn.fetch(IMPACT_TABLE)
        return cls({r["major"]: r["grams"] for r in rows}, timeout_s=env.settings.db_timeout_s)

    async def run(self, ctx: ScanContext) -> ImpactResult:
        classification = ctx.result(VisionResult).classification
        ctx.result(AnswerResult)  # it runs after the answer, and may read it
        return ImpactResult(
            co2_saved_g=self._grams.get(classification.major, 0.0), based_on=classification.major
        )


FIVE_STAGES = (VisionStage, RuleBook, AnswerStage, ImpactStage, RewardStage)


def test_the_product_runs_its_four_stages_in_order() -> None:
    assert stage_names() == ["vision", "rule", "answer", "reward"]
    assert [stage.name for stage in STAGES] == stage_names()


async def test_a_fifth_stage_is_streamed_stored_timed_and_documented(
    database_url: str, sim: RunningSimulator, db: asyncpg.Connection
) -> None:
    settings = settings_for(database_url, sim)
    async with running_service(settings, stages=FIVE_STAGES) as svc:
        user = {"X-User-ID": "impact-reader"}
        async with aconnect_sse(
            svc.client, "POST", SCAN_URL, json={"image_url": data_url(make_jpeg(5))}, headers=user
        ) as source:
            assert source.response.status_code == 200
            events = [(sse.event, json.loads(sse.data)) async for sse in source.aiter_sse() if sse.data]

        # The stream: started and completed in its place, with its result's fields.
        stages = [(data["step"], data["status"]) for name, data in events if name == "stage"]
        order = [step for step, status in stages if status == "started"]
        assert order == ["vision", "rule", "answer", "impact", "reward"]
        assert [step for step, status in stages if status == "completed"] == order
        completed = next(
            d for n, d in events if n == "stage" and d["step"] == "impact" and d["status"] == "completed"
        )
        assert completed["co2_saved_g"] == 120.0 and completed["based_on"] == "재활용폐기물"
        progress = [data["progress"] for _, data in events]
        assert progress == sorted(progress) and progress[-1] == 100

        # `done` and its timings.
        name, done = events[-1]
        assert name == "done"
        assert done["co2_saved_g"] == 120.0 and done["based_on"] == "재활용폐기물"
        assert done["timings"]["impact_ms"] >= 0
        assert {"classification", "disposal_rules", "answer", "reward"} <= set(done)

        # The stored scan: its status answers with that `done`, its row has the timing.
        job_id = done["job_id"]
        status = (await svc.client.get(f"/api/v1/scan/{job_id}", headers=user)).json()
        assert status["status"] == "completed"
        assert status["result"]["co2_saved_g"] == 120.0
        row = await db.fetchrow("SELECT status, timings FROM scans WHERE id = $1", uuid.UUID(job_id))
        assert row is not None and row["status"] == "completed"
        assert "impact_ms" in row["timings"]

        # The OpenAPI document.
        document: dict[str, Any] = (await svc.client.get("/openapi.json")).json()
        schemas = document["components"]["schemas"]
        assert "impact" in schemas["StageStartedEvent"]["properties"]["step"]["enum"]
        impact = schemas["ImpactCompletedEvent"]
        assert impact["properties"]["step"]["const"] == "impact"
        assert {"co2_saved_g", "based_on", "duration_ms"} <= set(impact["required"])
        assert "Grams of CO2" in impact["properties"]["co2_saved_g"]["description"]
        assert {"co2_saved_g", "based_on"} <= set(schemas["DoneEvent"]["required"])
        assert "impact_ms" in schemas["Timings"]["required"]
        stream = document["paths"][SCAN_URL]["post"]["responses"]["200"]
        item = stream["content"]["text/event-stream"]["itemSchema"]
        stage_branch = next(b for b in item["oneOf"] if b["properties"]["event"]["const"] == "stage")
        refs = [ref["$ref"] for ref in stage_branch["properties"]["data"]["contentSchema"]["oneOf"]]
        assert "#/components/schemas/ImpactCompletedEvent" in refs
        assert "impact → `co2_saved_g`, `based_on`" in stream["description"]

        # The page shows it in the progress list.
        page = (await svc.client.get("/")).text
        assert 'data-step="impact"' in page and "탄소 절감" in page


async def test_the_page_lists_the_products_stages(database_url: str, sim: RunningSimulator) -> None:
    async with running_service(settings_for(database_url, sim)) as svc:
        page = (await svc.client.get("/")).text
    items = [line for line in page.splitlines() if "data-step=" in line]
    assert [line.split('data-step="')[1].split('"')[0] for line in items] == stage_names()


# --- a stage that calls a model: the module a new calling stage would be -------------------

MODERATION_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "moderation_check",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"allowed": {"type": "boolean"}, "concern": {"type": "string"}},
            "required": ["allowed", "concern"],
            "additionalProperties": False,
        },
    },
}


class ModerationResult(StageResult):
    """The item was checked before its rules are looked up."""

    allowed: bool = Field(description="Whether the item may be guided.")
    concern: str = Field(description="What the check found.")
    _call: ChatResult | None = PrivateAttr(default=None)

    def served_by(self) -> str | None:
        return self._call.upstream if self._call is not None else None

    def queue_seconds(self) -> float:
        return self._call.queue_s if self._call is not None else 0.0


class ModerationStage:
    name = "moderation"
    label = "안전 확인"
    progress_share = 5
    upstream_calls = 1
    streams_text = False
    result_type = ModerationResult
    call = StageCall(
        "moderation", max_tokens=60, temperature=0.0, timeout_s=10.0, cache=CacheLimits(100, 1 << 20, 600.0)
    )

    @classmethod
    async def start(cls, env: StageEnv) -> ModerationStage:
        return cls(env.upstream, env.call(cls.name), env.reply_cache(cls.name))

    def __init__(self, upstream: Upstream, call: StageCall, cache: ReplyCache | None) -> None:
        self.timeout_s = call.timeout_s
        self._upstream = upstream
        self._cache = cache

    async def run(self, ctx: ScanContext) -> ModerationResult:
        vision = ctx.result(VisionResult)
        messages = [
            {"role": "system", "content": "이 품목을 안내해도 되는지 확인하세요."},
            {"role": "user", "content": f"{vision.classification.major}: {vision.item_name}"},
        ]
        request = ChatRequest(
            self.name, messages, response_format=MODERATION_FORMAT, safety_identifier=ctx.safety_id
        )
        made: list[ChatResult] = []

        async def check() -> str:
            made.append(await self._upstream.complete(request, deadline=ctx.current_deadline))
            return made[0].text

        if self._cache is None:
            text = await check()
        else:
            key = request_digest(self._upstream.models(self.name), MODERATION_FORMAT, messages)
            text = await self._cache.get_or_call(key, check)
        reply = json.loads(text)
        result = ModerationResult(allowed=reply["allowed"], concern=reply["concern"])
        if made:
            result._call = made[0]
        return result


# ...and the one line in the stage order.
MODERATED = (VisionStage, ModerationStage, RuleBook, AnswerStage, RewardStage)


async def _scan(svc: Service, photo: bytes) -> list[tuple[str, dict[str, Any]]]:
    user = {"X-User-ID": "moderation-reader"}
    async with aconnect_sse(
        svc.client, "POST", SCAN_URL, json={"image_url": data_url(photo)}, headers=user
    ) as source:
        assert source.response.status_code == 200
        return [(sse.event, json.loads(sse.data)) async for sse in source.aiter_sse() if sse.data]


async def test_a_calling_stage_is_routed_budgeted_gated_cached_and_counted(
    database_url: str, sim: RunningSimulator
) -> None:
    # Its own model (a budget of its own), set the generic way; the stage declares the rest.
    settings = settings_for(database_url, sim, stage_calls='{"moderation": {"model": "gpt-4.1-nano"}}')
    before = (await sim_stats(sim))["by_schema"].get("moderation_check", 0)
    async with running_service(settings, stages=MODERATED) as svc:
        photo = make_jpeg(41)
        events = await _scan(svc, photo)

        # Its events stream in its place, and `done` names it and who served it.
        stages = [(d["step"], d["status"]) for n, d in events if n == "stage"]
        assert [step for step, status in stages if status == "completed"] == [
            "vision",
            "moderation",
            "rule",
            "answer",
            "reward",
        ]
        name, done = events[-1]
        assert name == "done" and isinstance(done["allowed"], bool) and isinstance(done["concern"], str)
        assert done["upstreams"]["moderation"] == "openai" and done["timings"]["moderation_ms"] >= 0

        # Routed to the deployment's model for it, through the simulator.
        assert (await sim_stats(sim))["by_schema"].get("moderation_check", 0) == before + 1
        assert svc.metric("ecoscan_upstream_routed_total", {"upstream": "openai", "stage": "moderation"}) == 1
        assert (
            svc.metric(
                "ecoscan_upstream_calls_total",
                {"model": "gpt-4.1-nano", "endpoint": "chat.completions", "status": "2xx"},
            )
            == 1
        )
        # Budgeted: its model's budget reserved its call (the call's estimate, counted).
        assert svc.metric("ecoscan_upstream_tokens_total", {"model": "gpt-4.1-nano", "kind": "estimated"}) > 0
        assert (
            svc.metric(
                "ecoscan_budget_effective_limit_per_minute", {"model": "gpt-4.1-nano", "resource": "requests"}
            )
            > 0
        )
        # Gated: a gate of its own, sized like the others'.
        registry = svc.metrics.registry
        assert registry.get_sample_value("ecoscan_stage_semaphore_in_use", {"stage": "moderation"}) == 0
        assert svc.metric("ecoscan_limit", {"limit": "moderation_gate"}) >= 1
        # Counted in the stage metrics.
        labels = {"stage": "moderation", "outcome": "completed"}
        assert svc.metric("ecoscan_stage_duration_seconds_count", labels) == 1

        # Cached: the same photo again is answered from its reply cache, no call made.
        again = await _scan(svc, photo)
        assert again[-1][0] == "done" and again[-1][1]["allowed"] == done["allowed"]
        assert again[-1][1]["upstreams"]["moderation"] is None
        assert svc.metric("ecoscan_cache_requests_total", {"cache": "moderation", "outcome": "hit"}) == 1
        assert (await sim_stats(sim))["by_schema"].get("moderation_check", 0) == before + 1
        assert svc.metric("ecoscan_stage_duration_seconds_count", labels) == 2


def listed(sim: RunningSimulator, models: dict[str, str]) -> str:
    """UPSTREAMS: one deployment, the simulator, serving each stage the model `models` names."""
    deployment = {"name": "sim", "provider": "compatible", "base_url": sim.base_url, "rpm": 500}
    return json.dumps([{**deployment, "tpm": 500_000, "models": models}])


async def test_deployments_name_a_calling_stages_model_in_models(
    database_url: str, sim: RunningSimulator
) -> None:
    """Listed deployments serve a new calling stage where their `models` name one for it; a
    stage none serves stops the start, naming it."""

    pair = {"vision": "gpt-4o-mini", "answer": "gpt-4o-mini"}
    unserved = settings_for(database_url, sim, upstreams=listed(sim, pair))
    with pytest.raises(SettingsError, match="no deployment serves the moderation stage"):
        async with lifespan_resources(unserved, Metrics(process=False), stages=MODERATED):
            pass
    served = settings_for(database_url, sim, upstreams=listed(sim, {**pair, "moderation": "gpt-4.1-nano"}))
    async with lifespan_resources(served, Metrics(process=False), stages=MODERATED) as resources:
        assert list(resources.gates) == ["vision", "moderation", "answer"]
        assert set(resources.budgets) == {"sim/gpt-4o-mini", "sim/gpt-4.1-nano"}


async def test_a_deployment_naming_a_stage_nobody_runs_stops_the_start(
    database_url: str, sim: RunningSimulator
) -> None:
    """A stage name in `models` that no calling stage has (a typo, a stage taken out) was
    ignored: the deployment then silently served less than its operator wrote."""
    models = {"vision": "gpt-4o-mini", "answer": "gpt-4o-mini", "moderaton": "gpt-4.1-nano"}
    settings = settings_for(database_url, sim, upstreams=listed(sim, models))
    with pytest.raises(SettingsError, match="deployment 'sim': models: 'moderaton' is not a calling stage"):
        async with lifespan_resources(settings, Metrics(process=False)):
            pass


async def test_stage_calls_naming_a_stage_nobody_runs_stops_the_start(
    database_url: str, sim: RunningSimulator
) -> None:
    """A STAGE_CALLS entry for a stage that is not in the stage order (a typo) was ignored:
    the stage it meant ran with its declared defaults, and nothing said so."""
    settings = settings_for(database_url, sim, stage_calls='{"moderaton": {"model": "gpt-4o-mini"}}')
    with pytest.raises(SettingsError, match="STAGE_CALLS moderaton: no calling stage of that name"):
        async with lifespan_resources(settings, Metrics(process=False)):
            pass
