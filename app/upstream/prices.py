"""What each model call cost, from the usage its reply reported, and what each scan cost.

A `Price` is USD per 1M tokens: prompt tokens at `input`, those of them the provider's
prompt cache served at `cached_input`, completion tokens at `output`. Reasoning (thinking)
tokens are not priced apart: `Usage` counts them inside the completion tokens, as OpenAI
reports them and as `read_completion` normalises Gemini's (app/upstream/wire.py), and both
providers bill them as output. Images are not priced apart either: OpenAI, Azure OpenAI and
Gemini bill an image as input tokens, already inside the reported prompt tokens.

`DEFAULT_PRICES` are the providers' list prices for the models docs/configuration.md names,
as read on `PRICES_READ`; a deployment's `prices` (UPSTREAMS) overrides them for its models
(an Azure region's rates, a negotiated discount, a model under another name). A model with
no price is never made a free one: its calls are counted in
`ecoscan_upstream_unpriced_calls_total`, warned about once at start, and a scan that made
one has no cost (NULL), not a smaller one.

`Pricing.charge` is called once for every attempt that reported usage (`Upstream._settle`:
retried attempts, hedges, and replies refused or cut at their token cap included). The scan
it belongs to is found through `ScanSpend.current`, set by the scan's task
(app/scans/pipeline.py) and inherited by the tasks its calls start (a hedge).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from app.runtime.metrics import Metrics
from app.upstream.call import Usage

log = logging.getLogger(__name__)

TOKENS_PER_PRICE = 1_000_000  # prices are per 1M tokens
PRICES_READ = "2026-11-27"  # when DEFAULT_PRICES were read (docs/configuration.md#prices)


@dataclass(frozen=True)
class Price:
    """USD per 1M tokens."""

    input: float
    cached_input: float
    output: float

    def cost(self, usage: Usage) -> float:
        """USD for one reply's usage: prompt, completion (reasoning included), reasoning, cached."""
        prompt, completion, _reasoning, cached = usage
        cached = min(cached, prompt)
        usd = (prompt - cached) * self.input + cached * self.cached_input + completion * self.output
        return usd / TOKENS_PER_PRICE


# OpenAI's list prices (Standard tier), which Azure OpenAI's Global deployments also charge;
# Gemini's paid tier (prompts up to 200k tokens). Gemini 2.5 Flash's cached-input rate is
# left at its input rate: the sources read disagreed on it, and an upper bound is not a guess.
DEFAULT_PRICES: Mapping[str, Price] = {
    "gpt-4o": Price(2.50, 1.25, 10.00),
    "gpt-4o-mini": Price(0.15, 0.075, 0.60),
    "gpt-4.1-mini": Price(0.40, 0.10, 1.60),
    "gpt-5": Price(1.25, 0.125, 10.00),
    "gpt-5-mini": Price(0.25, 0.025, 2.00),
    "gpt-5.1": Price(1.25, 0.125, 10.00),
    "gemini-2.5-flash": Price(0.30, 0.30, 2.50),
}


def price_of(model: str, prices: Mapping[str, Price]) -> Price | None:
    """`model`'s price in `prices`: by its name, or a dated snapshot's
    (`gpt-4o-mini-2024-07-18` is `gpt-4o-mini`); a publisher's prefix aside (Vertex AI's
    `google/gemini-2.5-flash` is `gemini-2.5-flash`, at the same list price)."""
    if model in prices:
        return prices[model]
    model = model.rpartition("/")[2]
    if model in prices:
        return prices[model]
    dated = [name for name in prices if model.startswith(f"{name}-20")]
    return prices[max(dated, key=len)] if dated else None


class ScanSpend:
    """What one scan's calls cost so far."""

    current: contextvars.ContextVar[ScanSpend | None] = contextvars.ContextVar("scan_spend", default=None)

    def __init__(self) -> None:
        self.usd = 0.0
        self.unpriced = 0  # replies of a model with no price

    @classmethod
    def start(cls) -> ScanSpend:
        """A new spend for the scan whose task runs this (and the tasks it starts from now)."""
        spend = cls()
        cls.current.set(spend)
        return spend

    @property
    def total_usd(self) -> float | None:
        """The scan's cost; None when one of its calls had no price."""
        return None if self.unpriced else self.usd


class Pricing:
    """The price of every model on each deployment serving it, and the metrics of what
    was spent. `served`: (deployment, model, the deployment's own prices), once a route."""

    def __init__(self, served: Iterable[tuple[str, str, Mapping[str, Price]]], metrics: Metrics) -> None:
        self._metrics = metrics
        self._prices: dict[tuple[str, str], Price | None] = {}
        for deployment, model, own in served:
            if (deployment, model) in self._prices:
                continue
            price = self._prices[deployment, model] = price_of(model, {**DEFAULT_PRICES, **own})
            if price is None:
                log.warning(
                    "deployment %s: no price for model %s: its calls' cost is unknown "
                    "(set `prices` on the deployment; docs/configuration.md#prices)",
                    deployment,
                    model,
                )

    def charge(self, deployment: str, model: str, usage: Usage) -> None:
        """One reply's usage: priced into the metrics and the running scan's spend."""
        spend = ScanSpend.current.get()
        price = self._prices.get((deployment, model))
        if price is None:
            self._metrics.upstream_unpriced.labels(deployment, model).inc()
            if spend is not None:
                spend.unpriced += 1
            return
        usd = price.cost(usage)
        self._metrics.upstream_cost.labels(deployment, model).inc(usd)
        if spend is not None:
            spend.usd += usd
