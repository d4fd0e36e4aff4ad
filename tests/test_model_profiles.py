"""The model table: which parameters each family takes, what it bills for an image, and
the settings it lets through (a setting that cannot work fails at start-up, by name)."""

from __future__ import annotations

import pytest

from app.settings import Settings, SettingsError
from app.stages.vision import TYPICAL_IMAGE_SIZE
from app.upstream.profiles import DEFAULT_PROFILE, REASONING_ALLOWANCE, call_shape, profile_for
from app.upstream.tokens import estimate_image_tokens


@pytest.mark.parametrize(
    ("model", "family"),
    [
        ("gpt-4o-mini", "gpt-4o-mini"),
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
        ("gpt-4o-2024-08-06", "gpt-4o"),
        ("gpt-4.1-nano", "gpt-4.1-nano"),
        ("gpt-5", "gpt-5"),
        ("gpt-5-2025-08-07", "gpt-5"),
        ("gpt-5-mini-2025-08-07", "gpt-5-mini"),
        ("gpt-5.1", "gpt-5.1"),
        ("gpt-5.1-2025-11-13", "gpt-5.1"),
        ("gpt-5.4-mini", "gpt-5.x"),
        ("o4-mini-2025-04-16", "o4-mini"),
        ("o3", "o3"),
        ("gpt-4ox", "default"),
        ("llama-3.1-70b", "default"),
    ],
)
def test_models_find_their_family_by_prefix(model: str, family: str) -> None:
    assert profile_for(model).family == family


@pytest.mark.parametrize(
    ("model", "effort", "param", "cap"),
    [
        ("gpt-4o-mini", None, "max_completion_tokens", 120),
        ("gpt-5.1", "none", "max_completion_tokens", 120),
        ("gpt-5-mini", "minimal", "max_completion_tokens", 120 + REASONING_ALLOWANCE["minimal"]),
        ("o4-mini", "low", "max_completion_tokens", 120 + REASONING_ALLOWANCE["low"]),
        ("llama-3.1-70b", None, "max_tokens", 120),  # auto on a model we do not know
    ],
)
def test_auto_shape_uses_the_cheapest_effort_and_caps_reasoning_plus_reply(
    model: str, effort: str | None, param: str, cap: int
) -> None:
    shape = call_shape(model, output_tokens=120)
    assert (shape.effort, shape.token_param, shape.completion_cap) == (effort, param, cap)
    params = shape.params
    assert params[param] == cap
    assert params.get("reasoning_effort") == effort
    assert ("max_tokens" in params) == (param == "max_tokens")


def test_temperature_is_sent_only_where_the_model_takes_it() -> None:
    assert call_shape("gpt-4o-mini", output_tokens=10, temperature=0.0).params["temperature"] == 0.0
    assert call_shape("gpt-5.1", output_tokens=10, temperature=0.0).params["temperature"] == 0.0
    assert "temperature" not in call_shape("gpt-5.1", output_tokens=10, effort="low", temperature=0.0).params
    assert "temperature" not in call_shape("gpt-5-mini", output_tokens=10, temperature=0.0).params
    assert "temperature" not in call_shape("o3", output_tokens=10, temperature=0.0).params


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"vision_model": "gpt-5-mini", "vision_reasoning_effort": "none"}, "VISION_REASONING_EFFORT"),
        ({"answer_model": "gpt-4o-mini", "answer_reasoning_effort": "low"}, "ANSWER_REASONING_EFFORT"),
        ({"vision_model": "gpt-5.1", "openai_token_param": "max_tokens"}, "OPENAI_TOKEN_PARAM"),
        ({"openai_token_param": "max_output_tokens"}, "OPENAI_TOKEN_PARAM"),
    ],
)
def test_settings_a_model_cannot_take_fail_at_start_with_the_variable_named(
    overrides: dict[str, str], names: str
) -> None:
    with pytest.raises(SettingsError, match=names):
        Settings(**overrides)  # type: ignore[arg-type]


def test_effort_and_token_param_come_from_the_environment() -> None:
    env = {"VISION_MODEL": "gpt-5-mini", "VISION_REASONING_EFFORT": "low", "ANSWER_MODEL": "gpt-4o-mini"}
    settings = Settings.from_env(env)
    vision, answer = settings.call_shape("vision"), settings.call_shape("answer")
    assert (vision.effort, vision.token_param) == ("low", "max_completion_tokens")
    assert (answer.effort, answer.token_param) == (None, "max_completion_tokens")
    legacy = Settings.from_env({"OPENAI_TOKEN_PARAM": "max_tokens"})
    assert legacy.call_shape("answer").params == {"max_tokens": legacy.answer_max_tokens}


@pytest.mark.parametrize(
    ("model", "size", "detail", "tokens"),
    [
        # OpenAI's published vision cost table (see app/upstream/profiles.py).
        ("gpt-4o", (768, 576), "low", 85),
        ("gpt-4o", (1024, 1024), "high", 765),
        ("gpt-4o-mini", (768, 576), "low", 2833),
        ("gpt-4o-mini", (1024, 1024), "high", 2833 + 4 * 5667),
        ("gpt-5.1", (768, 576), "low", 70),
        ("gpt-5.1", (1024, 1024), "high", 70 + 4 * 140),
        ("o3", (768, 576), "low", 75),
        # Patches: ceil(w/32) × ceil(h/32), capped at 1536, × the multiplier; `low` is no cheaper.
        ("gpt-5-mini", (768, 576), "low", 700),  # 24 × 18 = 432 × 1.62 = 699.84
        ("gpt-5-nano", (512, 512), "high", 630),  # 256 × 2.46 = 629.76
        ("o4-mini", (4032, 3024), "low", 2642),  # capped: 1536 × 1.72 = 2641.92
    ],
)
def test_image_costs_follow_each_models_published_rate(
    model: str, size: tuple[int, int], detail: str, tokens: int
) -> None:
    assert estimate_image_tokens(*size, detail, profile_for(model).image) == tokens


def test_unknown_models_bill_images_like_gpt_4o() -> None:
    assert DEFAULT_PROFILE.image.tokens(*TYPICAL_IMAGE_SIZE, "low") == 85
