from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from app.settings import Settings, SettingsError, env_name
from app.upstream.stage_call import StageCall


def test_reads_environment_and_casts() -> None:
    s = Settings.from_env({"CPU_MAX_WORKERS": "3", "OPENAI_RPM": "1_000", "SCAN_DEADLINE_S": "12.5"})
    assert (s.cpu_max_workers, s.openai_rpm, s.scan_deadline_s) == (3, 1000, 12.5)
    assert s.uses_simulator and s.uses_embedded_postgres


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CPU_MAX_WORKERS": "0"}, "CPU_MAX_WORKERS"),
        ({"VISION_CONCURRENCY": "-1"}, "VISION_CONCURRENCY"),
        ({"OPENAI_TPM": "lots"}, "OPENAI_TPM"),
        ({"VISION_DETAIL": "ultra"}, "VISION_DETAIL"),
        ({"RATE_BURST_FRACTION": "1.5"}, "RATE_BURST_FRACTION"),
        ({"DB_POOL_MIN": "30", "DB_POOL_MAX": "5"}, "DB_POOL_MIN"),
        ({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}, "OPENAI_API_KEY"),
        ({"REDIS_URL": "127.0.0.1:6379"}, "REDIS_URL"),
        ({"REDIS_PREFIX": "two words"}, "REDIS_PREFIX"),
        ({"REDIS_TIMEOUT_S": "0"}, "REDIS_TIMEOUT_S"),
    ],
)
def test_nonsense_is_rejected_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        *[("true", True), ("TRUE", True), ("1", True), ("Yes", True), ("on", True), (" On ", True)],
        *[("false", False), ("False", False), ("0", False), ("NO", False), ("off", False)],
    ],
)
def test_booleans_take_the_usual_spellings(raw: str, value: bool) -> None:
    assert Settings.from_env({"AUTH_ALLOW_ANONYMOUS": raw}).auth_allow_anonymous is value


@pytest.mark.parametrize("raw", ["ture", "flase", "y", "n", "2", "-1", "enabled", "true!", "nope"])
def test_a_boolean_that_is_no_spelling_of_yes_or_no_is_rejected(raw: str) -> None:
    """It used to mean false: AUTH_ALLOW_ANONYMOUS=ture turned anonymous callers away."""
    with pytest.raises(SettingsError, match=r"AUTH_ALLOW_ANONYMOUS must be true/false.*" + repr(raw)):
        Settings.from_env({"AUTH_ALLOW_ANONYMOUS": raw})


def test_every_boolean_setting_is_checked() -> None:
    """Any yes/no setting added later goes through the same check."""
    booleans = [f for f in dataclasses.fields(Settings) if str(f.type).replace(" | None", "") == "bool"]
    assert booleans, "no boolean settings left: drop this test"
    for f in booleans:
        with pytest.raises(SettingsError, match=env_name(f.name)):
            Settings.from_env({env_name(f.name): "ture"})


def test_zero_is_allowed_where_it_means_off() -> None:
    s = Settings.from_env({"ADMISSION_WAIT_S": "0", "CPU_QUEUE_LIMIT": "0", "DELTA_FLUSH_MS": "0"})
    assert s.admission_wait_s == 0 and s.cpu_queue_limit == 0


