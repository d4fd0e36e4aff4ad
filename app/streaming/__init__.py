"""A scan's events as SSE; reading scans back (status, resume, cancel).

Its face, what the other packages import (tests/test_layers.py holds them to it): `access`
(`ScanAccess`, `Reader`, `token_hash`: the routes, acceptance) and `responses`
(`scan_response` and the other SSE responses: the routes). `sse_response`, how the bytes
go out, is this package's own.
"""

__all__ = ["access", "responses"]
