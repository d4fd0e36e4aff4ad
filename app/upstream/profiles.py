"""What each model family accepts and how it bills: the one table every OpenAI call is
shaped by (token-cap parameter, sampling, reasoning effort, image costs).

Matching is by name prefix, longest first, so dated snapshots (`gpt-4o-mini-2024-07-18`)
and minor versions (`gpt-5.4`) find their family. A model not in the table gets
`DEFAULT_PROFILE`: a non-reasoning chat model that accepts sampling parameters and bills
images like gpt-4o; that suits OpenAI-compatible servers (vLLM, Ollama, LiteLLM...) and is
logged at start-up, because for a new OpenAI model it may be wrong.

Image costs are OpenAI's published vision cost table (platform.openai.com/docs/guides/
images-vision, "Calculating costs"): tiles of 512 px at `base + tile × tiles` (`low` = the
base alone) for gpt-4o/4.1/4.5 (85 + 170), gpt-4o-mini (2833 + 5667), gpt-5/gpt-5.1
(70 + 140) and o1/o3 (75 + 150); 32-px patches times a multiplier for gpt-4.1-mini (1.62),
gpt-4.1-nano (2.46), gpt-5-mini (1.62), gpt-5-nano (2.46) and o4-mini (1.72). Measurements
published since (OpenAI's community forum, 2026) put gpt-5-mini nearer 1.2 per patch; we
reserve by the published figure, since erring high only costs a reservation that
settles to the real usage.

Reasoning models (gpt-5 family, o-series) take `max_completion_tokens`, which covers the
hidden reasoning *and* the visible reply, reject `max_tokens`, and reject `temperature`
/`top_p` other than 1 (gpt-5.1 and later allow them at effort `none`). Our default effort
is the family's cheapest: `none` where it exists, else `minimal` (gpt-5) or `low` (o-series).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from app.upstream.tokens import TILES_GPT_4O, GeminiTiles, ImageBilling, Patches, Tiles

TokenParam = Literal["max_completion_tokens", "max_tokens"]
TOKEN_PARAM_CHOICES = ("auto", "max_completion_tokens", "max_tokens")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

# Reasoning tokens reserved on top of the visible-output cap, per effort. Generous on
# purpose: a reply that runs out of room mid-thought fails (`UPSTREAM_TOKEN_LIMIT`), while
# an over-sized cap only reserves budget that the call's real usage gives back.
REASONING_ALLOWANCE = {"none": 0, "minimal": 512, "low": 2048, "medium": 8192, "high": 24576, "xhigh": 32768}

_GPT5 = ("minimal", "low", "medium", "high")
_GPT51 = ("none", "low", "medium", "high")
_GPT52 = ("none", "low", "medium", "high", "xhigh")
_O_SERIES = ("low", "medium", "high")


@dataclass(frozen=True)
class ModelProfile:
    family: str
    image: ImageBilling
    efforts: tuple[str, ...] = ()  # supported reasoning_effort values; () = not a reasoning model
    default_effort: str | None = None
    # Whether temperature/top_p may differ from 1: always, never, or only at effort `none`.
    sampling: Literal["always", "never", "at_none"] = "always"
    openai: bool = True  # an OpenAI model (known to take `max_completion_tokens`)

    @property
    def reasoning(self) -> bool:
        return bool(self.efforts)

    def effort(self, requested: str | None) -> str | None:
        """The effort to send: the requested one (checked) or our default; None if N/A."""
        if not self.reasoning:
            if requested:
                raise ValueError(f"{self.family} is not a reasoning model: it takes no reasoning effort")
            return None
        if requested and requested not in self.efforts:
            raise ValueError(
                f"{self.family} supports reasoning efforts {', '.join(self.efforts)}; got {requested!r}"
            )
        return requested or self.default_effort

    def allows_sampling(self, effort: str | None) -> bool:
        return self.sampling == "always" or (self.sampling == "at_none" and effort == "none")

    def token_param(self, choice: str) -> TokenParam:
        if choice == "max_tokens":
            if self.reasoning:
                raise ValueError(f"{self.family} rejects max_tokens; it needs max_completion_tokens")
            return "max_tokens"
        if choice == "max_completion_tokens" or self.openai:
            return "max_completion_tokens"
        return "max_tokens"  # auto, on a model we do not know: what every compatible server reads


def _tiles(base: int, tile: int) -> ImageBilling:
    return Tiles(base, tile)


def _patches(multiplier: float) -> ImageBilling:
    return Patches(multiplier)


def _reasoning(family: str, image: ImageBilling, efforts: tuple[str, ...], default: str) -> ModelProfile:
    sampling: Literal["never", "at_none"] = "at_none" if "none" in efforts else "never"
    return ModelProfile(family, image, efforts, default, sampling)


_GPT_5_TILES = _tiles(70, 140)
_TABLE: dict[str, ModelProfile] = {
    "gpt-4o": ModelProfile("gpt-4o", TILES_GPT_4O),
    "gpt-4o-mini": ModelProfile("gpt-4o-mini", _tiles(2833, 5667)),
    "gpt-4.1": ModelProfile("gpt-4.1", TILES_GPT_4O),
    "gpt-4.1-mini": ModelProfile("gpt-4.1-mini", _patches(1.62)),
    "gpt-4.1-nano": ModelProfile("gpt-4.1-nano", _patches(2.46)),
    "gpt-4.5": ModelProfile("gpt-4.5", TILES_GPT_4O),
    "gpt-5": _reasoning("gpt-5", _GPT_5_TILES, _GPT5, "minimal"),
    "gpt-5-chat": ModelProfile("gpt-5-chat", _GPT_5_TILES),
    "gpt-5-mini": _reasoning("gpt-5-mini", _patches(1.62), _GPT5, "minimal"),
    "gpt-5-nano": _reasoning("gpt-5-nano", _patches(2.46), _GPT5, "minimal"),
    "gpt-5.1": _reasoning("gpt-5.1", _GPT_5_TILES, _GPT51, "none"),
    # gpt-5.2 and later: not in the published table yet; patches at the measured 1.2 would
    # under-reserve if wrong, so the gpt-5 tile rate (higher for our small images) it is.
    "gpt-5.": _reasoning("gpt-5.x", _GPT_5_TILES, _GPT52, "none"),
    "o1": _reasoning("o1", _tiles(75, 150), _O_SERIES, "low"),
    "o3": _reasoning("o3", _tiles(75, 150), _O_SERIES, "low"),
    "o3-mini": _reasoning("o3-mini", _patches(1.72), _O_SERIES, "low"),
    "o4-mini": _reasoning("o4-mini", _patches(1.72), _O_SERIES, "low"),
}
# Gemini (its OpenAI-compatible endpoint): `max_tokens`, free sampling, images in 768-px
# tiles; 2.5's thinking set by `reasoning_effort` (Flash can turn it off, Pro cannot).
_GEMINI_TILES = GeminiTiles()
_GEMINI_FLASH = ("none", "low", "medium", "high")
_TABLE.update(
    {
        "gemini-2.5-pro": ModelProfile(
            "gemini-2.5-pro", _GEMINI_TILES, ("low", "medium", "high"), "low", openai=False
        ),
        "gemini-2.5-flash": ModelProfile(
            "gemini-2.5-flash", _GEMINI_TILES, _GEMINI_FLASH, "none", openai=False
        ),
        "gemini-2.0-flash": ModelProfile("gemini-2.0-flash", _GEMINI_TILES, openai=False),
    }
)
_BY_LENGTH = sorted(_TABLE.items(), key=lambda item: len(item[0]), reverse=True)

DEFAULT_PROFILE = ModelProfile("default", TILES_GPT_4O, openai=False)


def profile_for(model: str) -> ModelProfile:
    """By the model's own name: a publisher's prefix (Vertex AI's `google/gemini-2.5-flash`)
    names who made it, not what it is."""
    model = model.rpartition("/")[2]
    for prefix, profile in _BY_LENGTH:
        if model == prefix or (model.startswith(prefix) and _continues(model, prefix)):
            return profile
    return DEFAULT_PROFILE


def _continues(model: str, prefix: str) -> bool:
    """`gpt-4o-2024-08-06` continues `gpt-4o`; `gpt-4ox` does not; `gpt-5.4` continues `gpt-5.`."""
    return prefix.endswith(".") or model[len(prefix)] in "-."


@dataclass(frozen=True)
class CallShape:
    """How one stage calls its model, fixed at start-up: the body parameters every call of
    the stage carries, and the completion cap the budget must reserve."""

    model: str
    profile: ModelProfile
    token_param: TokenParam
    output_tokens: int  # the visible reply's cap
    effort: str | None
    temperature: float | None

    @property
    def completion_cap(self) -> int:
        """What the call may spend on its completion: visible output plus reasoning."""
        return self.output_tokens + REASONING_ALLOWANCE.get(self.effort or "none", 0)

    @cached_property
    def params(self) -> dict[str, object]:
        """Body parameters for every call of this shape (built once; do not mutate)."""
        out: dict[str, object] = {self.token_param: self.completion_cap}
        if self.effort is not None:
            out["reasoning_effort"] = self.effort
        if self.temperature is not None and self.profile.allows_sampling(self.effort):
            out["temperature"] = self.temperature
        return out


def call_shape(
    model: str,
    *,
    output_tokens: int,
    effort: str | None = None,
    token_param: str = "auto",
    temperature: float | None = None,
) -> CallShape:
    """The shape of a stage's calls; ValueError says what the model does not accept."""
    profile = profile_for(model)
    chosen = profile.effort(effort)
    return CallShape(model, profile, profile.token_param(token_param), output_tokens, chosen, temperature)
