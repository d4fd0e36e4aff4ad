"""Per-model behaviour of the real Chat Completions API, as the simulator enforces it.

The simulator keeps its own table on purpose: it must not share the service's model
knowledge, or a wrong entry there would be mirrored here and never caught by a test.

Sources:

- Image input costs: OpenAI's vision guide, section "Calculating costs"
  (https://platform.openai.com/docs/guides/images-vision#calculating-costs). Tile models
  pay ``base`` plus ``per_tile`` for each 512-px tile; patch models pay one token per
  32-px patch (at most 1536 patches) times a per-model multiplier. For patch models
  ``detail: "low"`` does not lower the cost (measured against the real API).
- Parameters: OpenAI's API reference (``max_tokens`` is "not compatible with o-series
  models"; ``reasoning_effort`` values differ per model) and its reasoning and GPT-5.1
  guides (``none`` is the default effort from gpt-5.1 on, and temperature/top_p other
  than 1 are accepted only while reasoning is off).

Gemini (the ``gemini`` flavour, app/sim/gemini.py) has its own table, GEMINI_FAMILIES:

- Image input costs: Gemini's token guide ("Image inputs with both dimensions <= 384
  pixels are counted as 258 tokens. Images larger in one or both dimensions are cropped
  and scaled as needed into tiles of 768x768 pixels, each counted as 258 tokens"); the
  simulator tiles by ceil(w / 768) * ceil(h / 768). ``detail`` does not change it.
- Thinking: ``reasoning_effort`` maps to a thinking budget on Gemini 2.5 (OpenAI
  compatibility guide). 2.5 Flash and Flash-Lite can turn thinking off (``none``), 2.5 Pro
  cannot; Flash-Lite does not think unless asked; 2.0 Flash does not think at all.
  ``max_tokens``/``max_completion_tokens`` cover thinking too (Gemini's maxOutputTokens).

A model name matches a family when it equals one of the family's names or extends one
with ``-`` (dated snapshots: ``gpt-4o-mini-2024-07-18``); the longest matching name wins,
so ``gpt-4o-mini`` is not taken for ``gpt-4o``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Every value the API's ReasoningEffort enum accepts; a model supports a subset.
EFFORT_VALUES = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
CAP_PARAMS = ("max_tokens", "max_completion_tokens")
COMPLETION_CAP = ("max_completion_tokens",)
GPT5_EFFORTS = ("minimal", "low", "medium", "high")
GPT51_EFFORTS = ("none", "low", "medium", "high")
GPT52_EFFORTS = ("none", "low", "medium", "high", "xhigh")
O_EFFORTS = ("low", "medium", "high")


@dataclass(frozen=True, slots=True)
class Tiles:
    """``base`` tokens per image, plus ``per_tile`` per 512-px tile unless detail is low."""

    base: int
    per_tile: int


@dataclass(frozen=True, slots=True)
class GeminiTiles:
    """``per_tile`` tokens for an image within ``small`` px on both sides, else per tile."""

    per_tile: int = 258
    small: int = 384
    tile: int = 768


@dataclass(frozen=True, slots=True)
class Patches:
    """``round(patches * multiplier)`` tokens, patches being 32x32 px, at most 1536."""

    multiplier: float


ImageBilling = Tiles | Patches | GeminiTiles


class Sampling(enum.Enum):
    """When ``temperature`` / ``top_p`` may differ from their default of 1."""

    FREE = "free"
    DEFAULT_ONLY = "default_only"
    FREE_WITHOUT_REASONING = "free_without_reasoning"  # only at effort "none"


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One family's rules. ``names`` are listed at ``/v1/models`` and matched as prefixes."""

    family: str
    names: tuple[str, ...]
    reasoning: bool
    cap_params: tuple[str, ...]
    efforts: tuple[str, ...]
    default_effort: str | None
    sampling: Sampling
    images: Tiles | Patches | GeminiTiles | None  # None: the model takes no image input

    def sampling_allowed(self, effort: str | None) -> bool:
        """Whether temperature/top_p may differ from 1 at this effective effort."""
        if self.sampling is Sampling.FREE:
            return True
        return self.sampling is Sampling.FREE_WITHOUT_REASONING and effort == "none"


def _chat(family: str, names: tuple[str, ...], images: Tiles | Patches) -> ModelFamily:
    """A non-reasoning model: both cap params, free sampling, no reasoning_effort."""
    return ModelFamily(family, names, False, CAP_PARAMS, (), None, Sampling.FREE, images)


