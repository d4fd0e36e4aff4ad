"""The lean floor: ecoscan's scan endpoint at the lowest CPU per scan we could reach.

A benchmark yardstick, not product code (the cost-per-scan issue's "lean floor"). It
serves `POST /api/v1/scan/classify/completion` with ecoscan's stages, the same upstream
calls, the same database writes and the same SSE events, as plainly as Python allows, so
that k6/cpu_per_scan.py measures in the same sitting as ecoscan how low the CPU per scan
can go on this machine:

- a raw ASGI callable (no FastAPI/Starlette routing, no sse-starlette);
- one aiohttp.ClientSession (keep-alive, up to 1,024 connections) and request bodies
  pre-serialised with orjson: each call's constant part (model, parameters, json_schema)
  once at start-up, the scan's messages appended to it;
- orjson for every JSON, and ecoscan's asyncpg pool (`create_pool`: its size, its orjson
  jsonb codec, no reset query on release);
- its own SQL against the tables ecoscan's migrations create, and ecoscan's public
  taxonomy, prompts, schemas, answer rendering and stage list (the progress spans);
- per scan, ecoscan's database work: the `running` INSERT and the terminal UPDATE of
  `scans` (result, timings, the whole event log), the rule lookup (cached in a dict),
  the character-ownership INSERT;
- the answer's streamed JSON re-rendered as text and sent as `delta` events coalesced
  every DELTA_FLUSH_MS (100 ms by default), the tokens of each interval read at once;
  events ready together leave in one send.

No budgets, admission, metrics (/metrics is an empty 200), retries, reply caches, NOTIFY
listener or validation beyond what the work needs, and no image re-encoding: the JPEG
goes to the model as the data URL it came in (decoded once, for the row's hash). Its
stages are written out below, one by one: when ecoscan's list (app/stages/order.py) is
another, it refuses to start rather than measure another job.

    .venv/bin/python k6/cpu_per_scan.py --app k6/lean_floor:app
    DATABASE_URL=postgresql://... OPENAI_BASE_URL=http://127.0.0.1:8100/v1 OPENAI_API_KEY=sim \\
        .venv/bin/python -m uvicorn lean_floor:app --app-dir k6
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import hashlib
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import jiter
import orjson
import yarl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `app`, under uvicorn --app-dir k6

from app.db.migrations import apply_migrations, bundled_migrations
from app.db.pool import create_pool, pool_size, tagged_dsn
from app.db.taxonomy import Classification, Taxonomy, load_taxonomy
from app.scans.runner import progress_spans
from app.settings import Settings
from app.stages import answer as answer_stage
from app.stages import vision as vision_stage
from app.stages.order import STAGES
from app.upstream.call import safety_identifier

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

log = logging.getLogger("lean_floor")

SCAN_PATH = "/api/v1/scan/classify/completion"
FLOOR_STAGES = ("vision", "rule", "answer", "reward")  # what `LeanFloor.run` does, in order
# Each stage's progress at start and end, split by the stage list's shares (progress_spans
# reads each class's name and share only). Deltas climb by one, below the answer's end;
# done is 100.
SPANS = progress_spans(STAGES)
DELTA_CEILING = SPANS["answer"].completed - 1
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-store")]

# The floor's own SQL, on the tables of ecoscan's migrations (app/data/migrations/).
INSERT_SCAN = """
    INSERT INTO scans (id, user_id, status, image_source, image_sha256, user_input, instance_id)
    VALUES ($1, $2, 'running', $3, $4, $5, $6)"""
FINISH_SCAN = """
    UPDATE scans SET
        status = $2, classification = $3, situation_tags = $4, disposal_rules = $5,
        answer = $6, reward = $7, timings = $8, error_step = $9, error_code = $10,
        error_message = $11, event_log = $12, finished_at = now()
    WHERE id = $1"""
RULE_BY_KEY = """
    SELECT major, middle, document FROM disposal_rules WHERE major = $1 AND middle IS NOT DISTINCT FROM $2"""
RULE_BY_MINOR = """
    SELECT r.major, r.middle, r.document
    FROM taxonomy_minor m
    JOIN disposal_rules r ON r.major = m.major AND r.middle IS NOT DISTINCT FROM m.middle
    WHERE m.name = $1
    ORDER BY (m.major = $2) DESC, m.major
    LIMIT 1"""
OWN_CHARACTER = """
    INSERT INTO character_ownership (user_id, character_code, scan_id) VALUES ($1, $2, $3)
    ON CONFLICT (user_id, character_code) DO NOTHING
    RETURNING 1"""

ROW_RESULT = ("classification", "situation_tags", "disposal_rules", "answer", "reward")
VISION_SYSTEM: dict[str, Any] = {"role": "system", "content": vision_stage.SYSTEM_PROMPT}
VISION_INSTRUCTION: dict[str, Any] = {"type": "text", "text": vision_stage.INSTRUCTION}
ANSWER_SYSTEM: dict[str, Any] = {"role": "system", "content": answer_stage.SYSTEM_PROMPT}
# The rule document's parts the answer's prompt carries (the client gets all of it).
PROMPT_RULE_PARTS = ("summary", "preparation", "disposal")
# A rule lookup: `disposal_rules` as sent (None: no rule), the reason if none, what the answer's prompt gets.
Rule = tuple[dict[str, Any] | None, str | None, Any]


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 1)


def _json_schema(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


def _body(head: bytes, messages: list[dict[str, Any]], safety_id: str | None) -> bytes:
    """A request body: `head` (the call's constant fields, serialised once), then this call's."""
    fields: dict[str, Any] = {"messages": messages}
    if safety_id is not None:
        fields["safety_identifier"] = safety_id
    return head[:-1] + b"," + orjson.dumps(fields)[1:]


async def _respond(send: Send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Scan:
    """One scan: who asked, its events (stamped, kept for the row, sent in batches), its result."""

    def __init__(self, send: Send, user_id: str | None, received: float) -> None:
        self.send = send
        self.id = uuid.uuid4()
        self.job_id = str(self.id)
        self.user_id = user_id
        self.received = received
        self.seq = self.progress = 0
        self.step = "vision"
        self.log: list[list[Any]] = []
        self.pending: list[bytes] = []
        self.timings: dict[str, float] = {}
        self.result: dict[str, Any] = {}

    def event(self, kind: str, step: str, progress: int, fields: dict[str, Any]) -> None:
        self.seq += 1
        self.progress = max(self.progress, progress)
        self.log.append([self.seq, self.progress, kind, step, fields])
        data = orjson.dumps(
            {"job_id": self.job_id, "step": step, "seq": self.seq, "progress": self.progress, **fields}
        )
        self.pending.append(b"id: %d\nevent: %b\ndata: %b\n\n" % (self.seq, kind.encode(), data))

    def started(self, step: str) -> float:
        self.step = step
        self.event("stage", step, SPANS[step].started, {"status": "started"})
        return time.perf_counter()

    def completed(self, step: str, began: float, fields: dict[str, Any]) -> None:
        duration = self.timings[f"{step}_ms"] = _ms(began)
        self.event(
            "stage", step, SPANS[step].completed, {"status": "completed", "duration_ms": duration, **fields}
        )

    def delta(self, text: str) -> None:
        self.event("delta", "answer", min(DELTA_CEILING, self.progress + 1), {"text": text})

    async def flush(self, *, last: bool = False) -> None:
        body, self.pending = b"".join(self.pending), []
        await self.send({"type": "http.response.body", "body": body, "more_body": not last})


class LeanFloor:
    """The ASGI app; start-up fills in what every scan shares."""

    settings: Settings
    instance_id: uuid.UUID
    pool: asyncpg.Pool[asyncpg.Record]
    session: aiohttp.ClientSession
    url: yarl.URL
    taxonomy: Taxonomy
    tags: frozenset[str]
    characters: dict[str | None, dict[str, Any]]  # by middle category; None: the default one
    rules: dict[tuple[str, str | None, str | None], Rule]
    vision_head: bytes
    answer_head: bytes
    flush_s: float

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["type"] != "http":
            return
        elif scope["method"] == "POST" and scope["path"] == SCAN_PATH:
            await self.serve_scan(scope, receive, send)
        elif scope["method"] == "GET" and scope["path"] == "/readyz":
            await _respond(send, 200, b'{"status":"ok"}')
        elif scope["method"] == "GET" and scope["path"] == "/metrics":
            await _respond(send, 200, b"", b"text/plain; version=0.0.4")
        else:
            await _respond(send, 404, b'{"detail":"Not found.","code":"NOT_FOUND"}')

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.session.close()
                await self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        if tuple(SPANS) != FLOOR_STAGES:
            raise RuntimeError(f"ecoscan's stages are {list(SPANS)}, the floor's {list(FLOOR_STAGES)}")
        s = self.settings = Settings.from_env()
        if not (s.database_url and s.openai_base_url and s.openai_api_key):
            raise RuntimeError("DATABASE_URL, OPENAI_BASE_URL and OPENAI_API_KEY must be set")
        self.instance_id = uuid.uuid4()
        # ecoscan's own pool: its size, timeouts, orjson jsonb codec and no reset on release.
        dsn = tagged_dsn(s.database_url, self.instance_id)
        pool = s.limit("db_pool_max")
        size = pool.fixed or await pool_size(
            dsn, min_size=s.db_pool_min, cap=pool.cap, timeout_s=s.db_timeout_s
        )
        self.pool = await create_pool(dsn, min_size=s.db_pool_min, max_size=size, timeout_s=s.db_timeout_s)
        async with self.pool.acquire() as conn:
            await apply_migrations(conn, bundled_migrations())
            self.taxonomy = await load_taxonomy(conn)
            characters = await conn.fetch("SELECT code, name, dialog, middle FROM characters ORDER BY code")
        self.characters = {}
        for row in reversed(characters):  # the first default one wins, as in ecoscan
            self.characters[row["middle"]] = {key: row[key] for key in ("code", "name", "dialog")}
        self.tags = frozenset(self.taxonomy.tag_names)
        self.rules = {}
        self.flush_s = s.delta_flush_ms / 1000
        self.url = yarl.URL(s.openai_base_url.rstrip("/") + "/chat/completions")
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=60),
            headers={"Authorization": f"Bearer {s.openai_api_key}", "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=s.answer_timeout_s, sock_connect=s.openai_connect_timeout_s),
        )
        vision, answer = s.call_shape("vision"), s.call_shape("answer")
        vision_format = _json_schema("waste_classification", self.taxonomy.vision_schema())
        answer_format = _json_schema("disposal_answer", answer_stage.ANSWER_SCHEMA)
        streamed = {"stream": True, "stream_options": {"include_usage": True}}
        self.vision_head = orjson.dumps(
            {"model": vision.model, **vision.params, "response_format": vision_format}
        )
        self.answer_head = orjson.dumps(
            {"model": answer.model, **answer.params, **streamed, "response_format": answer_format}
        )

    async def serve_scan(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = time.perf_counter()
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        prepared = time.perf_counter()
        try:
            payload = orjson.loads(b"".join(chunks))
            image_url: str = payload["image_url"]
            header, _, data = image_url.partition(",")
            if not header.startswith("data:image/"):
                raise ValueError("image_url is not an image data URL")
            image_sha256 = hashlib.sha256(binascii.a2b_base64(data, strict_mode=True)).hexdigest()
            user_input: str | None = (payload.get("user_input") or "").strip() or None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            await _respond(
                send, 400, orjson.dumps({"detail": f"Bad request: {exc}", "code": "INVALID_REQUEST"})
            )
            return
        user_id = next((v.decode() for k, v in scope["headers"] if k == b"x-user-id"), None)
        scan = Scan(send, user_id, received)
        scan.timings["prepare_ms"] = _ms(prepared)
        source, owner = "data_url", self.instance_id
        await self.pool.execute(INSERT_SCAN, scan.id, user_id, source, image_sha256, user_input, owner)
        headers = [*SSE_HEADERS, (b"x-scan-id", scan.job_id.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            await self.run(scan, image_url, user_input)
        except Exception as exc:
            log.exception("scan %s failed in %s", scan.id, scan.step)
            error = (scan.step, "INTERNAL_ERROR", f"{type(exc).__name__}: {exc}"[:300])
            scan.timings["total_ms"] = _ms(received)
            scan.event("error", scan.step, 0, {"code": error[1], "message": error[2], "retryable": False})
            await self.finish(scan, "failed", error)
        await scan.flush(last=True)

    async def run(self, scan: Scan, image_url: str, user_input: str | None) -> None:
        """FLOOR_STAGES in order; events are flushed before each upstream call and at the end."""
        safety_id = safety_identifier(scan.user_id)
        began = scan.started("vision")
        await scan.flush()
        c, item, tags = await self.classify(image_url, user_input, safety_id)
        fields = {"classification": c.to_json(), "item_name": item, "situation_tags": tags}
        scan.result.update(fields)
        scan.completed("vision", began, fields)

        began = scan.started("rule")
        disposal_rules, reason, rule_prompt = await self.rule(c)
        scan.result.update(disposal_rules=disposal_rules, disposal_rules_reason=reason)
        scan.completed("rule", began, {"disposal_rules": disposal_rules, "reason": reason})

        began = scan.started("answer")
        await scan.flush()
        facts = {  # app/stages/answer.py's prompt: the rule first, then what this scan saw and asked
            "배출 규칙": rule_prompt,
            "분류": {"대분류": c.major, "중분류": c.middle, "품목": c.minor or item},
            "상황 태그": sorted(tags),
            "사용자 질문": user_input or "(없음)",
        }
        doc = await self.answer(scan, orjson.dumps(facts).decode(), safety_id)
        missing = [s.strip() for s in doc["insufficiencies"]]
        answer = {"steps": [s.strip() for s in doc["steps"]], "insufficiencies": missing}
        answer["user_answer"] = doc["user_answer"].strip()
        scan.result["answer"] = answer
        scan.completed("answer", began, {"answer": answer})

        began = scan.started("reward")
        reward = None
        eligible = c.major in self.taxonomy.recyclable and c.middle is not None
        character = (self.characters.get(c.middle) if c.middle else None) or self.characters.get(None)
        if eligible and disposal_rules is not None and not missing and character is not None:
            got = had = False  # anonymous: a match, no ownership row
            if scan.user_id is not None:
                inserted = await self.pool.fetchval(OWN_CHARACTER, scan.user_id, character["code"], scan.id)
                got, had = inserted is not None, inserted is None
            reward = {"character": character, "received": got, "already_owned": had}
        scan.result["reward"] = reward
        scan.completed("reward", began, {"reward": reward})

        scan.step = "done"
        scan.timings["total_ms"] = _ms(scan.received)
        scan.event("done", "done", 100, {**scan.result, "timings": scan.timings})
        await self.finish(scan, "completed", (None, None, None))

    async def finish(self, scan: Scan, status: str, error: tuple[str | None, ...]) -> None:
        """The terminal UPDATE: result, timings and the event log as sent, last event included."""
        result = (scan.result.get(column) for column in ROW_RESULT)
        events = orjson.dumps(scan.log).decode()
        await self.pool.execute(FINISH_SCAN, scan.id, status, *result, scan.timings, *error, events)

    async def classify(
        self, image_url: str, user_input: str | None, safety_id: str | None
    ) -> tuple[Classification, str, list[str]]:
        """The vision call, laid out as app/stages/vision.py lays it out, and its reply."""
        photo = {"type": "image_url", "image_url": {"url": image_url, "detail": self.settings.vision_detail}}
        content = [VISION_INSTRUCTION, photo]
        if user_input:
            content.append({"type": "text", "text": vision_stage.MEMO_PREFIX + user_input})
        messages = [VISION_SYSTEM, {"role": "user", "content": content}]
        async with self.session.post(self.url, data=_body(self.vision_head, messages, safety_id)) as response:
            body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"vision call: HTTP {response.status}: {body[:300]!r}")
        reply = orjson.loads(orjson.loads(body)["choices"][0]["message"]["content"])
        item = " ".join(str(reply.get("item") or "").split())[: vision_stage.MAX_ITEM_CHARS]
        c = self.taxonomy.classify(reply["category"], item)
        if c is None:
            raise ValueError(f"category outside the taxonomy: {reply['category']!r}")
        tags = [t for t in dict.fromkeys(reply.get("situation_tags") or ()) if t in self.tags]
        return c, item, tags[: vision_stage.MAX_TAGS]

    async def rule(self, c: Classification) -> Rule:
        """app/stages/rule.py's lookup (the exact key, the minor item's, the major's), cached for good."""
        key = (c.major, c.middle, c.minor)
        if (cached := self.rules.get(key)) is not None:
            return cached
        middle = c.middle if c.major in self.taxonomy.recyclable else None
        found: tuple[asyncpg.Record, str] | None = None
        async with self.pool.acquire() as conn:
            if (row := await conn.fetchrow(RULE_BY_KEY, c.major, middle)) is not None:
                found = row, "exact"
            elif c.minor and (row := await conn.fetchrow(RULE_BY_MINOR, c.minor, c.major)) is not None:
                found = row, "minor"
            elif middle is not None and (row := await conn.fetchrow(RULE_BY_KEY, c.major, None)) is not None:
                found = row, "major"
        if found is None:
            where = f"{c.major} > {c.middle}" if c.middle else c.major
            reason = f"'{where}'에 대한 배출 규칙이 등록되어 있지 않습니다."
            rule: Rule = (None, reason, reason)
        else:
            row, matched_by = found
            document, matched_key = row["document"], {"major": row["major"], "middle": row["middle"]}
            sent = {**document, "matched_by": matched_by, "key": matched_key}
            rule = (sent, None, {k: document[k] for k in PROMPT_RULE_PARTS if k in document})
        self.rules[key] = rule
        return rule

    async def answer(self, scan: Scan, facts: str, safety_id: str | None) -> dict[str, Any]:
        """The streamed answer call: its JSON rendered as text (app/stages/answer.py's
        `render`, prefix-stable as the JSON grows) and sent as deltas every `flush_s`."""
        messages = [ANSWER_SYSTEM, {"role": "user", "content": facts}]
        text, sent, buffer, last_flush = "", "", b"", 0.0
        async with self.session.post(self.url, data=_body(self.answer_head, messages, safety_id)) as response:
            if response.status != 200:
                body = await response.read()
                raise RuntimeError(f"answer call: HTTP {response.status}: {body[:300]!r}")
            async for data in response.content.iter_any():
                *lines, buffer = (buffer + data).split(b"\n")
                for line in lines:
                    if line.startswith(b"data:") and (payload := line[5:].strip()) != b"[DONE]":
                        for choice in orjson.loads(payload)["choices"]:
                            text += choice["delta"].get("content") or ""
                now = time.perf_counter()
                if text and now - last_flush >= self.flush_s:
                    try:
                        partial = jiter.from_json(text.encode(), partial_mode="trailing-strings")
                    except ValueError:
                        continue  # not a JSON prefix yet
                    rendered = answer_stage.render(partial) if isinstance(partial, dict) else ""
                    if len(rendered) > len(sent) and rendered.startswith(sent):
                        scan.delta(rendered[len(sent) :])
                        sent, last_flush = rendered, now
                        await scan.flush()
                        # The next flush_s of tokens piles up in the reader meanwhile: one
                        # wake-up instead of one per token (unless the stream ends first).
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self.flush_s):
                                await response.content.wait_eof()
        doc: dict[str, Any] = orjson.loads(text)
        rendered = answer_stage.render(doc)
        if len(rendered) > len(sent) and rendered.startswith(sent):
            scan.delta(rendered[len(sent) :])
        return doc


app = LeanFloor()
