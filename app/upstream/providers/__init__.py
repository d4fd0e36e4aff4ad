"""The providers a deployment can be, by `provider` name: one module each."""

from __future__ import annotations

from app.upstream.providers.azure import Azure
from app.upstream.providers.base import Provider
from app.upstream.providers.compatible import Compatible
from app.upstream.providers.gemini import Gemini
from app.upstream.providers.openai import OpenAI

PROVIDERS: dict[str, Provider] = {p.name: p for p in (OpenAI(), Azure(), Gemini(), Compatible())}
