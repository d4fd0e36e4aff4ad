"""Where the model calls can go: deployments, each one endpoint and key of one provider,
with the limits its provider enforces.

`UPSTREAMS` (a JSON array) or `UPSTREAMS_FILE` (a TOML file of `[[upstream]]` tables)
list them; with neither, the `OPENAI_*` settings are one implicit deployment. Keys never
sit in the list: `api_key_env` names the environment variable that holds one; `auth`
says how else a deployment proves who calls (a token its provider's library fetches:
app/upstream/providers/, credentials.py).

A deployment's limits are its provider's for each of its models. Deployments that share
a `limit_group` share its limits: two keys of one OpenAI organisation (or project) are
one group, since OpenAI's limits belong to the organisation and model, not to the key.
So a budget belongs to a limit group and a model, never to a key.

Which model a deployment runs for each calling stage is `models` (`{"vision": ...,
"answer": ..., "<stage>": ...}`); `vision_model` and `answer_model` are the two first
stages' spelling of the same, folded into it.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from app.runtime.redaction import redact_url
from app.upstream.prices import Price
from app.upstream.providers import PROVIDERS

STAGES = ("vision", "answer")  # the calling stages every list must serve (the lifespan checks its own)
TOKEN_PARAMS = ("max_completion_tokens", "max_tokens")


class DeploymentError(ValueError):
    """A deployment that cannot work; the message names the deployment and the field."""


@dataclass(frozen=True)
class Deployment:
    name: str
    provider: str
    base_url: str
    rpm: int
    tpm: int
    api_key_env: str | None = None
    vision_model: str | None = None  # None: this deployment does not serve the vision stage
    answer_model: str | None = None  # None: ... nor the answer stage
    limit_group: str = ""  # a listed deployment's default: its own name
    priority: int = 0  # lower is tried first
    api_version: str | None = None  # Azure's classic layout (/openai/deployments/...?api-version=)
    token_param: str | None = None  # None: the model profile's choice
    models: tuple[tuple[str, str], ...] = ()  # (stage, model), vision_model and answer_model folded in
    auth: str = "key"  # how it proves who calls: its provider's `auths`
    api_key: str | None = field(default=None, repr=False, compare=False)  # resolved, never listed
    # USD per 1M tokens by model, over the defaults (app/upstream/prices.py).
    prices: Mapping[str, Price] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        merged = dict(self.models)
        for stage, model in (("vision", self.vision_model), ("answer", self.answer_model)):
            if model is not None and merged.setdefault(stage, model) != model:
                raise DeploymentError(
                    f"deployment {self.name!r}: {stage}_model: {model!r}, but models names {merged[stage]!r}"
                )
        object.__setattr__(self, "models", tuple(sorted(merged.items())))
        object.__setattr__(self, "vision_model", merged.get("vision"))
        object.__setattr__(self, "answer_model", merged.get("answer"))

    def model_for(self, stage: str) -> str | None:
        """The model this deployment runs for `stage`; None: it does not serve that stage."""
        for served, model in self.models:
            if served == stage:
                return model
        return None

    def budget_key(self, model: str) -> str:
        """The budget this deployment's calls to `model` spend: its limit group's. The
        implicit deployment (no group) keys by model alone, as budgets always did."""
        return f"{self.limit_group}/{model}" if self.limit_group else model

    def health_id(self) -> str:
        """Who shares this deployment's health across replicas: its name and a digest of
        where it is and the key it uses (a deployment taken out for its key comes back
        fresh when the key changes, instead of staying out on the others' word)."""
        where = "\0".join((self.provider, self.base_url, self.api_version or "", self.api_key or ""))
        return f"{self.name}:{hashlib.sha256(where.encode()).hexdigest()[:12]}"


def parse_deployments(
    upstreams: str | None, upstreams_file: str | None, environ: Mapping[str, str] | None = None
) -> tuple[Deployment, ...] | None:
    """The deployments `UPSTREAMS` or `UPSTREAMS_FILE` lists (None: neither is set), each
    with its key from `environ` (None: keys are not looked up yet)."""
    if upstreams and upstreams_file:
        raise DeploymentError("set UPSTREAMS or UPSTREAMS_FILE, not both")
    if upstreams:
        try:
            raw = json.loads(upstreams)
        except ValueError as exc:
            raise DeploymentError(f"UPSTREAMS is not JSON: {exc}") from None
        source = "UPSTREAMS"
    elif upstreams_file:
        try:
            with open(upstreams_file, "rb") as f:
                raw = tomllib.load(f).get("upstream")
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise DeploymentError(f"UPSTREAMS_FILE {upstreams_file!r}: {exc}") from None
        source = "UPSTREAMS_FILE [[upstream]]"
    else:
        return None
    if not isinstance(raw, list) or not raw:
        raise DeploymentError(f"{source} must list at least one deployment")
    deployments = tuple(_deployment(source, i, entry, environ) for i, entry in enumerate(raw))
    check_deployments(deployments)
    return deployments


def check_deployments(deployments: Sequence[Deployment], stages: Sequence[str] = STAGES) -> None:
    """What only the whole list can show: unique names, every calling stage served, and
    one set of limits per limit group and model."""
    names = [d.name for d in deployments]
    for name in names:
        if names.count(name) > 1:
            raise DeploymentError(f"deployment {name!r}: name: used twice")
    for stage in stages:
        if not any(d.model_for(stage) for d in deployments):
            raise DeploymentError(f"no deployment serves the {stage} stage (name its model in models on one)")
    limits: dict[str, tuple[str, int, int]] = {}
    for d in deployments:
        for model in {m for _, m in d.models}:
            key = d.budget_key(model)
            first = limits.setdefault(key, (d.name, d.rpm, d.tpm))
            if first[1:] != (d.rpm, d.tpm):
                raise DeploymentError(
                    f"deployment {d.name!r}: rpm/tpm: limit group {d.limit_group!r} has {model} at "
                    f"{first[1]} RPM / {first[2]} TPM on {first[0]!r}; one group, one set of limits"
                )


_FIELDS = {f.name for f in fields(Deployment)} - {"api_key"}
_REQUIRED = ("name", "provider", "base_url", "rpm", "tpm")


def _deployment(source: str, index: int, entry: object, environ: Mapping[str, str] | None) -> Deployment:
    where = f"{source}[{index}]"
    if not isinstance(entry, dict):
        raise DeploymentError(f"{where}: a deployment is an object of fields, got {type(entry).__name__}")
    if isinstance(entry.get("name"), str) and entry["name"]:
        where = f"deployment {entry['name']!r}"
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise DeploymentError(
            f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(_FIELDS))})"
        )
    for name in _REQUIRED:
        if name not in entry:
            raise DeploymentError(f"{where}: {name}: required")
    values: dict[str, Any] = {}
    for name in ("name", "provider", "base_url", "api_key_env", "vision_model", "answer_model"):
        values[name] = _text(where, name, entry.get(name))
    for name in ("limit_group", "api_version", "token_param", "auth"):
        values[name] = _text(where, name, entry.get(name))
    values["auth"] = values["auth"] or "key"
    values["limit_group"] = values["limit_group"] or values["name"]
    for name in ("rpm", "tpm"):
        values[name] = _count(where, name, entry[name], minimum=1)
    values["priority"] = _count(where, "priority", entry.get("priority", 0), minimum=0)
    values["models"] = _models(where, entry.get("models", {}))
    values["prices"] = _prices(where, entry.get("prices", {}))
    deployment = Deployment(**values)
    _check(where, deployment)
    return deployment if environ is None else with_key(deployment, environ)


