"""The providers a deployment can be, by `provider` name: one module each in this package,
found by listing it. A module registers its provider (`register`); adding a provider is
adding its module (and its tests). `PROVIDERS` is the one list: app/upstream/deployments.py
checks a deployment's `provider` against it, app/assembly/upstream.py builds each route
from it."""

from __future__ import annotations

import importlib
import pkgutil

from app.upstream.providers.base import Provider

PROVIDERS: dict[str, Provider] = {}


def register(provider: Provider) -> Provider:
    """Make `provider` a `provider` name deployments may use (its module calls this)."""
    known = PROVIDERS.get(provider.name)
    if known is not None and type(known) is not type(provider):
        raise ValueError(f"provider {provider.name!r} is registered twice")
    PROVIDERS[provider.name] = provider
    return provider


def discover() -> dict[str, Provider]:
    """Import every module of this package (its `__path__`), each registering its provider."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")
    return PROVIDERS


discover()
