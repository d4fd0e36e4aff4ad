"""The simulator's answers make sense: end to end through the service, a scan names a known
item of the category it returns, with known tags that fit, an answer built from that
category's rule (and the user's question), and a reward for most clean recyclables."""

from __future__ import annotations

import random
from typing import Any

from app.sim.tokens import count_tokens
from app.sim.waste import ACTIONS, answer_document, known_items, vision_document

from .conftest import Service, data_url, make_jpeg, run_scan

RECYCLABLE = "재활용폐기물"
SEEDS = range(300, 360)


async def scan(service: Service, seed: int, question: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"image_url": data_url(make_jpeg(seed))}
    if question is not None:
        body["user_input"] = question
    outcome = await run_scan(service.client, json=body)
    assert outcome.terminal.event == "done", outcome.terminal.data
    return outcome.terminal.data


async def known(service: Service) -> tuple[dict[tuple[str, str | None], set[str]], set[str]]:
    """Known items per (major, middle) and the known tags, from GET /api/v1/scan/categories."""
    taxonomy = (await service.client.get("/api/v1/scan/categories")).json()
    items: dict[tuple[str, str | None], set[str]] = {}
    for major in taxonomy["majors"]:
        items[(major["name"], None)] = set(major["minors"])
        for middle in major["middles"]:
            items[(major["name"], middle["name"])] = set(middle["minors"])
    return items, {t["name"] for t in taxonomy["situation_tags"]}


async def test_scans_name_known_items_with_fitting_tags_and_rule_steps(service: Service) -> None:
    items, tags = await known(service)
    recyclables = rewarded = 0
    for seed in SEEDS:
        data = await scan(service, seed)
        if len(data["items"]) > 1:  # a photo of several: one answer covering them all
            steps = "\n".join(data["answer"]["steps"])
            assert all(item["item_name"] in steps for item in data["items"]), data["answer"]
            continue
        c = data["classification"]
        assert data["item_name"] in items[(c["major"], c["middle"])], data
        assert c["minor"] == data["item_name"]  # a known item: the service keeps it as minor
        assert set(data["situation_tags"]) <= tags
        rule, answer = data["disposal_rules"], data["answer"]
        assert rule is not None
        rule_steps = rule["preparation"] + rule["disposal"]
        assert answer["steps"] and answer["steps"][0] == rule_steps[0]
        assert set(answer["steps"]) <= set(rule_steps)
        assert data["item_name"] in answer["user_answer"]
        # A to-do only for a tag that asks for one.
        assert len(answer["insufficiencies"]) <= sum(t in ACTIONS for t in data["situation_tags"])
        if not any(t in ACTIONS for t in data["situation_tags"]):
            assert answer["insufficiencies"] == []
        if c["major"] == RECYCLABLE:
            recyclables += 1
            rewarded += data["reward"] is not None
    assert recyclables >= len(SEEDS) // 2
    assert rewarded > recyclables // 2, (rewarded, recyclables)


async def test_the_answer_echoes_the_question(service: Service) -> None:
    questions = ("라벨은 떼야 하나요?", "뚜껑은 어떻게 해요?", "이거 어디에 버려요?")
    for seed, question in enumerate(questions, 400):
        data = await scan(service, seed, question)
        user_answer = data["answer"]["user_answer"]
        assert question in user_answer, user_answer
        assert data["answer"]["steps"][0] in data["disposal_rules"]["preparation"]


async def test_a_memo_naming_a_known_item_is_heard(service: Service) -> None:
    data = await scan(service, 403, "우유팩이에요")
    assert data["item_name"] == "우유팩"
    assert data["classification"]["middle"] == "종이팩"


async def test_same_photo_same_reply(service: Service) -> None:
    for seed in (410, 411, 412):
        first, second = await scan(service, seed, "라벨은요?"), await scan(service, seed, "라벨은요?")
        for key in ("classification", "item_name", "situation_tags", "answer", "reward"):
            assert first[key] == second[key]


def test_known_items_come_from_the_taxonomy_seed() -> None:
    items = known_items()
    assert "우유팩" in items["재활용폐기물 > 종이팩"]
    assert items["미분류"] == ("판별 불가",)


def test_other_schemas_are_not_mistaken_for_ecoscan_calls() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"category": {"type": "string", "enum": ["a"]}}}
    assert vision_document(schema, b"other", "", random.Random(1)) is None
    assert answer_document(schema, "{}", 40) is None


def test_the_answer_keeps_to_the_token_budget() -> None:
    schema: dict[str, Any] = {"properties": {"user_answer": {}, "steps": {}, "insufficiencies": {}}}
    facts = (
        '{"분류":{"대분류":"재활용폐기물","중분류":"종이","품목":"노트"},"상황 태그":["스프링 제본"],'
        '"배출 규칙":{"summary":"종이만 모아 묶어 배출합니다.","preparation":["스프링을 분리합니다.",'
        '"테이프를 떼어냅니다."],"disposal":["종이류 수거함에 배출합니다."]},"사용자 질문":"(없음)"}'
    )
    small, large = answer_document(schema, facts, 12), answer_document(schema, facts, 200)
    assert small is not None and large is not None
    assert small["insufficiencies"] == large["insufficiencies"] == ["스프링을 빼서 따로 배출하세요."]
    assert small["steps"] == ["스프링을 분리합니다."]
    assert large["steps"] == ["스프링을 분리합니다.", "테이프를 떼어냅니다.", "종이류 수거함에 배출합니다."]
    assert count_tokens(small["user_answer"]) < count_tokens(large["user_answer"])
    assert large["user_answer"].startswith("노트는 종이로 배출합니다.")
