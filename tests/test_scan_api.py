"""The scan endpoint end to end: real service, real simulator, real SSE client."""

from __future__ import annotations

import asyncpg

from app.sim.server import RunningSimulator
from app.stages.order import stage_names

from .conftest import Event, Service, data_url, make_jpeg, run_scan, scan_row, sim_stats

STAGES = tuple(stage_names())


def assert_well_formed(outcome_events: list[Event]) -> None:
    seqs = [e.data["seq"] for e in outcome_events]
    assert seqs == list(range(1, len(seqs) + 1))
    assert [e.id for e in outcome_events] == [str(s) for s in seqs]
    progress = [e.data["progress"] for e in outcome_events]
    assert progress == sorted(progress)
    assert len({e.data["job_id"] for e in outcome_events}) == 1
    terminal = [e for e in outcome_events if e.event in ("done", "error")]
    assert len(terminal) == 1 and terminal[0] is outcome_events[-1]


def stage_sequence(events: list[Event]) -> list[tuple[str, str]]:
    return [(e.data["step"], e.data["status"]) for e in events if e.event == "stage"]


async def test_json_scan_streams_all_stages_in_order(service: Service, db: asyncpg.Connection) -> None:
    outcome = await run_scan(
        service.client,
        json={"image_url": data_url(make_jpeg(3)), "user_input": "이거 어떻게 버려요?"},
        headers={"X-User-ID": "user-order"},
    )
    assert outcome.status == 200
    assert_well_formed(outcome.events)
    assert stage_sequence(outcome.events) == [(s, p) for s in STAGES for p in ("started", "completed")]
    # Deltas arrive between answer started and answer completed, and add up to text.
    names = [(e.event, e.data["step"]) for e in outcome.events]
    first_delta = names.index(("delta", "answer"))
    assert outcome.events.index(outcome.stage("answer", "started")) < first_delta
    assert first_delta < outcome.events.index(outcome.stage("answer", "completed"))
    streamed = "".join(e.data["text"] for e in outcome.of("delta"))
    done = outcome.terminal
    assert done.event == "done" and done.data["progress"] == 100
    answer = done.data["answer"]
    assert answer["user_answer"] and streamed.startswith(answer["user_answer"])
    for step in answer["steps"]:
        assert step in streamed
    assert set(done.data["classification"]) == {"major", "middle", "minor"}
    timings = done.data["timings"]
    for key in (*(f"{stage}_ms" for stage in STAGES), "total_ms"):
        assert timings[key] >= 0
    assert timings["total_ms"] >= timings["vision_ms"] + timings["answer_ms"]
    for stage in STAGES:
        assert outcome.stage(stage, "completed").data["duration_ms"] >= 0

    row = await scan_row(db, done.data["job_id"])
    assert row["status"] == "completed"
    assert row["user_id"] == "user-order"
    assert row["image_source"] == "data_url"
    assert row["classification"] == done.data["classification"]
    assert row["answer"] == answer
    assert row["finished_at"] is not None and row["error_code"] is None


async def test_multipart_upload_scan_completes(service: Service, db: asyncpg.Connection) -> None:
    outcome = await run_scan(
        service.client,
        files={"image": ("photo.jpg", make_jpeg(4, (1600, 1200)), "image/jpeg")},
        data={"user_input": "라벨은 떼야 하나요?"},
    )
    assert outcome.status == 200
    assert_well_formed(outcome.events)
    assert outcome.terminal.event == "done"
    row = await scan_row(db, outcome.terminal.data["job_id"])
    assert {k: row[k] for k in ("status", "image_source", "user_input", "user_id")} == {
        "status": "completed",
        "image_source": "upload",
        "user_input": "라벨은 떼야 하나요?",
        "user_id": None,
    }


async def test_https_image_url_is_passed_through(service: Service, sim: RunningSimulator) -> None:
    outcome = await run_scan(service.client, json={"image_url": "https://example.com/bottle.jpg"})
    assert outcome.status == 200 and outcome.terminal.event == "done"
    assert (await sim_stats(sim))["by_kind"]["vision"] == 1


async def test_same_photo_gives_same_classification(service: Service) -> None:
    image = data_url(make_jpeg(11))
    first = await run_scan(service.client, json={"image_url": image})
    second = await run_scan(service.client, json={"image_url": image})
    assert first.terminal.data["classification"] == second.terminal.data["classification"]
    assert first.terminal.data["job_id"] != second.terminal.data["job_id"]


async def test_classifications_come_from_the_taxonomy(service: Service) -> None:
    taxonomy = (await service.client.get("/api/v1/scan/categories")).json()
    paths = set(taxonomy["paths"])
    tags = {t["name"] for t in taxonomy["situation_tags"]}
    assert len(taxonomy["majors"]) == 8
    recyclable = next(m for m in taxonomy["majors"] if m["recyclable"])
    assert len(recyclable["middles"]) == 12
    assert 50 <= len(tags) <= 80
    minors = {
        (m["name"], mid["name"]): set(mid["minors"]) for m in taxonomy["majors"] for mid in m["middles"]
    } | {(m["name"], None): set(m["minors"]) for m in taxonomy["majors"]}
    for seed in range(20, 28):
        done = (await run_scan(service.client, json={"image_url": data_url(make_jpeg(seed))})).terminal
        c = done.data["classification"]
        assert " > ".join(p for p in (c["major"], c["middle"]) if p) in paths
        assert c["minor"] is None or c["minor"] in minors[(c["major"], c["middle"])]
        assert isinstance(done.data["item_name"], str)
        assert set(done.data["situation_tags"]) <= tags


async def test_rule_documents_match_classification(service: Service) -> None:
    for seed in range(40, 46):
        done = (await run_scan(service.client, json={"image_url": data_url(make_jpeg(seed))})).terminal
        rules = done.data["disposal_rules"]
        c = done.data["classification"]
        assert rules is not None, done.data
        assert rules["key"]["major"] == c["major"]
        assert rules["matched_by"] == "exact"
        for key in ("title", "preparation", "disposal", "not_accepted"):
            assert rules[key]


async def test_health_and_readiness(service: Service) -> None:
    assert (await service.client.get("/healthz")).json() == {"status": "ok"}
    ready = await service.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["database"] == "ok"


async def test_metrics_endpoint_reports_scans(service: Service) -> None:
    await run_scan(service.client, json={"image_url": data_url(make_jpeg(5))})
    text = (await service.client.get("/metrics")).text
    assert 'ecoscan_scans_total{code="",outcome="completed"} 1.0' in text
    assert "ecoscan_stage_queue_seconds_bucket" in text
    # A small photo going on as it came is prepared on the loop: no CPU-lane queue for it.
    for stage, limit in (("vision", "budget"), ("answer", "semaphore")):
        labels = {"stage": stage, "limit": limit}
        assert service.metric("ecoscan_stage_queue_seconds_count", labels) == 1, labels
    for stage in ("prepare", *STAGES):
        assert service.metric("ecoscan_stage_service_seconds_count", {"stage": stage}) == 1, stage
    assert (
        'ecoscan_upstream_calls_total{endpoint="chat.completions",model="gpt-4o-mini",status="2xx"} 2.0'
        in text
    )
