"""UPSTREAMS / UPSTREAMS_FILE: every mistake names the deployment and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings, SettingsError
from app.upstream.deployments import DeploymentError, check_deployments, parse_deployments, with_key

OPENAI_A = {
    "name": "openai-a",
    "provider": "openai",
    "base_url": "https://api.openai.com/v1",
    "api_key_env": "OPENAI_KEY_A",
    "vision_model": "gpt-4o-mini",
    "answer_model": "gpt-4o-mini",
    "rpm": 500,
    "tpm": 200_000,
}
GEMINI = {
    "name": "gemini",
    "provider": "gemini",
    "base_url": "https://generativelanguage.googleapis.com/v1beta/openai/",
    "api_key_env": "GEMINI_KEY",
    "answer_model": "gemini-2.5-flash",
    "rpm": 60,
    "tpm": 1_000_000,
    "priority": 1,
}


def parsed(*entries: dict[str, Any]) -> Any:
    return parse_deployments(json.dumps(list(entries)), None)


def test_a_list_of_deployments_with_defaults() -> None:
    a, gemini = parsed(OPENAI_A, GEMINI)
    assert (a.name, a.limit_group, a.priority, a.api_key) == ("openai-a", "openai-a", 0, None)
    assert gemini.model_for("vision") is None and gemini.model_for("answer") == "gemini-2.5-flash"
    assert gemini.budget_key("gemini-2.5-flash") == "gemini/gemini-2.5-flash"
    keyed = with_key(a, {"OPENAI_KEY_A": "sk-a"})
    assert keyed.api_key == "sk-a" and "sk-a" not in repr(keyed)


def test_neither_setting_means_the_implicit_deployment() -> None:
    assert parse_deployments(None, None) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"provider": "anthropic"},
            "deployment 'openai-a': provider: one of azure, compatible, gemini, openai",
        ),
        ({"rpm": 0}, "deployment 'openai-a': rpm: an integer >= 1"),
        ({"tpm": "lots"}, "deployment 'openai-a': tpm: an integer >= 1"),
        ({"priority": -1}, "deployment 'openai-a': priority: an integer >= 0"),
        ({"base_url": "ftp://x"}, "deployment 'openai-a': base_url: an http"),
        ({"vision_model": None, "answer_model": None}, "deployment 'openai-a': vision_model / answer_model"),
        ({"api_key_env": None}, "deployment 'openai-a': api_key_env: required for provider 'openai'"),
        ({"api_version": "2024-10-21"}, "deployment 'openai-a': api_version: not for provider 'openai'"),
        ({"token_param": "max_output_tokens"}, "deployment 'openai-a': token_param: one of"),
        ({"api_key": "sk-in-the-file"}, "deployment 'openai-a': unknown field(s) api_key"),
    ],
)
def test_a_bad_field_is_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(DeploymentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parsed({**OPENAI_A, **change})


def test_what_only_the_whole_list_shows() -> None:
    with pytest.raises(DeploymentError, match="deployment 'openai-a': name: used twice"):
        parsed(OPENAI_A, OPENAI_A)
    with pytest.raises(DeploymentError, match="no deployment serves the vision stage"):
        parsed(GEMINI)
    other_key = {**OPENAI_A, "name": "openai-a2", "api_key_env": "OPENAI_KEY_A2", "limit_group": "openai-a"}
    assert len(parsed(OPENAI_A, other_key)) == 2  # two keys of one organisation: one group
    with pytest.raises(DeploymentError, match="limit group 'openai-a' has gpt-4o-mini at 500 RPM"):
        parsed(OPENAI_A, {**other_key, "rpm": 1000})
    with pytest.raises(DeploymentError, match="UPSTREAMS must list at least one deployment"):
        parse_deployments("[]", None)
    with pytest.raises(DeploymentError, match="UPSTREAMS is not JSON"):
        parse_deployments("[{", None)


def test_a_missing_key_is_named_when_it_is_looked_up() -> None:
    (a,) = parsed(OPENAI_A)
    with pytest.raises(DeploymentError, match="deployment 'openai-a': api_key_env: OPENAI_KEY_A is not set"):
        with_key(a, {})


def test_the_toml_file_has_the_same_fields(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.toml"
    path.write_text(
        """
[[upstream]]
name = "azure-eu"
provider = "azure"
base_url = "https://ecoscan-eu.openai.azure.com/openai/v1/"
api_key_env = "AZURE_KEY"
vision_model = "gpt-4o-mini-eu"
answer_model = "gpt-4o-mini-eu"
rpm = 300
tpm = 50000
"""
    )
    (azure,) = parse_deployments(None, str(path)) or ()
    assert (azure.provider, azure.rpm, azure.limit_group) == ("azure", 300, "azure-eu")
    path.write_text("[[upstream]]\nname = 'x'\nprovider = 'openai'\n")
    with pytest.raises(DeploymentError, match="deployment 'x': base_url: required"):
        parse_deployments(None, str(path))


def test_settings_refuse_a_bad_list_naming_the_variable() -> None:
    with pytest.raises(SettingsError, match="UPSTREAMS: deployment 'openai-a': rpm"):
        Settings(upstreams=json.dumps([{**OPENAI_A, "rpm": -5}]))
    with pytest.raises(SettingsError, match="set UPSTREAMS or UPSTREAMS_FILE, not both"):
        Settings(upstreams=json.dumps([OPENAI_A]), upstreams_file="/tmp/x.toml")
    assert Settings(upstreams=json.dumps([OPENAI_A])).deployments() is not None


def test_models_name_each_calling_stages_model_and_fold_in_the_old_spelling() -> None:
    listed = {**OPENAI_A, "models": {"answer": "gpt-4o-mini", "moderation": "gpt-5-nano"}}
    (a,) = parsed(listed)
    assert a.models == (("answer", "gpt-4o-mini"), ("moderation", "gpt-5-nano"), ("vision", "gpt-4o-mini"))
    assert a.model_for("moderation") == "gpt-5-nano" and a.vision_model == "gpt-4o-mini"
    toml_only = {k: v for k, v in OPENAI_A.items() if not k.endswith("_model")}
    (b,) = parsed({**toml_only, "models": {"vision": "gpt-4o", "answer": "gpt-4o-mini"}})
    assert (b.vision_model, b.answer_model) == ("gpt-4o", "gpt-4o-mini")


def test_models_and_the_old_spelling_must_agree() -> None:
    with pytest.raises(DeploymentError, match="vision_model: 'gpt-4o-mini', but models names 'gpt-4o'"):
        parsed({**OPENAI_A, "models": {"vision": "gpt-4o"}})
    with pytest.raises(DeploymentError, match=r"models\.moderation: a non-empty string"):
        parsed({**OPENAI_A, "models": {"moderation": ""}})
    with pytest.raises(DeploymentError, match="no deployment serves the moderation stage"):
        check_deployments(parsed(OPENAI_A), ("vision", "answer", "moderation"))
