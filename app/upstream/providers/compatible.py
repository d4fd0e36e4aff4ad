"""Any other OpenAI-compatible server (a gateway such as LiteLLM, vLLM, a local model):
OpenAI's wire format; the key, if any, as a bearer token. What it refuses is learned
from its 400s (app/upstream/negotiation.py)."""

from __future__ import annotations

from app.upstream.providers import register
from app.upstream.providers.base import Provider


class Compatible(Provider):
    name = "compatible"
    rate_headers = True  # if it sends them; a server that does not just teaches nothing
    key_required = False  # a local server may take none


register(Compatible())
