"""Replies that make sense for ecoscan's two calls: the vision classification and the answer.

Recognised by the shape of the json_schema (anything else gets the generic schema walker):

* vision — properties exactly ``category`` (enum of category paths), ``item`` (string) and
  ``situation_tags`` (array of an enum). The simulator picks a path the schema offers, an
  item known for that path and tags that fit the item; tags that ask for work before
  disposal (a label, contents left, ...) come only sometimes, so most recyclables are clean.
  The known items are the model's "world knowledge": the taxonomy seed shipped with the
  service (``app/data/migrations/002_taxonomy.sql``), read once.
* vision, several items — properties ``items`` (an array of the object above, with a
  ``box``) and ``main_item``: most photos show one item, some (``SEVERAL_SHARE``, drawn
  from the image alone, so a photo always shows the same) two to four: a scene of parts
  that go to different bins (a PET bottle, its label and its cap) or unrelated things. A
  note that names known items makes those the photo's items, every one named (a model
  does not count what it is told is there). Boxes are shares of the image; a part at the
  frame's edge gets a box past it, as models give them.
* answer — properties exactly ``user_answer``, ``steps`` and ``insufficiencies``. The prompt's
  user message is the JSON facts the answer stage sends (classification, tags, the rule's
  summary/preparation/disposal, the question); the reply echoes the question, lists the
  rule's steps and names only the tags that still need doing, within ``text_tokens``. For
  a photo of several items (the facts list ``품목들``) it says what to separate first,
  then item by item where each goes.

What is derived from a schema is cached by the schema's digest, and the parsed facts by the
prompt text, so a request costs a few dictionary lookups and a handful of string joins.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from app.sim.tokens import count_tokens, split_tokens

PATH_SEPARATOR = " > "
SEED_FILE = Path(__file__).resolve().parent.parent / "data" / "migrations" / "002_taxonomy.sql"
CLEAN_SHARE = 0.75  # of recyclable scans: nothing left to do before disposal
MAX_CACHED_SCHEMAS = 64
_MEMO = "사용자 메모:"
_NO_QUESTION = "(없음)"

# Tags that ask for something to be done before disposal, with the to-do an answer names.
ACTIONS = {
    "음식물 오염": "음식물이 묻은 부분을 물로 헹궈 주세요",
    "기름 오염": "기름기를 세제로 씻어 내 주세요",
    "양념 오염": "양념이 묻은 부분을 닦고 헹궈 주세요",
    "화장품 잔여물": "남은 내용물을 덜어 내고 헹궈 주세요",
    "흙 오염": "묻은 흙을 털어 내거나 씻어 주세요",
    "곰팡이": "곰팡이가 핀 것은 재활용이 어려우니 종량제봉투로 배출하세요",
    "약품 오염": "남은 약품을 완전히 비우고 헹궈 주세요",
    "이물질 혼합": "섞인 이물질을 골라내 주세요",
    "담배꽁초 투입": "안에 든 담배꽁초를 빼서 종량제봉투에 버려 주세요",
    "라벨 부착": "라벨을 떼어 주세요",
    "뚜껑 부착": "뚜껑을 빼서 재질에 맞게 따로 배출하세요",
    "테이프 부착": "테이프를 떼어 주세요",
    "운송장 부착": "운송장을 떼어 파기해 주세요",
    "스티커 부착": "스티커를 떼어 주세요",
    "철핀 부착": "철핀과 스테이플러 심을 빼 주세요",
    "스프링 제본": "스프링을 빼서 따로 배출하세요",
    "펌프 부착": "펌프를 분리해 종량제봉투로 버려 주세요",
    "빨대 부착": "빨대와 빨대 비닐을 떼어 주세요",
    "비닐 창 부착": "비닐 창을 뜯어 내 주세요",
    "끈 부착": "끈과 손잡이를 떼어 주세요",
    "완충재 포함": "안의 완충재를 꺼내 재질별로 나눠 주세요",
    "전지 내장": "들어 있는 전지를 꺼내 폐건전지 수거함에 따로 넣어 주세요",
    "랩 씌워짐": "씌워진 랩을 벗겨 주세요",
    "코팅됨": "코팅된 부분은 종이류가 아니니 떼어 종량제봉투로 버려 주세요",
    "내용물 남음": "남은 내용물을 비우고 헹궈 주세요",
    "물기 있음": "물기를 빼고 말려 주세요",
    "젖음": "젖은 것을 잘 말린 뒤 배출하세요",
    "말라붙음": "굳은 내용물을 불려서 씻어 내 주세요",
    "가스 잔류": "남은 가스를 화기 없는 실외에서 완전히 빼 주세요",
    "누액": "새는 액체에 닿지 않게 비닐에 밀봉해 주세요",
    "부풀어오름(배터리)": "부푼 배터리는 단자를 절연 테이프로 감싸 따로 배출하세요",
    "리튬 배터리": "단자를 절연 테이프로 감싸 주세요",
    "깨짐": "깨진 것은 신문지에 싸서 불연성 폐기물로 배출하세요",
    "날카로움": "날카로운 부분을 신문지로 감싸 주세요",
}
# A cap stays on a PET or plastic bottle (the rule says close it after squeezing the air out).
_FINE_FOR = {"뚜껑 부착": frozenset({"무색페트병", "플라스틱류"})}

# Per category (middle, or major without one): tags that fit a clean item, tags that need work.
_FIT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "종이": (("찢어짐", "부피 큼", "다량"), ("테이프 부착", "철핀 부착", "젖음", "이물질 혼합")),
    "종이팩": (("압착됨",), ("내용물 남음", "빨대 부착", "물기 있음")),
    "무색페트병": (("무색 투명", "찌그러짐", "뚜껑 부착"), ("라벨 부착", "내용물 남음", "담배꽁초 투입")),
    "플라스틱류": (
        ("유색", "찌그러짐", "뚜껑 부착"),
        ("라벨 부착", "내용물 남음", "음식물 오염", "양념 오염"),
    ),
    "비닐류": (("찢어짐", "다량"), ("음식물 오염", "이물질 혼합", "테이프 부착")),
    "발포합성수지": (("부피 큼", "파손됨"), ("테이프 부착", "운송장 부착", "음식물 오염")),
    "유리병": (("유색", "무색 투명"), ("뚜껑 부착", "내용물 남음", "담배꽁초 투입")),
    "금속류": (("찌그러짐", "녹슨 상태"), ("내용물 남음", "음식물 오염")),
    "의류및원단": (("재사용 가능",), ("젖음", "곰팡이")),
    "전지": (("소형 크기",), ("누액", "리튬 배터리")),
    "조명제품": (("수은 함유",), ("깨짐",)),
    "전기전자제품": (("재사용 가능",), ("전지 내장", "부품 분리됨")),
    "일반종량제폐기물": (("복합재질",), ()),
    "불연성종량제폐기물": (("도자기 재질",), ("깨짐", "날카로움")),
    "음식물류폐기물": (("물기 있음",), ()),
    "대형폐기물": (("대형 크기",), ()),
    "공사장생활폐기물": (("다량",), ()),
    "생활계유해폐기물": (("유독성 물질",), ()),
}
# Items whose tags differ from their category's.
_ITEM_FIT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "골판지 상자": (("부피 큼",), ("테이프 부착", "운송장 부착", "완충재 포함")),
    "과자 상자": (("찢어짐",), ("비닐 창 부착", "테이프 부착")),
    "노트": (("찢어짐",), ("스프링 제본", "철핀 부착")),
    "달력": ((), ("스프링 제본", "철핀 부착")),
    "종이 쇼핑백": (("찢어짐",), ("끈 부착", "테이프 부착")),
    "멸균팩": (("알루미늄 코팅", "압착됨"), ("내용물 남음", "빨대 부착")),
    "샴푸 용기": (("유색",), ("펌프 부착", "화장품 잔여물", "라벨 부착")),
    "세제 용기": (("유색",), ("약품 오염", "라벨 부착")),
    "스티로폼 상자": (("부피 큼",), ("테이프 부착", "운송장 부착")),
    "스티로폼 접시": ((), ("랩 씌워짐", "음식물 오염")),
    "부탄가스 용기": (("찌그러짐",), ("가스 잔류",)),
    "스프레이 캔": (("찌그러짐",), ("가스 잔류",)),
    "냄비": (("녹슨 상태",), ("기름 오염",)),
    "프라이팬": (("녹슨 상태",), ("기름 오염",)),
    "보조배터리": (("리튬 배터리",), ("부풀어오름(배터리)",)),
    "휴대폰 배터리": (("리튬 배터리",), ("부풀어오름(배터리)",)),
    "냉장고": (("대형 크기",), ("부품 분리됨",)),
    "세탁기": (("대형 크기",), ("부품 분리됨",)),
    "휴대폰": (("소형 크기",), ("전지 내장",)),
    "기저귀": (("위생 오염",), ()),
    "영수증": (("감열지",), ()),
    "깨진 유리": (("깨짐", "날카로움"), ()),
    "내열유리 식기": (("내열유리",), ()),
    "침대 매트리스": (("대형 크기", "금속 스프링 포함"), ()),
    "장롱": (("대형 크기", "나무 재질"), ()),
    "수은 체온계": (("수은 함유",), ()),
    "수은 혈압계": (("수은 함유",), ()),
    "폐시너": (("인화성 물질",), ()),
}


@lru_cache(maxsize=1)
def known_items() -> dict[str, tuple[str, ...]]:
    """Category path -> known item names, from the taxonomy seed (empty if it is missing)."""
    try:
        text = SEED_FILE.read_text(encoding="utf-8")
    except OSError:
        return {}
    start = text.find("INSERT INTO taxonomy_minor")
    block = text[start : text.find("ON CONFLICT", start)] if start >= 0 else ""
    items: dict[str, list[str]] = {}
    for major, middle, name in re.findall(
        r"\(\s*'([^']*)',\s*(NULL|'[^']*'),\s*'([^']*)',\s*\d+\s*\)", block
    ):
        path = major if middle == "NULL" else major + PATH_SEPARATOR + middle.strip("'")
        items.setdefault(path, []).append(name)
    return {path: tuple(names) for path, names in items.items()}


# --- vision -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Category:
    path: str
    recyclable: bool
    items: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _VisionWorld:
    """What one vision schema offers: categories (with pick weights), their items, the tags."""

    categories: tuple[_Category, ...]
    cumulative: tuple[float, ...]
    tags: frozenset[str]
    by_item: tuple[tuple[str, int], ...]  # (item, category index), longest names first

    def pick(self, rng: random.Random) -> tuple[_Category, str]:
        index = bisect.bisect_right(self.cumulative, rng.random() * self.cumulative[-1])
        category = self.categories[min(index, len(self.categories) - 1)]
        return category, rng.choice(category.items)

    def all_named_in(self, memo: str) -> list[tuple[_Category, str]]:
        """Every known item the note names, in the note's order (longest names first where
        they overlap: "플라스틱 뚜껑" is not also a "뚜껑")."""
        found: list[tuple[int, int, tuple[_Category, str]]] = []
        for item, index in self.by_item:
            start = memo.find(item)
            while start >= 0:
                end = start + len(item)
                if not any(s < end and start < e for s, e, _ in found):
                    found.append((start, end, (self.categories[index], item)))
                start = memo.find(item, end)
        return [named for _, _, named in sorted(found, key=lambda f: f[0])][:MAX_NAMED]

    def named_in(self, memo: str) -> tuple[_Category, str] | None:
        for item, index in self.by_item:
            if item in memo:
                return self.categories[index], item
        return None

    def fitting_tags(self, category: _Category, item: str, rng: random.Random) -> list[str]:
        key = category.path.rsplit(PATH_SEPARATOR, 1)[-1]
        fine, work = _ITEM_FIT.get(item) or _FIT.get(key, ((), ()))
        fine = tuple(t for t in fine if t in self.tags)
        work = tuple(t for t in work if t in self.tags)
        tags: list[str] = []
        if fine and rng.random() < 0.5:
            tags.append(rng.choice(fine))
        clean = rng.random() < (CLEAN_SHARE if category.recyclable else 0.5)
        if work and not clean:
            tags.extend(
                t for t in rng.sample(work, min(len(work), 1 + (rng.random() < 0.2))) if t not in tags
            )
        return tags


_worlds: dict[bytes, _VisionWorld | None] = {}


def _vision_world(schema: dict[str, Any], key: bytes) -> _VisionWorld | None:
    if key in _worlds:
        return _worlds[key]
    world = _build_world(schema)
    if len(_worlds) >= MAX_CACHED_SCHEMAS:
        _worlds.clear()
    _worlds[key] = world
    return world


def _build_world(schema: dict[str, Any]) -> _VisionWorld | None:
    props = schema.get("properties")
    if not isinstance(props, dict) or set(props) != {"category", "item", "situation_tags"}:
        return None
    paths = props["category"].get("enum") if isinstance(props["category"], dict) else None
    tag_items = props["situation_tags"].get("items") if isinstance(props["situation_tags"], dict) else None
    tags = tag_items.get("enum") if isinstance(tag_items, dict) else None
    if not paths or not all(isinstance(p, str) for p in paths) or not isinstance(tags, list):
        return None
    known = known_items()
    categories: list[_Category] = []
    cumulative: list[float] = []
    total = 0.0
    for path in paths:
        recyclable = PATH_SEPARATOR in path
        # A name, never a sentence: the category's own name when no item is known for it.
        items = known.get(path) or (path.rsplit(PATH_SEPARATOR, 1)[-1],)
        categories.append(_Category(path, recyclable, items))
        # Most photos people take are of recyclables; few are unidentifiable.
        total += 2.0 if recyclable else (0.3 if "판별 불가" in items else 1.0)
        cumulative.append(total)
    # The items a note may name: the known ones, and the scenes' parts (a label is no
    # taxonomy item, but a model knows one when it is told of it).
    at = {c.path: i for i, c in enumerate(categories)}
    named = {(item, i) for i, c in enumerate(categories) for item in c.items}
    named |= {(item, at[path]) for scene in SCENES for path, item in scene if path in at}
    by_item = sorted(named, key=lambda p: (-len(p[0]), p))
    return _VisionWorld(
        tuple(categories), tuple(cumulative), frozenset(t for t in tags if isinstance(t, str)), tuple(by_item)
    )


def vision_document(
    schema: dict[str, Any], key: bytes, text: str, rng: random.Random, image_key: bytes = b""
) -> dict[str, Any] | None:
    """The classification reply for our vision schema, or None for any other schema."""
    inner = _items_schema(schema)
    if inner is not None:
        world = _vision_world(inner, key)
        return None if world is None else items_document(world, text, rng, image_key)
    world = _vision_world(schema, key)
    if world is None:
        return None
    memo_at = text.find(_MEMO)
    named = world.named_in(text[memo_at + len(_MEMO) :]) if memo_at >= 0 else None
    category, item = world.pick(rng)
    if named is not None:
        category, item = named
    tags = world.fitting_tags(category, item, rng)
    values = {"category": category.path, "item": item, "situation_tags": tags}
    return {name: values[name] for name in schema["properties"]}


# --- vision, several items -------------------------------------------------------------------

SEVERAL_SHARE = 0.25  # of photos: two to four items
MAX_NAMED = 8  # items a note may name
# Photos of one thing in parts that go to different bins: (category path, item), main first.
SCENES: tuple[tuple[tuple[str, str], ...], ...] = (
    (
        ("재활용폐기물 > 무색페트병", "생수병"),
        ("재활용폐기물 > 비닐류", "라벨"),
        ("재활용폐기물 > 플라스틱류", "플라스틱 뚜껑"),
    ),
    (
        ("재활용폐기물 > 플라스틱류", "배달 용기"),
        ("재활용폐기물 > 플라스틱류", "플라스틱 뚜껑"),
        ("일반종량제폐기물", "나무젓가락"),
        ("음식물류폐기물", "남은 반찬"),
    ),
    (("재활용폐기물 > 유리병", "맥주병"), ("재활용폐기물 > 금속류", "병뚜껑")),
    (
        ("재활용폐기물 > 종이", "골판지 상자"),
        ("재활용폐기물 > 비닐류", "에어캡"),
        ("재활용폐기물 > 발포합성수지", "스티로폼 완충재"),
    ),
)


def _items_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The item object of our several-items schema (as any flavour sends it), or None."""
    props = schema.get("properties")
    if not isinstance(props, dict) or set(props) != {"items", "main_item"}:
        return None
    items = props["items"].get("items") if isinstance(props["items"], dict) else None
    inner = items.get("properties") if isinstance(items, dict) else None
    if not isinstance(inner, dict) or set(inner) != {"category", "item", "situation_tags", "box"}:
        return None
    return {"properties": {k: v for k, v in inner.items() if k != "box"}}


