"""Model calls: deployments, routes and the router, breakers, negotiation, providers, the
wire format, reply caches.

Its face, what the other packages import (tests/test_layers.py holds them to it): the
stages call through `client` (`Upstream`) with a `call` (`ChatRequest` → `ChatResult`),
and use `reply_cache` and `tokens`; the scans use `call` (`safety_identifier`) and
`prices` (`ScanSpend`: what a scan's calls cost); settings parse `deployments` and
`profiles` (`call_shape`), and both a calling stage's `stage_call` (`StageCall`). The rest
is this package's own, built into an `Upstream` by the lifespan (app/resources.py, with
app/assembly/), which may import any module.
"""

__all__ = ["call", "client", "deployments", "prices", "profiles", "reply_cache", "stage_call", "tokens"]
