"""Korean filler text about waste sorting, sized in streamed tokens."""

from __future__ import annotations

import random

from app.sim.tokens import count_tokens, split_tokens

SENTENCES = (
    "페트병은 내용물을 비우고 라벨을 떼어 투명 페트병 전용 수거함에 배출하세요.",
    "음식물이 묻은 용기는 물로 가볍게 헹군 뒤 분리배출해야 재활용이 가능합니다.",
    "종이류는 테이프와 스테이플러 심을 제거하고 납작하게 펴서 묶어 주세요.",
    "유리병은 뚜껑을 분리하고 깨지지 않도록 조심해서 유리류 수거함에 넣으세요.",
    "캔은 내용물을 비운 뒤 가능하면 압착하여 캔류로 배출합니다.",
    "오염이 심한 비닐은 재활용이 어려우므로 종량제 봉투에 버려 주세요.",
    "스티로폼은 이물질과 테이프를 제거한 뒤 흰색 스티로폼만 분리배출합니다.",
    "건전지와 형광등은 주민센터나 전용 수거함에 따로 배출해야 합니다.",
    "음식물 쓰레기는 물기를 최대한 제거한 뒤 음식물 전용 용기에 버리세요.",
    "여러 재질이 섞인 제품은 가능한 한 재질별로 분리해서 배출하는 것이 좋습니다.",
    "지역마다 배출 요일과 방법이 다를 수 있으니 관할 구청 안내를 확인하세요.",
    "깨진 유리나 도자기는 신문지에 싸서 불연성 쓰레기 마대에 담아 버립니다.",
    "우유팩과 멸균팩은 일반 종이와 구분하여 종이팩 전용 수거함에 배출하세요.",
    "플라스틱 용기에 붙은 스티커는 가능한 한 떼어 내고 배출해 주세요.",
    "대형 폐기물은 사전에 신고하고 스티커를 부착한 뒤 지정된 장소에 내놓으세요.",
    "의류는 깨끗한 상태로 의류 수거함에 넣으면 재사용될 수 있습니다.",
)
_SENTENCE_TOKENS = tuple(count_tokens(" " + s) for s in SENTENCES)


def korean_text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` streamed tokens of filler; never empty, cut at a token boundary."""
    tokens = max(1, tokens)
    picked: list[str] = []
    used = 0
    while used < tokens:
        i = rng.randrange(len(SENTENCES))
        picked.append(SENTENCES[i])
        used += _SENTENCE_TOKENS[i]
    text = " ".join(picked)
    if used - tokens <= 1:
        return text
    # Cut mid-sentence but end with a full stop so it still reads as a sentence.
    pieces = split_tokens(text)[: max(1, tokens - 1)]
    return "".join(pieces).rstrip(" .") + "."
