"""Reward: given only for a well-prepared recyclable, recorded once per user and
character by one atomic statement, reported truthfully."""

from __future__ import annotations

import asyncio

import asyncpg

from .conftest import ScanOutcome, Service, data_url, make_jpeg, run_scan

RECYCLABLE = "재활용폐기물"


async def scan(service: Service, seed: int, user: str | None) -> ScanOutcome:
    headers = {"X-User-ID": user} if user else {}
    return await run_scan(service.client, json={"image_url": data_url(make_jpeg(seed))}, headers=headers)


async def rewarded_seed(service: Service) -> int:
    """The simulator is deterministic per photo: find a photo whose scan earns a reward."""
    for seed in range(100, 160):
        outcome = await scan(service, seed, None)
        if outcome.terminal.data["reward"] is not None:
            return seed
    raise AssertionError("no rewarded photo among 60: the reward rule never fires")


async def test_reward_is_received_once_then_already_owned(service: Service, db: asyncpg.Connection) -> None:
    seed = await rewarded_seed(service)
    first = (await scan(service, seed, "collector")).terminal.data
    assert first["reward"]["received"] is True and first["reward"]["already_owned"] is False
    second = (await scan(service, seed, "collector")).terminal.data
    assert second["reward"]["received"] is False and second["reward"]["already_owned"] is True
    assert second["reward"]["character"] == first["reward"]["character"]
    owned = await db.fetch("SELECT character_code FROM character_ownership WHERE user_id = 'collector'")
    assert [r["character_code"] for r in owned] == [first["reward"]["character"]["code"]]


async def test_reward_conditions_hold_for_every_scan(service: Service) -> None:
    for seed in range(160, 190):
        data = (await scan(service, seed, None)).terminal.data
        c, reward = data["classification"], data["reward"]
        eligible = (
            c["major"] == RECYCLABLE
            and c["middle"] is not None
            and data["disposal_rules"] is not None
            and not data["answer"]["insufficiencies"]
        )
        assert (reward is not None) == eligible, data
        if reward is not None:
            # Anonymous: matched, but nothing recorded.
            assert reward["received"] is False and reward["already_owned"] is False
            assert reward["character"]["code"] and reward["character"]["dialog"]


async def test_concurrent_scans_grant_the_character_exactly_once(
    service: Service, db: asyncpg.Connection
) -> None:
    seed = await rewarded_seed(service)
    results = await asyncio.gather(*(scan(service, seed, "racer") for _ in range(4)))
    rewards = [r.terminal.data["reward"] for r in results]
    assert sum(r["received"] for r in rewards) == 1
    assert sum(r["already_owned"] for r in rewards) == 3
    count = await db.fetchval("SELECT count(*) FROM character_ownership WHERE user_id = 'racer'")
    assert count == 1


async def test_character_matches_middle_category(service: Service, db: asyncpg.Connection) -> None:
    seed = await rewarded_seed(service)
    data = (await scan(service, seed, "matcher")).terminal.data
    expected = await db.fetchval(
        "SELECT code FROM characters WHERE middle = $1", data["classification"]["middle"]
    )
    assert data["reward"]["character"]["code"] == expected
