"""Several items in one photo (issue 40), over HTTP against the simulator: each item found,
each ruled, one streamed answer, `done` keeping the main item's single-item fields."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import asyncpg
import pytest
from httpx_sse import aconnect_sse

from app.db.taxonomy import load_taxonomy
from app.errors import UpstreamBadResponse
from app.intake.parsing import parse_scan_body
from app.resources import Resources, lifespan_resources
from app.runtime.metrics import Metrics
from app.scans.events import EventLog, LogEntry
from app.settings import Settings, SettingsError
from app.sim.config import SimConfig
from app.sim.gemini import schema_violations
from app.sim.server import RunningSimulator, run_simulator
from app.stages.answer import AnswerStage
from app.stages.context import AcceptedScan
from app.stages.items import FoundItems, clamped_box, items_schema, parse_items
from app.stages.rule import RuleResult
from app.stages.vision import VisionResult
from app.upstream.negotiation import without_keywords
from app.upstream.providers.gemini import Gemini
from app.upstream.tokens import estimate_chat_tokens

from .conftest import Event, Service, data_url, make_jpeg, run_scan, running_service, settings_for, sim_stats
from .test_routing import routed_service
from .test_structured_output_schemas import strict_schema_problems

PET = "생수병, 라벨, 플라스틱 뚜껑"  # a note that names three known items
SINGLE_ITEM_KEYS = {
    "classification",
    "item_name",
    "situation_tags",
    "disposal_rules",
    "disposal_rules_reason",
}


def shape(value: Any) -> Any:
    """A JSON value's shape: its keys, and which leaves are lists (a null may be any type)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    return "list" if isinstance(value, list) else "value"


def sequence(events: list[Any]) -> list[tuple[str, str, str | None]]:
    return [(e.event, e.data["step"], e.data.get("status")) for e in events if e.event != "delta"]


async def test_a_one_item_photo_streams_todays_events_plus_the_item_count(service: Service) -> None:
    outcome = await run_scan(
        service.client, json={"image_url": data_url(make_jpeg(3)), "user_input": "생수병"}
    )
    seq = sequence(outcome.events)
    assert ("items", "vision", None) in seq
    today = [s for s in seq if s[0] != "items"]
    assert today == [
        ("stage", "vision", "started"),
        ("stage", "vision", "completed"),
        ("stage", "rule", "started"),
        ("stage", "rule", "completed"),
        ("stage", "answer", "started"),
        ("stage", "answer", "completed"),
        ("stage", "reward", "started"),
        ("stage", "reward", "completed"),
        ("done", "done", None),
    ]
    # The count comes before the vision stage completes, and no per-item event follows.
    assert seq.index(("items", "vision", None)) == 1
    count = outcome.of("items")[0].data
    assert (count["count"], count["main"], count["dropped"]) == (1, 0, 0)
    assert not outcome.of("item") and not outcome.of("item_rule")
    done = outcome.terminal.data
    assert len(done["items"]) == 1 and done["items"][0]["main"] is True
    assert done["items"][0]["classification"] == done["classification"]
    assert done["item_rules"][0]["disposal_rules"] == done["disposal_rules"]