def items_document(world: _VisionWorld, text: str, rng: random.Random, image_key: bytes) -> dict[str, Any]:
    """The photo's items (see the module docstring), each with tags and a box."""
    photo = random.Random(int.from_bytes(hashlib.sha256(b"items\x00" + image_key).digest()[:8], "big"))
    memo_at = text.find(_MEMO)
    named = world.all_named_in(text[memo_at + len(_MEMO) :]) if memo_at >= 0 else []
    several = image_key and photo.random() < SEVERAL_SHARE  # drawn first: the photo's own
    if named:
        picked = named
    elif several:
        picked = _several(world, photo)
    else:
        picked = [world.pick(rng)]
    boxes = _boxes(len(picked), photo)
    items = [
        {
            "category": category.path,
            "item": item,
            "situation_tags": world.fitting_tags(category, item, rng),
            "box": box,
        }
        for (category, item), box in zip(picked, boxes, strict=True)
    ]
    return {"items": items, "main_item": 0}


def _several(world: _VisionWorld, photo: random.Random) -> list[tuple[_Category, str]]:
    """Two to four items: a scene of parts (half the time, where the schema offers its
    categories), else unrelated things."""
    by_path = {c.path: c for c in world.categories}
    if photo.random() < 0.5:
        scene = SCENES[photo.randrange(len(SCENES))]
        parts = [(by_path[path], item) for path, item in scene if path in by_path]
        if len(parts) > 1:
            return parts
    return [world.pick(photo) for _ in range(photo.randint(2, 4))]


