"""Simulator configuration: validated, immutable knobs, readable from ``SIM_*`` env vars."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("vision", "text")
# The providers the simulator can play (app/sim/flavors.py) and the outage switch's modes.
FLAVORS = ("openai", "azure", "gemini")
# How a caller proves who it is: a key, or an access token a token service issued
# (app/sim/issuer.py), valid until it expires.
AUTHS = ("key", "token")
OUTAGES = ("none", "503", "hang", "refuse")
# The 200-path faults, in the order one request takes them (at most one each).
REPLY_FAULTS = ("refuse", "content_filter", "truncate", "malformed")
ENV_PREFIX = "SIM_"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True, slots=True)
class SimConfig:
    """All simulator behaviour. Latencies are in seconds before ``time_scale`` is applied."""

    # Which provider this simulator plays (app/sim/flavors.py): its URL layout, auth
    # header, rate headers, error bodies, parameter rules and way of counting tokens.
    flavor: str = "openai"
    # "" accepts any non-empty key; otherwise only this one (others get the flavour's 401).
    api_key: str = ""
    # key: `api_key` above. token: only a bearer token the token service sharing
    # `token_secret` issued (app/sim/issuer.py), until it expires (then the flavour's 401);
    # Azure then refuses `api-key` (its keys disabled).
    auth: str = "key"
    token_secret: str = ""
    # Azure: "deployment=model" pairs; a deployment named like a known model needs none.
    deployments: tuple[str, ...] = ()
    # Gemini: response_format schemas must stay within the OpenAPI subset of Gemini's
    # Schema object (additionalProperties, $ref, ... are 400s); false accepts JSON Schema.
    schema_subset: bool = True
    # Gemini: error bodies come wrapped in a one-element JSON array (the compat endpoint's way).
    error_array: bool = True
    vision_median_s: float = 4.5
    text_median_s: float = 4.8
    latency_sigma: float = 0.25
    time_scale: float = 1.0
    first_token_fraction: float = 0.15
    rpm: int = 500
    tpm: int = 500_000
    # Another user of the same key, consuming steadily: the headers still report the
    # full limit, but the remaining budget shrinks (what "a shared key" looks like).
    shared_rpm: int = 0
    shared_tpm: int = 0
    # How the TPM limiter counts a request, against the formula the flavour documents (its
    # own estimator is not our tokenizer: Flavor.charge): every Hangul syllable of the
    # prompt counts `charge_hangul` tokens instead of one, and the total is multiplied by
    # `charge_factor` (0.6: the limiter charges 40 % less than the documented formula).
    charge_factor: float = 1.0
    charge_hangul: float = 1.0
    text_tokens: int = 60
    error_rate: float = 0.0
    error_status: int = 500
    error_kinds: tuple[str, ...] = KINDS
    stall_rate: float = 0.0
    stall_s: float = 30.0
    quota_exhausted: bool = False
    reject_next: int = 0
    reject_retry_after_ms: int = 1000
    reject_kinds: tuple[str, ...] = KINDS
    # 200-path faults, each consumed by one matching request like reject_next:
    # a refusal, a reply cut by the content filter, a stream that just ends, a reply
    # that ignores the request's JSON schema.
    refuse_next: int = 0
    refuse_kinds: tuple[str, ...] = KINDS
    content_filter_next: int = 0
    content_filter_kinds: tuple[str, ...] = KINDS
    truncate_next: int = 0  # streamed requests only
    truncate_kinds: tuple[str, ...] = KINDS
    # Requests with a json_schema response_format only: the reply is valid JSON that does
    # not follow the schema (what JSON mode, a non-strict schema or a compatible server
    # that does not enforce schemas returns; see generate.unenforced_content).
    malformed_next: int = 0
    malformed_kinds: tuple[str, ...] = KINDS
    # Multiplies the reasoning tokens drawn per effort (0: reasoning models spend none).
    reasoning_scale: float = 1.0
    # How many of the latest request bodies GET /sim/requests keeps (0: none).
    capture_requests: int = 0
    # The outage switch (app/sim/outage.py): none, 503 (every call gets the flavour's
    # 503), hang (calls are read and never answered until switched back) or refuse (the
    # API port stops listening and open connections are reset; the control port stays).
    outage: str = "none"
    # A provider whose replies are late: this fraction of chat calls (1.0: every one) is held
    # ``hold_s`` seconds (real time) before its first byte, after the limiter counted it.
    hold_rate: float = 0.0
    hold_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # Normalise after the type check so float fields never hold ints and
            # kind lists are always tuples (keeps equality and JSON output stable).
            object.__setattr__(self, f.name, _check_type(f.name, f.type, value))
        _one_of("flavor", self.flavor, FLAVORS)
        _one_of("outage", self.outage, OUTAGES)
        _one_of("auth", self.auth, AUTHS)
        if self.auth == "token" and not self.token_secret:
            raise ValueError("token_secret must be set with auth token")
        _deployments(self.deployments)
        _at_least("vision_median_s", self.vision_median_s, 0.0)
        _at_least("text_median_s", self.text_median_s, 0.0)
        _at_least("latency_sigma", self.latency_sigma, 0.0)
        _at_least("time_scale", self.time_scale, 0.0)
        _fraction("first_token_fraction", self.first_token_fraction)
        _at_least("rpm", self.rpm, 0)
        _at_least("tpm", self.tpm, 0)
        _at_least("shared_rpm", self.shared_rpm, 0)
        _at_least("shared_tpm", self.shared_tpm, 0)
        _at_least("text_tokens", self.text_tokens, 1)
        if self.charge_factor <= 0:
            raise ValueError(f"charge_factor must be > 0, got {self.charge_factor}")
        _at_least("charge_hangul", self.charge_hangul, 0.0)
        _fraction("error_rate", self.error_rate)
        if not 500 <= self.error_status <= 599:
            raise ValueError(f"error_status must be a 5xx status, got {self.error_status}")
        _kinds("error_kinds", self.error_kinds)
        _fraction("stall_rate", self.stall_rate)
        _at_least("stall_s", self.stall_s, 0.0)
        _at_least("reject_next", self.reject_next, 0)
        _at_least("reject_retry_after_ms", self.reject_retry_after_ms, 0)
        _kinds("reject_kinds", self.reject_kinds)
        for fault in REPLY_FAULTS:
            _at_least(f"{fault}_next", getattr(self, f"{fault}_next"), 0)
            _kinds(f"{fault}_kinds", getattr(self, f"{fault}_kinds"))
        _at_least("reasoning_scale", self.reasoning_scale, 0.0)
        _at_least("capture_requests", self.capture_requests, 0)
        _fraction("hold_rate", self.hold_rate)
        _at_least("hold_s", self.hold_s, 0.0)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SimConfig:
        """Build from ``SIM_<FIELD>`` variables (e.g. ``SIM_TIME_SCALE=0.01``); others default.

        ``environ`` defaults to ``os.environ``; kind lists are comma-separated.
        """
        if environ is None:
            environ = os.environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = parse_field_text(f.name, raw)
        return cls(**values)

    def updated(self, changes: Mapping[str, Any]) -> SimConfig:
        """Return a validated copy with ``changes`` applied (JSON-ish values; lists allowed)."""
        known = field_names()
        for name in changes:
            if name not in known:
                raise ValueError(f"{name}: unknown config field")
        return dataclasses.replace(self, **dict(changes))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (tuples become lists)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(SimConfig))


def field_kind(name: str) -> str:
    """One of ``float``, ``int``, ``bool``, ``str``, ``list`` for a SimConfig field name."""
    for f in fields(SimConfig):
        if f.name == name:
            return _KIND_OF_TYPE[str(f.type)]
    raise ValueError(f"{name}: unknown config field")


def parse_field_text(name: str, raw: str) -> Any:
    """Parse a textual (env var / CLI) value for field ``name``; ValueError names the field."""
    kind = field_kind(name)
    text = raw.strip()
    try:
        if kind == "float":
            return float(text)
        if kind == "int":
            return int(text)
        if kind == "str":
            return text
        if kind == "bool":
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(raw)
        return tuple(part.strip() for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{name}: cannot parse {raw!r} as {kind}") from None


_KIND_OF_TYPE = {"float": "float", "int": "int", "bool": "bool", "str": "str", "tuple[str, ...]": "list"}


def _check_type(name: str, type_name: object, value: object) -> object:
    kind = _KIND_OF_TYPE[str(type_name)]
    if kind == "bool":
        if isinstance(value, bool):
            return value
    elif kind == "str":
        if isinstance(value, str):
            return value
    elif kind == "list":
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif isinstance(value, bool):
        pass  # bool is an int subclass; True as a rate is nonsense
    elif kind == "int":
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return float(value)
    raise ValueError(f"{name} must be {kind}, got {value!r}")


def _at_least(name: str, value: float, low: float) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within [0, 1], got {value}")


def _kinds(name: str, value: tuple[str, ...]) -> None:
    for kind in value:
        if kind not in KINDS:
            raise ValueError(f"{name}: unknown kind {kind!r} (expected some of {', '.join(KINDS)})")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _deployments(pairs: tuple[str, ...]) -> None:
    for pair in pairs:
        name, sep, model = pair.partition("=")
        if not sep or not name.strip() or not model.strip():
            raise ValueError(f"deployments: expected deployment=model, got {pair!r}")


def deployment_map(config: SimConfig) -> dict[str, str]:
    """The ``deployments`` pairs as {deployment: model}."""
    out: dict[str, str] = {}
    for pair in config.deployments:
        name, _, model = pair.partition("=")
        out[name.strip()] = model.strip()
    return out