async def test_a_three_item_photo_gives_three_classifications_their_rules_and_one_answer(
    service: Service,
) -> None:
    one = await run_scan(service.client, json={"image_url": data_url(make_jpeg(4)), "user_input": "생수병"})
    outcome = await run_scan(
        service.client,
        json={"image_url": data_url(make_jpeg(4)), "user_input": PET},
        headers={"X-User-ID": "items-user"},
    )
    assert outcome.terminal.event == "done", outcome.terminal
    count = outcome.of("items")[0].data
    assert (count["count"], count["main"], count["dropped"]) == (3, 0, 0)
    envelope = {"job_id", "step", "seq", "progress"}
    items = [{k: v for k, v in e.data.items() if k not in envelope} for e in outcome.of("item")]
    rules = [{k: v for k, v in e.data.items() if k not in envelope} for e in outcome.of("item_rule")]
    assert [i["index"] for i in items] == [0, 1, 2] and [r["index"] for r in rules] == [0, 1, 2]
    assert [i["item_name"] for i in items] == ["생수병", "라벨", "플라스틱 뚜껑"]
    assert [i["classification"]["middle"] for i in items] == ["무색페트병", "비닐류", "플라스틱류"]
    assert [r["disposal_rules"]["key"]["middle"] for r in rules] == ["무색페트병", "비닐류", "플라스틱류"]
    # Item events come inside their stage: classifications before vision completes, rules before rule does.
    kinds = [(e.event, e.data["step"], e.data.get("status")) for e in outcome.events]
    assert max(i for i, k in enumerate(kinds) if k[0] == "item") < kinds.index(
        ("stage", "vision", "completed")
    )
    assert max(i for i, k in enumerate(kinds) if k[0] == "item_rule") < kinds.index(
        ("stage", "rule", "completed")
    )
    # One answer call, streamed, covering every item.
    assert len([e for e in outcome.events if e.event == "stage" and e.data["step"] == "answer"]) == 2
    streamed = "".join(e.data["text"] for e in outcome.of("delta"))
    for name in ("생수병", "라벨", "플라스틱 뚜껑"):
        assert name in streamed
    done = outcome.terminal.data
    assert len(outcome.of("done")) == 1
    # The main item's single-item fields, in today's shape (as a one-item scan has them).
    assert {k: shape(done[k]) for k in SINGLE_ITEM_KEYS} == {
        k: shape(one.terminal.data[k]) for k in SINGLE_ITEM_KEYS
    }
    assert done["item_name"] == "생수병" and done["classification"] == items[0]["classification"]
    assert done["items"] == items and done["item_rules"] == rules
    assert "reward" in done  # the reward follows the main item, as today
    for item in items:
        box = item["box"]
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 1.0 + 1e-9
        assert box["y"] >= 0 and box["y"] + box["height"] <= 1.0 + 1e-9
    stored = await service.client.get(f"/api/v1/scan/{done['job_id']}", headers={"X-User-ID": "items-user"})
    assert stored.status_code == 200, stored.text
    result = stored.json()["result"]
    assert result["items"] == items and result["item_rules"] == rules and result["item_name"] == "생수병"


async def test_more_items_than_max_items_are_dropped_with_a_count(
    # A reply that names more than it was asked for (room enough to finish it)
    database_url: str,
    sim: RunningSimulator,
) -> None:
    async with running_service(
        settings_for(database_url, sim, max_items=2, vision_max_tokens=400)
    ) as service:
        outcome = await run_scan(
            service.client, json={"image_url": data_url(make_jpeg(5)), "user_input": PET + ", 맥주병"}
        )
    assert outcome.terminal.event == "done", outcome.terminal
    count = outcome.of("items")[0].data
    assert (count["count"], count["main"], count["dropped"]) == (2, 0, 2)
    assert len(outcome.of("item")) == 2 and len(outcome.of("item_rule")) == 2
    assert outcome.terminal.data["items_dropped"] == 2


async def test_a_photo_always_shows_the_same_items_and_some_photos_show_several(service: Service) -> None:
    counts = {}
    for seed in range(60, 76):
        outcome = await run_scan(service.client, json={"image_url": data_url(make_jpeg(seed))})
        assert outcome.terminal.event == "done", outcome.terminal
        counts[seed] = outcome.of("items")[0].data["count"]
        assert len(outcome.terminal.data["items"]) == counts[seed]
    assert any(c == 1 for c in counts.values()) and any(c > 1 for c in counts.values())
    assert sum(c == 1 for c in counts.values()) > len(counts) // 2  # one item for most
    seed = next(s for s, c in counts.items() if c > 1)
    again = await run_scan(
        service.client, json={"image_url": data_url(make_jpeg(seed)), "user_input": "어디에?"}
    )
    assert again.of("items")[0].data["count"] == counts[seed]