def _boxes(count: int, photo: random.Random) -> list[dict[str, float]]:
    """The main item large near the middle, the others smaller around it; with three or
    more, the last at the right edge, its box past it (cut off by the frame)."""
    boxes = []
    for i in range(count):
        if i == 0:
            x, y, w, h = photo.uniform(0.15, 0.3), photo.uniform(0.1, 0.25), 0.4, photo.uniform(0.45, 0.6)
        elif i == count - 1 and count >= 3:
            x, y, w, h = photo.uniform(0.8, 0.9), photo.uniform(0.3, 0.6), 0.2, 0.2
        else:
            x, y, w, h = photo.uniform(0.0, 0.6), photo.uniform(0.6, 0.75), 0.2, photo.uniform(0.15, 0.25)
        boxes.append({"x": round(x, 3), "y": round(y, 3), "width": round(w, 3), "height": round(h, 3)})
    return boxes


# --- answer -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Facts:
    major: str
    middle: str | None
    item: str
    tags: tuple[str, ...]
    rule: dict[str, Any] | None
    reason: str | None
    question: str | None


@lru_cache(maxsize=4096)
def _facts(text: str) -> _Facts | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or "분류" not in doc:
        return None
    raw = doc.get("분류")
    c: dict[str, Any] = raw if isinstance(raw, dict) else {}
    major = _str(c.get("대분류"))
    middle = _str(c.get("중분류")) or None
    item = _str(c.get("품목")) or middle or major or "이 품목"
    raw_tags = doc.get("상황 태그")
    tags = tuple(t for t in raw_tags if isinstance(t, str)) if isinstance(raw_tags, list) else ()
    rule = doc.get("배출 규칙")
    question = doc.get("사용자 질문")
    if not isinstance(question, str) or not question.strip() or question.strip() == _NO_QUESTION:
        question = None
    return _Facts(
        major,
        middle,
        item,
        tags,
        rule if isinstance(rule, dict) else None,
        rule if isinstance(rule, str) else None,
        " ".join(question.split())[:60] if question else None,
    )


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def answer_document(schema: dict[str, Any], text: str, text_tokens: int) -> dict[str, Any] | None:
    """The guidance reply for our answer schema and facts prompt, or None otherwise."""
    props = schema.get("properties")
    if not isinstance(props, dict) or set(props) != {"user_answer", "steps", "insufficiencies"}:
        return None
    several = _several_facts(text)
    if several is not None:
        return _several_answer(several, props, text_tokens)
    facts = _facts(text)
    if facts is None:
        return None
    category = facts.middle or facts.major or "해당 분류"
    todo = [
        ACTIONS[t] + "."
        for t in facts.tags
        if t in ACTIONS and (facts.middle or facts.major) not in _FINE_FOR.get(t, ())
    ]
    steps = _rule_steps(facts)
    opening = f"{_topic(facts.item)} {_direction(category)} 배출합니다."
    if facts.question is not None:
        related = _related_step(facts.question, steps)
        opening = f'질문하신 "{facts.question}"에 답하면, ' + (related or opening)
    sentences = [opening]
    if facts.rule is not None and isinstance(facts.rule.get("summary"), str):
        sentences.append(facts.rule["summary"])
    elif facts.reason:
        sentences.append(f"맞는 배출 규칙을 찾지 못했습니다({facts.reason}).")
    if todo:
        sentences.append(f"배출 전에 {len(todo)}가지를 먼저 해 주세요.")
    elif facts.rule is not None:
        sentences.append("지금 상태 그대로 배출하면 됩니다.")
    user_answer, kept = _fit_budget(sentences, steps, todo, text_tokens, facts.question is not None)
    values = {"user_answer": user_answer, "steps": kept, "insufficiencies": todo}
    return {name: values[name] for name in props}