def _reasoner(
    family: str,
    names: tuple[str, ...],
    efforts: tuple[str, ...],
    default: str,
    images: Tiles | Patches | None,
    sampling: Sampling = Sampling.DEFAULT_ONLY,
) -> ModelFamily:
    """A reasoning model: only max_completion_tokens, which covers reasoning + output."""
    return ModelFamily(family, names, True, COMPLETION_CAP, efforts, default, sampling, images)


_LATE = Sampling.FREE_WITHOUT_REASONING

FAMILIES: tuple[ModelFamily, ...] = (
    _chat("gpt-4o", ("gpt-4o", "chatgpt-4o-latest"), Tiles(85, 170)),
    _chat("gpt-4o-mini", ("gpt-4o-mini",), Tiles(2833, 5667)),
    _chat("gpt-4.1", ("gpt-4.1",), Tiles(85, 170)),
    _chat("gpt-4.1-mini", ("gpt-4.1-mini",), Patches(1.62)),
    _chat("gpt-4.1-nano", ("gpt-4.1-nano",), Patches(2.46)),
    _chat("gpt-4.5", ("gpt-4.5-preview",), Tiles(85, 170)),
    _reasoner("gpt-5", ("gpt-5", "gpt-5-chat-latest"), GPT5_EFFORTS, "medium", Tiles(70, 140)),
    _reasoner("gpt-5-mini", ("gpt-5-mini",), GPT5_EFFORTS, "medium", Patches(1.62)),
    _reasoner("gpt-5-nano", ("gpt-5-nano",), GPT5_EFFORTS, "medium", Patches(2.46)),
    _reasoner("gpt-5.1", ("gpt-5.1",), GPT51_EFFORTS, "none", Tiles(70, 140), _LATE),
    _reasoner(
        "gpt-5.2+",
        ("gpt-5.2", "gpt-5.3-chat-latest", "gpt-5.4", "gpt-5.5"),
        GPT52_EFFORTS,
        "none",
        Patches(1.2),
        _LATE,
    ),
    _reasoner("o1", ("o1",), O_EFFORTS, "medium", Tiles(75, 150)),
    _reasoner("o3", ("o3",), O_EFFORTS, "medium", Tiles(75, 150)),
    _reasoner("o3-mini", ("o3-mini",), O_EFFORTS, "medium", None),
    _reasoner("o4-mini", ("o4-mini",), O_EFFORTS, "medium", Patches(1.72)),
)

GEMINI_FLASH_EFFORTS = ("none", "low", "medium", "high")
GEMINI_PRO_EFFORTS = ("low", "medium", "high")
_GEMINI_TILES = GeminiTiles()


def _gemini(family: str, efforts: tuple[str, ...], default: str | None) -> ModelFamily:
    """A Gemini model: both cap params, free sampling, thinking when ``efforts``."""
    reasoning = bool(efforts)
    return ModelFamily(
        family, (family,), reasoning, CAP_PARAMS, efforts, default, Sampling.FREE, _GEMINI_TILES
    )


GEMINI_FAMILIES: tuple[ModelFamily, ...] = (
    _gemini("gemini-2.5-pro", GEMINI_PRO_EFFORTS, "medium"),  # dynamic thinking, always on
    _gemini("gemini-2.5-flash", GEMINI_FLASH_EFFORTS, "medium"),  # dynamic thinking by default
    _gemini("gemini-2.5-flash-lite", GEMINI_FLASH_EFFORTS, "none"),  # thinks only when asked
    _gemini("gemini-2.0-flash", (), None),
    _gemini("gemini-2.0-flash-lite", (), None),
)

_BY_NAME = {name: family for family in FAMILIES for name in family.names}
_GEMINI_BY_NAME = {name: family for family in GEMINI_FAMILIES for name in family.names}


def _table(flavor: str) -> dict[str, ModelFamily]:
    return _GEMINI_BY_NAME if flavor == "gemini" else _BY_NAME


def family_for(model: str, flavor: str = "openai") -> ModelFamily | None:
    """The family of ``model`` (longest matching name) in ``flavor``'s table, or None.

    OpenAI and Azure OpenAI serve the same models; Gemini its own.
    """
    table = _table(flavor)
    best: str | None = None
    for name in table:
        if (model == name or model.startswith(name + "-")) and (best is None or len(name) > len(best)):
            best = name
    return None if best is None else table[best]


def listed_models(flavor: str = "openai") -> tuple[str, ...]:
    """Model ids the flavour's model listing reports, in table order."""
    return tuple(_table(flavor))