async def test_replies_outside_the_rules_are_bounded_dropped_or_refused(db: asyncpg.Connection) -> None:
    taxonomy = await load_taxonomy(db)
    pet = "재활용폐기물 > 무색페트병"

    def one(category: str, box: Any = None) -> dict[str, Any]:
        return {
            "category": category,
            "item": "생수병",
            "situation_tags": ["라벨 부착", "없는 태그"],
            "box": box,
        }

    found = parse_items(
        {
            "items": [one("없는 분류"), one(pet, {"x": -0.1, "y": 0.5, "width": 0.5, "height": 0.8})],
            "main_item": 0,
        },
        taxonomy,
        5,
    )
    assert isinstance(found, FoundItems) and found.dropped == 1 and len(found.items) == 1
    item = found.items[0]
    assert item.main and item.index == 0 and item.situation_tags == ["라벨 부착"]
    assert item.box is not None and (item.box.x, item.box.y, item.box.width, item.box.height) == (
        0.0,
        0.5,
        0.4,
        0.5,
    )
    # The main item is kept past MAX_ITEMS, with the first others, in the reply's order.
    many = parse_items({"items": [one(pet)] * 6, "main_item": 4}, taxonomy, 3)
    assert [i.main for i in many.items] == [False, False, True] and many.dropped == 3
    assert clamped_box({"x": 1.2, "y": 0, "width": 0.3, "height": 0.3}) is None  # wholly outside
    assert clamped_box({"x": "a", "y": 0, "width": 1, "height": 1}) is None
    with pytest.raises(UpstreamBadResponse):
        parse_items({"items": [one("없는 분류")], "main_item": 0}, taxonomy, 5)
    with pytest.raises(UpstreamBadResponse):
        parse_items({"category": pet}, taxonomy, 5)


async def test_the_items_schema_is_strict_and_inside_geminis_subset(db: asyncpg.Connection) -> None:
    schema = items_schema(await load_taxonomy(db))
    assert strict_schema_problems(schema) == []
    box = schema["properties"]["items"]["items"]["properties"]["box"]
    assert [branch["type"] for branch in box["anyOf"]] == ["object", "null"]
    # What Gemini's provider sends (without additionalProperties) is inside its Schema object.
    assert schema_violations(without_keywords(schema, Gemini.unsupported_schema_keywords)) == []


FLAVOURS = {
    "openai": ("/v1", "gpt-4o-mini"),
    "azure": ("/openai/v1/", "gpt-4o-mini"),
    "gemini": ("/v1beta/openai/", "gemini-2.5-flash"),
}