def _check(where: str, d: Deployment) -> None:
    provider = PROVIDERS.get(d.provider)
    if provider is None:
        raise DeploymentError(f"{where}: provider: one of {', '.join(PROVIDERS)}, got {d.provider!r}")
    parts = urlsplit(d.base_url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise DeploymentError(f"{where}: base_url: an http(s):// URL, got {redact_url(d.base_url)!r}")
    if not d.models:
        raise DeploymentError(f"{where}: vision_model / answer_model (or models): set at least one")
    if d.token_param is not None and d.token_param not in TOKEN_PARAMS:
        raise DeploymentError(
            f"{where}: token_param: one of {', '.join(TOKEN_PARAMS)}, got {d.token_param!r}"
        )
    problem = provider.check(d)
    if problem is not None:
        raise DeploymentError(f"{where}: {problem}")


def with_key(d: Deployment, environ: Mapping[str, str]) -> Deployment:
    """`d` with its key, read from the variable `api_key_env` names."""
    if d.api_key_env is None:
        return d
    key = environ.get(d.api_key_env)
    if not key:
        raise DeploymentError(f"deployment {d.name!r}: api_key_env: {d.api_key_env} is not set")
    return replace(d, api_key=key)


def _models(where: str, value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise DeploymentError(f"{where}: models: an object of stage names to models, got {value!r}")
    pairs = []
    for stage, model in value.items():
        if not isinstance(model, str) or not model.strip():
            raise DeploymentError(f"{where}: models.{stage}: a non-empty string, got {model!r}")
        pairs.append((str(stage).strip(), model.strip()))
    return tuple(pairs)


def _text(where: str, name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise DeploymentError(f"{where}: {name}: a non-empty string, got {value!r}")
    return value.strip()


def _count(where: str, name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DeploymentError(f"{where}: {name}: an integer >= {minimum}, got {value!r}")
    return value


def _prices(where: str, value: object) -> dict[str, Price]:
    """`{"<model>": {"input": .., "cached_input": .., "output": ..}}`, USD per 1M tokens;
    `cached_input` defaults to `input` (no discount known)."""
    if not isinstance(value, dict):
        raise DeploymentError(f"{where}: prices: an object of models, got {value!r}")
    prices = {}
    for model, rates in value.items():
        at = f"{where}: prices.{model}"
        if not isinstance(rates, dict) or not {"input", "output"} <= set(rates) <= set(_RATES):
            raise DeploymentError(f"{at}: an object of {', '.join(_RATES)} (input and output required)")
        for name, rate in rates.items():
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < float("inf"):
                raise DeploymentError(f"{at}.{name}: USD per 1M tokens, a number >= 0, got {rate!r}")
        cached = rates["cached_input"] if "cached_input" in rates else rates["input"]
        prices[model] = Price(float(rates["input"]), float(cached), float(rates["output"]))
    return prices


_RATES = ("input", "cached_input", "output")
