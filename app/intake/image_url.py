"""Which `https://` image URLs we pass on to the model.

OpenAI fetches an image URL from its own network, but an OpenAI-compatible server we
might be configured against fetches it from ours: a URL naming `localhost`, a private
address or a cloud metadata endpoint would make it a proxy into our network (SSRF). So
before any stream starts a URL must be absolute `https://`, at most 2,048 characters,
printable (no whitespace, control characters, NUL, lone surrogates or noncharacters:
the SDK could not even encode some of those), with no userinfo, a valid IDNA host name
with at least one dot (no `localhost`, no single-label intranet names), and, if the
host is an IP literal, a public address.
A DNS name that *resolves* to a private address is not caught here (that needs the
fetcher's own resolver); the compatible server's egress policy must cover that.
"""

from __future__ import annotations

import ipaddress
import unicodedata
from urllib.parse import urlsplit

from app.errors import ImageUrlRejected

MAX_IMAGE_URL_CHARS = 2048
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain", ".home.arpa")


def check_image_url(url: str) -> str:
    """`url` if it is a public https URL; else `ImageUrlRejected` saying why."""
    if len(url) > MAX_IMAGE_URL_CHARS:
        raise ImageUrlRejected(f"image_url is longer than {MAX_IMAGE_URL_CHARS} characters.")
    bad = next((i for i, ch in enumerate(url) if not ch.isprintable() or ch.isspace()), None)
    if bad is not None:
        # NUL, lone surrogates and noncharacters included: the SDK cannot even encode those.
        raise ImageUrlRejected(f"image_url contains {describe_char(url[bad])} at index {bad}.")
    try:
        url.encode("utf-8")
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port out of range or not a number
    except ValueError:
        raise ImageUrlRejected("image_url is not a valid URL.") from None
    if parts.scheme != "https" or not parts.hostname:
        raise ImageUrlRejected("image_url must be an absolute https:// URL.")
    if "@" in parts.netloc:
        raise ImageUrlRejected("image_url must not contain a user name or password.")
    if port == 0:
        raise ImageUrlRejected("image_url has an invalid port.")
    _check_host(parts.hostname)
    return url


def describe_char(ch: str) -> str:
    """`U+0000 (NUL)`, `U+D800 (a lone surrogate)`...: for error messages, which must
    never echo the character itself (a lone surrogate cannot even be JSON-encoded)."""
    code = ord(ch)
    if code == 0:
        kind = "NUL"
    elif 0xD800 <= code <= 0xDFFF:
        kind = "a lone surrogate"
    elif 0xFDD0 <= code <= 0xFDEF or code & 0xFFFE == 0xFFFE:
        kind = "a Unicode noncharacter"
    elif ch.isspace():
        kind = "whitespace"
    else:
        kind = {
            "Cc": "a control character",
            "Cf": "a format character",
            "Co": "a private-use character",
            "Cn": "an unassigned code point",
        }.get(unicodedata.category(ch), "a character not allowed here")
    return f"U+{code:04X} ({kind})"


def _check_host(host: str) -> None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        if not address.is_global or address.is_multicast:
            raise ImageUrlRejected("image_url must not point at a private, loopback or reserved address.")
        return
    name = host.rstrip(".")
    top = name.rsplit(".", 1)[-1]
    if top.isdigit() or top.startswith("0x"):
        # Not a DNS name but a shorthand IP some resolvers accept: 127.1, 2130706433, 0x7f.1
        raise ImageUrlRejected("image_url has an invalid IP address.")
    try:
        ascii_name = name.encode("idna").decode("ascii")
    except UnicodeError:
        raise ImageUrlRejected("image_url has an invalid host name.") from None
    if "." not in ascii_name or ascii_name == "localhost" or ascii_name.endswith(_LOCAL_SUFFIXES):
        raise ImageUrlRejected("image_url must name a public host (no localhost or single-label names).")