@lru_cache(maxsize=1024)
def _several_facts(text: str) -> tuple[list[_Facts], str | None] | None:
    """The items of a several-items facts prompt (each with its rule), and the question."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("품목들"), list):
        return None
    found_rules = doc.get("배출 규칙")
    rules: dict[str, Any] = found_rules if isinstance(found_rules, dict) else {}
    question = doc.get("사용자 질문")
    if not isinstance(question, str) or not question.strip() or question.strip() == _NO_QUESTION:
        question = None
    items: list[_Facts] = []
    for raw in doc["품목들"]:
        if not isinstance(raw, dict):
            continue
        found_c = raw.get("분류")
        c: dict[str, Any] = found_c if isinstance(found_c, dict) else {}
        major, middle = _str(c.get("대분류")), _str(c.get("중분류")) or None
        rule = rules.get(_str(raw.get("규칙")))
        tags = raw.get("상황 태그")
        items.append(
            _Facts(
                major,
                middle,
                _str(c.get("품목")) or middle or major or "이 품목",
                tuple(t for t in tags if isinstance(t, str)) if isinstance(tags, list) else (),
                rule if isinstance(rule, dict) else None,
                rule if isinstance(rule, str) else None,
                None,
            )
        )
    if not items:
        return None
    return items, (" ".join(question.split())[:60] if question else None)


def _several_answer(
    several: tuple[list[_Facts], str | None], props: dict[str, Any], text_tokens: int
) -> dict[str, Any]:
    """What to separate first, then item by item where it goes; only the to-dos left."""
    items, question = several
    parts = [f.item for f in items[1:]]
    separate = f"먼저 {_object(', '.join(parts))} {items[0].item}에서 떼어 분리하세요."
    steps = [separate]
    todo: list[str] = []
    for f in items:
        category = f.middle or f.major or "해당 분류"
        first = _rule_steps(f)[-1]
        steps.append(f"{f.item}: {_direction(category)} 배출 — {first}")
        todo.extend(
            f"{f.item}: {ACTIONS[t]}."
            for t in f.tags
            if t in ACTIONS and (f.middle or f.major) not in _FINE_FOR.get(t, ())
        )
    opening = f"사진에 품목 {len(items)}개가 있습니다. {separate}"
    if question is not None:
        opening = f'질문하신 "{question}"에 답하면, {opening}'
    sentences = [opening, "각 품목은 아래 순서대로 배출하세요."]
    user_answer, kept = _fit_budget(sentences, steps, todo, text_tokens, True)
    values = {"user_answer": user_answer, "steps": kept, "insufficiencies": todo}
    return {name: values[name] for name in props}


def _object(word: str) -> str:
    return word + ("을" if _batchim(word) > 0 else "를")


def _rule_steps(facts: _Facts) -> list[str]:
    steps: list[str] = []
    if facts.rule is not None:
        for key in ("preparation", "disposal"):
            part = facts.rule.get(key)
            if isinstance(part, list):
                steps.extend(s for s in part if isinstance(s, str) and s)
    return steps or ["배출 방법은 관할 지자체 안내를 확인해 주세요."]


def _fit_budget(
    sentences: list[str], steps: list[str], todo: list[str], budget: int, keep_opening: bool
) -> tuple[str, list[str]]:
    """The user answer cut to its share and the steps that fit; the first step always stays."""
    remaining = max(0, budget - sum(count_tokens(t) for t in todo))
    floor = count_tokens(sentences[0]) if keep_opening else 0
    share = max(2, floor, remaining // 3)
    kept = [steps[0]]
    used = count_tokens(steps[0])
    for step in steps[1:]:
        cost = count_tokens(step)
        if used + cost > remaining - share:
            break
        kept.append(step)
        used += cost
    share += max(0, remaining - share - used)
    return _cut(sentences, share), kept


def _cut(sentences: list[str], tokens: int) -> str:
    """The whole sentences that fit in ``tokens`` streamed tokens; if not even the first
    does, the first cut at a token boundary and closed with a full stop."""
    kept: list[str] = []
    used = 0
    for sentence in sentences:
        used += count_tokens(sentence) + (1 if kept else 0)
        if used > tokens:
            break
        kept.append(sentence)
    if kept:
        return " ".join(kept)
    pieces = split_tokens(sentences[0])[: max(1, tokens - 1)]
    return "".join(pieces).rstrip(" .,") + "."


_PARTICLE = re.compile(r"(은|는|이|가|을|를|도|에|의|로|으로|에서|만|랑|이랑|하고|요)$")


def _related_step(question: str, steps: list[str]) -> str | None:
    """The first rule step that mentions a word of the question, if any."""
    for word in re.findall(r"[가-힣A-Za-z]{2,}", question):
        stem = _PARTICLE.sub("", word) if len(word) > 2 else word
        if len(stem) < 2:
            continue
        for step in steps:
            if stem in step:
                return step
    return None


def _batchim(word: str) -> int:
    """The final consonant index of the word's last syllable (0: none, 8: ㄹ; -1: not Hangul)."""
    last = word.rstrip()[-1:] or "가"
    if "가" <= last <= "힣":
        return (ord(last) - 0xAC00) % 28
    return -1


def _topic(word: str) -> str:
    return word + ("은" if _batchim(word) > 0 else "는")


def _direction(word: str) -> str:
    final = _batchim(word)
    return word + ("으로" if final > 0 and final != 8 else "로")
