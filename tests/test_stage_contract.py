"""A stage is self-contained: a fifth stage, written here and nowhere else, is run,
streamed, stored, timed and documented by being put in the stage list. Real service,
real PostgreSQL, the simulator over HTTP."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
from httpx_sse import aconnect_sse
from pydantic import Field

from app.sim.server import RunningSimulator
from app.stages.answer import AnswerResult, AnswerStage
from app.stages.base import StageEnv, StageResult
from app.stages.context import ScanContext
from app.stages.order import STAGES, stage_names
from app.stages.reward import RewardStage
from app.stages.rule import RuleBook
from app.stages.vision import VisionResult, VisionStage

from .conftest import SCAN_URL, data_url, make_jpeg, running_service, settings_for

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