@pytest.mark.parametrize("flavor", sorted(FLAVOURS))
async def test_every_provider_flavour_accepts_the_items_schema(
    database_url: str, sim: RunningSimulator, flavor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, model = FLAVOURS[flavor]
    config = SimConfig(
        flavor=flavor, api_key=f"sk-{flavor}", time_scale=0.002, latency_sigma=0.0, text_tokens=120
    )
    async with run_simulator(config) as upstream:
        listed = [
            {
                "name": flavor,
                "provider": flavor,
                "base_url": f"{upstream.url}{path}",
                "api_key_env": f"KEY_{flavor.upper()}",
                "vision_model": model,
                "answer_model": model,
                "rpm": 600,
                "tpm": 1_000_000,
            }
        ]
        async with routed_service(database_url, sim, monkeypatch, listed) as svc:
            outcome = await run_scan(
                svc.client, json={"image_url": data_url(make_jpeg(7)), "user_input": PET}
            )
            stats = await sim_stats(upstream)
    assert outcome.terminal.event == "done", outcome.terminal
    assert outcome.of("items")[0].data["count"] == 3 and len(outcome.of("item_rule")) == 3
    assert stats["requests_total"] == 2  # one vision call, one answer call: nothing refused, no retry


async def test_a_resumed_stream_replays_each_item_event_once(service: Service) -> None:
    headers = {"X-User-ID": "items-resume"}
    body = {"image_url": data_url(make_jpeg(8)), "user_input": PET}
    outcome = await run_scan(service.client, json=body, headers=headers)
    assert outcome.terminal.event == "done", outcome.terminal
    job_id = outcome.terminal.data["job_id"]
    after = outcome.of("items")[0].id  # resumed right after the count: every item event is ahead
    async with aconnect_sse(
        service.client,
        "GET",
        f"/api/v1/scan/{job_id}/events",
        headers={**headers, "Last-Event-ID": after},
    ) as source:
        replay = [Event(s.event, s.id, json.loads(s.data)) async for s in source.aiter_sse() if s.data]
    assert replay == [e for e in outcome.events if int(e.id) > int(after)]
    assert [e.data["index"] for e in replay if e.event == "item"] == [0, 1, 2]
    assert [e.data["index"] for e in replay if e.event == "item_rule"] == [0, 1, 2]


async def test_a_taken_over_scan_does_not_send_an_item_event_twice(
    database_url: str, sim: RunningSimulator
) -> None:
    """The owner died in the rule stage after sending the first item's rule: the taker runs
    the rule stage again and sends only the rules not yet sent."""
    settings = settings_for(database_url, sim)
    async with lifespan_resources(settings, Metrics(process=False)) as r:
        first = await _scan(r, "items-owner")
        cut = next(i for i, e in enumerate(first) if e.event.kind == "item_rule") + 1
        mirrored = EventLog()
        for entry in first[:cut]:
            mirrored.publish(entry)
        recorded = EventLog.from_json(mirrored.to_json()).entries  # as another replica reads them
        taken = await _scan(r, "items-taker", adopt=recorded)
    kinds = [(e.event.kind, e.event.fields().get("index")) for e in taken]
    assert kinds.count(("items", None)) == 1
    for kind in ("item", "item_rule"):
        assert [i for k, i in kinds if k == kind] == [0, 1, 2], kinds
    assert [e.seq for e in taken] == list(range(1, len(taken) + 1))
    done = taken[-1].event
    assert done.kind == "done" and len(done.fields()["item_rules"]) == 3
    assert [k for k, _ in kinds if k == "done"] == ["done"]


async def _scan(
    r: Resources, user: str, adopt: list[LogEntry] | None = None, note: str = PET
) -> list[LogEntry]:
    """A scan (three items, by default) run by `r`'s pipeline to its end (taken over from
    `adopt`'s entries)."""
    body = json.dumps({"image_url": data_url(make_jpeg(9)), "user_input": note}).encode()
    scan_input = parse_scan_body(body, "application/json", r.input_limits)
    ticket = await r.admission.admit(user)
    scan_id = uuid.uuid4()
    await r.store.create(scan_id, user_id=user, image_source="data_url", image_sha256=None, user_input=note)
    scan = AcceptedScan(scan_id, user, scan_input, ticket, time.perf_counter())
    if adopt is None:
        run = r.pipeline.start(scan)
    else:
        run = r.pipeline.adopt(scan, adopt, deadline_s=30.0, token_sha256=None)
    entries = [entry async for entry in run.log.follow()]
    assert run.task is not None
    await run.task
    return entries


async def test_the_vision_cap_follows_max_items_and_a_full_photo_fits_it(service: Service) -> None:
    assert service.settings.vision_output_tokens == 120 + 110 * 4
    one = Settings(max_items=1)
    assert one.vision_output_tokens == 120 and one.call_shape("vision").completion_cap == 120
    for bad in (0, 13):
        with pytest.raises(SettingsError, match="MAX_ITEMS"):
            Settings(max_items=bad)
    # Five items, long names and all: the reply is never cut by its own cap.
    note = "스티로폼 완충재, 투명 이온음료병, 플라스틱 계란판, 헤어드라이어, 단추형 전지"
    outcome = await run_scan(service.client, json={"image_url": data_url(make_jpeg(12)), "user_input": note})
    assert outcome.terminal.event == "done", outcome.terminal
    assert outcome.of("items")[0].data["count"] == 5


async def test_the_budget_prices_a_photo_of_several_items_by_its_longer_answer_prompt(
    database_url: str, sim: RunningSimulator
) -> None:
    """The answer call of a three-item photo reserves more than a one-item one: its prompt
    holds every item and each distinct rule, and the estimate is of the prompt as sent."""
    async with lifespan_resources(settings_for(database_url, sim), Metrics(process=False)) as r:
        scans = {}
        for count, note in ((1, "생수병"), (3, PET)):
            scans[count] = await _scan(r, f"items-budget-{count}", note=note)
        answer = next(stage for stage in r.stages if isinstance(stage, AnswerStage))
        estimates = {}
        for count, entries in scans.items():
            done = entries[-1].event.fields()
            vision = VisionResult.model_validate(done)
            rule = RuleResult.model_validate({**done, "reason": done["disposal_rules_reason"]})
            assert len(vision.items) == count
            # What a route's `estimate` reserves for the call's prompt (app/upstream/routes.py).
            request = answer.build_request(vision, rule, None)
            estimates[count] = estimate_chat_tokens(request.messages) + request.extra_prompt_tokens
    assert estimates[3] > estimates[1] * 1.5, estimates