def test_the_configuration_doc_lists_every_setting_and_nothing_else() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    tables = doc[doc.index("## The service's settings") : doc.index("## Models")]
    names = {env_name(f.name) for f in dataclasses.fields(Settings) if not f.metadata.get("env_prefix")}
    missing = sorted(n for n in names if f"`{n}`" not in tables)
    assert not missing, f"settings missing from docs/configuration.md's tables: {missing}"
    first_cells = [line.split("|")[1] for line in tables.splitlines() if line.startswith("| `")]
    listed = {name for cell in first_cells for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", cell)}
    # uvicorn's own setting, read by uvicorn, not by Settings
    unknown = sorted(n for n in listed - names - {"FORWARDED_ALLOW_IPS"} if not n.startswith("SIM_"))
    assert not unknown, f"docs/configuration.md lists names that are no setting: {unknown}"


def test_secrets_can_be_read_from_files(tmp_path: Path) -> None:
    files = {
        "DATABASE_URL": "postgresql://ecoscan:pw@postgres:5432/ecoscan",
        "OPENAI_API_KEY": "sk-from-a-file",
        "REDIS_URL": "redis://:pw@redis:6379/0",
    }
    env = {}
    for name, value in files.items():
        (tmp_path / name).write_text(value + "\n")  # as `echo value > file` writes it
        env[f"{name}_FILE"] = str(tmp_path / name)
    s = Settings.from_env(env)
    assert (s.database_url, s.openai_api_key, s.redis_url) == tuple(files.values())

    secret = tmp_path / "jwt"
    secret.write_text("k" * 48)
    s = Settings.from_env({"AUTH_MODE": "jwt", "AUTH_JWT_SECRET_FILE": str(secret)})
    assert s.auth_jwt_secret == "k" * 48
    # Checked like the variable itself: a short secret is refused, from a file too.
    secret.write_text("short")
    with pytest.raises(SettingsError, match="AUTH_JWT_SECRET must be at least"):
        Settings.from_env({"AUTH_MODE": "jwt", "AUTH_JWT_SECRET_FILE": str(secret)})


def test_an_empty_secret_file_means_unset(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("\n")
    assert Settings.from_env({"OPENAI_API_KEY_FILE": str(tmp_path / "key")}).uses_simulator


def test_secret_files_are_checked(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("sk-1")
    with pytest.raises(SettingsError, match="OPENAI_API_KEY or OPENAI_API_KEY_FILE, not both"):
        Settings.from_env({"OPENAI_API_KEY": "sk-2", "OPENAI_API_KEY_FILE": str(tmp_path / "key")})
    with pytest.raises(SettingsError, match=r"DATABASE_URL_FILE: cannot read .*/missing"):
        Settings.from_env({"DATABASE_URL_FILE": str(tmp_path / "missing")})
    # Only secrets have a _FILE form: anything else is not read from a file.
    (tmp_path / "rpm").write_text("7")
    assert Settings.from_env({"OPENAI_RPM_FILE": str(tmp_path / "rpm")}).openai_rpm == Settings().openai_rpm


def test_sized_limits_read_auto_caps_and_numbers() -> None:
    s = Settings.from_env({})
    assert (s.vision_concurrency, s.answer_concurrency, s.max_inflight_scans, s.cpu_queue_limit) == (
        "auto",
    ) * 4
    s = Settings.from_env(
        {"VISION_CONCURRENCY": "auto:300", "ANSWER_CONCURRENCY": "48", "CPU_MAX_WORKERS": "auto"}
    )
    assert s.limit("vision_concurrency").cap == 300 and s.answer_concurrency == 48
    assert s.cpu_max_workers == (os.cpu_count() or 1)
    for name, bad in (
        ("MAX_INFLIGHT_SCANS", "0"),
        ("VISION_CONCURRENCY", "lots"),
        ("ANSWER_CONCURRENCY", "auto:"),
    ):
        with pytest.raises(SettingsError, match=name):
            Settings.from_env({name: bad})


def test_upload_and_follower_caps_are_checked_by_name() -> None:
    s = Settings.from_env({})
    assert (s.body_gap_timeout_s, s.body_buffer_max_bytes_per_client) == (10.0, 32 * 1024 * 1024)
    assert (s.followers_max_per_user, s.followers_max_per_scan) == (8, 4)
    for name, bad in (
        ("BODY_BUFFER_MAX_BYTES_PER_CLIENT", "1000"),  # not even one largest body
        ("BODY_GAP_TIMEOUT_S", "0"),
        ("FOLLOWERS_MAX_PER_USER", "0"),
        ("FOLLOWERS_MAX_PER_SCAN", "-1"),
    ):
        with pytest.raises(SettingsError, match=name):
            Settings.from_env({name: bad})


def test_stage_calls_set_a_new_calling_stages_call_and_refuse_mistakes() -> None:
    declared = StageCall("moderation", max_tokens=40, temperature=0.0)
    settings = Settings(
        stage_calls='{"moderation": {"model": "gpt-5-nano", "concurrency": "7", "timeout_s": 5}}'
    )
    call = settings.stage_call(declared)
    assert (call.model, call.max_tokens, call.timeout_s, call.concurrency.fixed) == ("gpt-5-nano", 40, 5.0, 7)
    assert Settings().stage_call(declared) == declared
    vision = Settings(vision_model="gpt-4o", vision_concurrency=3).stage_call(
        StageCall("vision", temperature=0.0)
    )
    assert (vision.model, vision.concurrency.fixed, vision.temperature) == ("gpt-4o", 3, 0.0)
    for raw, message in [
        ('{"moderation": {"modle": "x"}}', "STAGE_CALLS moderation: modle: unknown"),
        ('{"vision": {"model": "x"}}', "STAGE_CALLS vision: set the VISION_\\* variables instead"),
        ('{"moderation": {"reasoning_effort": "high"}}', "STAGE_CALLS moderation: "),
        ("[1]", "STAGE_CALLS must be a JSON object"),
    ]:
        with pytest.raises(SettingsError, match=message):
            Settings(stage_calls=raw)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        # A cache that is not an object was a TypeError out of the error message itself.
        ('{"moderation": {"cache": 5}}', "STAGE_CALLS moderation: cache: "),
        ('{"moderation": {"cache": "big"}}', "STAGE_CALLS moderation: cache: "),
        ('{"moderation": {"cache": [1, 2]}}', "STAGE_CALLS moderation: cache: "),
        # Python's JSON takes NaN and Infinity: an unbounded stage or a cache that never expires.
        ('{"moderation": {"timeout_s": Infinity}}', "STAGE_CALLS moderation: timeout_s: "),
        ('{"moderation": {"timeout_s": NaN}}', "STAGE_CALLS moderation: timeout_s: "),
        ('{"moderation": {"cache": {"entries": 9, "max_bytes": 9, "ttl_s": NaN}}}', "cache: "),
    ],
)
def test_stage_calls_refuse_a_cache_that_is_no_object_and_numbers_that_are_not_finite(
    raw: str, message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings(stage_calls=raw)
