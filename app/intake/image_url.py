"""Which `https://` image URLs we pass on to the model.

OpenAI fetches an image URL from its own network, but an OpenAI-compatible server we
might be configured against fetches it from ours: a URL naming `localhost`, a private
address or a cloud metadata endpoint would make it a proxy into our network (SSRF). So
before any stream starts a URL must be absolute `https://`, at most 2,048 characters,
printable (no whitespace, control characters, NUL, lone surrogates or noncharacters:
the SDK could not even encode some of those), with no userinfo, a valid IDNA host name
with at least one dot (no `localhost`, no single-label intranet names), and, if the
host is an IP literal, a public address.

The host is checked as a fetcher will read it, not as it is spelled: percent-escapes
decoded, then UTS #46 mapped (`idna`, what browsers and yarl do: fullwidth digits, the
ideographic and fullwidth dots U+3002/U+FF0E/U+FF61 become ASCII, case folds), trailing
dots dropped. Only then the IP and name checks: `https://127。0。0。1/` and
`https://127.0.0.%31/` are 127.0.0.1 to httpx and yarl, and are refused as such. Any
spelling of an IPv4 address other than the plain dotted quad (decimal `2130706433`,
octal, hex, short `127.1`, zero-padded) is refused outright, as is an IPv6 address that
embeds a non-public IPv4 one (mapped, compatible, 6to4, NAT64, Teredo).
A DNS name that *resolves* to a private address is not caught here (that needs the
fetcher's own resolver); the compatible server's egress policy must cover that.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from urllib.parse import unquote, urlsplit

import idna

from app.errors import ImageUrlRejected

MAX_IMAGE_URL_CHARS = 2048
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain", ".home.arpa")
# A last label a URL parser reads as a number makes the host an IPv4 address (WHATWG
# "ends in a number"): 127.1, 2130706433, 0x7f.1, 0177.0.0.1.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
# NAT64's well-known prefix (RFC 6052): the IPv4 address sits in the last 32 bits. The
# local-use prefix (RFC 8215) places it as each network likes: refused whole.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


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
    _check_host(parts.hostname, bracketed="[" in parts.netloc)
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


def _check_host(host: str, *, bracketed: bool) -> None:
    try:
        decoded = unquote(host, errors="strict")
    except UnicodeDecodeError:
        raise ImageUrlRejected("image_url has an invalid host name.") from None
    if bracketed:
        try:
            _check_address(ipaddress.IPv6Address(decoded))
        except ValueError:
            raise ImageUrlRejected("image_url has an invalid IP address.") from None
        return
    try:
        mapped = idna.uts46_remap(decoded, std3_rules=True, transitional=False)
    except (idna.IDNAError, ValueError):
        raise ImageUrlRejected("image_url has an invalid host name.") from None
    name = mapped.rstrip(".")
    if _NUMERIC_LABEL.fullmatch(name.rsplit(".", 1)[-1]):
        try:
            address = ipaddress.IPv4Address(name)  # the plain dotted quad only
        except ValueError:
            raise ImageUrlRejected("image_url has an invalid IP address.") from None
        _check_address(address)
        return
    try:
        ascii_name = idna.encode(name, uts46=False).decode("ascii")
    except (idna.IDNAError, UnicodeError):
        raise ImageUrlRejected("image_url has an invalid host name.") from None
    if "." not in ascii_name or ascii_name == "localhost" or ascii_name.endswith(_LOCAL_SUFFIXES):
        raise ImageUrlRejected("image_url must name a public host (no localhost or single-label names).")


def _check_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    for each in (address, *_embedded_ipv4(address)):
        if (
            not each.is_global
            or each.is_multicast
            or each.is_reserved
            or each.is_loopback
            or each.is_link_local
            or each.is_unspecified
            or each in _NAT64_LOCAL
        ):
            raise ImageUrlRejected("image_url must not point at a private, loopback or reserved address.")


def _embedded_ipv4(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 one carries, which a dual-stack fetcher may reach."""
    if isinstance(address, ipaddress.IPv4Address):
        return []
    found = [a for a in (address.ipv4_mapped, address.sixtofour) if a is not None]
    if address.teredo is not None:
        found.extend(address.teredo)
    if int(address) >> 32 == 0 or address in _NAT64:  # IPv4-compatible ::a.b.c.d, or NAT64
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found
