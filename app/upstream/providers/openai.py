"""OpenAI (api.openai.com): the base behaviour (app/upstream/providers/base.py)."""

from __future__ import annotations

from app.upstream.providers import register
from app.upstream.providers.base import Provider


class OpenAI(Provider):
    name = "openai"


register(OpenAI())
