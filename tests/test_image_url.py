"""`check_image_url` (app/intake/image_url.py) reads the host as a fetcher will — percent-
decoded, UTS #46 mapped, trailing dots dropped — before its IP and name checks, so no
spelling of a private address or of `localhost` gets through."""

from __future__ import annotations

import pytest

from app.errors import ImageUrlRejected
from app.intake.image_url import check_image_url

# The bypasses of issue 34: each one resolved to a private host in httpx and yarl.
ISSUE_BYPASSES = [
    "https://127。0。0。1/",
    "https://169。254。169。254/latest/meta-data/",
    "https://localhost。/",
    "https://127.0.0.%31/",
]

OTHER_DOTS_AND_ESCAPES = [
    "https://127．0．0．1/",  # U+FF0E fullwidth full stop
    "https://127｡0｡0｡1/",  # U+FF61 halfwidth ideographic full stop
    "https://１２７.０.０.１/",  # fullwidth digits
    "https://127.0.0.1./",
    "https://127.0.0.1../",
    "https://localhost./",
    "https://LOCALHOST/",
    "https://ⓛocalhost/",  # circled letter, mapped to `l`
    "https://%6c%6fcalhost/",
    "https://127%2e0%2e0%2e1/",
    "https://127%E3%80%820%E3%80%820%E3%80%821/",  # the ideographic dot, percent-encoded
    "https://metadata.google.internal。/",
    "https://printer.local%2e/",
    "https://10.0.0.1%2F@x/",
    "https://%ff/",  # not UTF-8 once decoded
]

IPV4_SPELLINGS = [
    "https://2130706433/",  # decimal
    "https://0177.0.0.1/",  # octal
    "https://0x7f.1/",  # hex, short
    "https://0x7f000001/",
    "https://127.1/",  # short
    "https://127.0.1/",
    "https://127.000.000.001/",  # zero-padded
    "https://010.0.0.1/",
    "https://0/",
    "https://0x/",
    "https://0.0.0.0/",
    "https://169.254.169.254/",
    "https://100.64.0.1/",  # carrier-grade NAT
    "https://192.168.1.1/",
    "https://224.0.0.1/",  # multicast
    "https://240.0.0.1/",  # reserved
    "https://8.8.8.8.8/",
    "https://0x08080808/",  # even a public one: only the dotted quad is taken
]

IPV6_SPELLINGS = [
    "https://[::1]/",
    "https://[0:0:0:0:0:0:0:1]/",
    "https://[::]/",
    "https://[::ffff:127.0.0.1]/",  # IPv4-mapped
    "https://[0:0:0:0:0:ffff:7f00:1]/",
    "https://[::ffff:a9fe:a9fe]/",  # mapped 169.254.169.254
    "https://[::127.0.0.1]/",  # IPv4-compatible
    "https://[::a00:1]/",
    "https://[2002:7f00:1::]/",  # 6to4 of 127.0.0.1
    "https://[2002:a9fe:a9fe::1]/",  # 6to4 of 169.254.169.254
    "https://[64:ff9b::7f00:1]/",  # NAT64 of 127.0.0.1
    "https://[64:ff9b::a9fe:a9fe]/",  # NAT64 of 169.254.169.254
    "https://[64:ff9b:1::1]/",  # NAT64 local-use
    "https://[2001:0:4136:e378:8000:63bf:80ff:fffe]/",  # Teredo, client 127.0.0.1
    "https://[fe80::1]/",
    "https://[fe80::1%25eth0]/",
    "https://[fc00::1]/",
    "https://[fd00:ec2::254]/",  # AWS's IPv6 metadata endpoint
    "https://[ff02::1]/",
    "https://[%3a%3a1]/",
    "https://[::1%5d/",
    "https://[not-an-address]/",
]


@pytest.mark.parametrize("url", ISSUE_BYPASSES + OTHER_DOTS_AND_ESCAPES + IPV4_SPELLINGS + IPV6_SPELLINGS)
def test_refuses_every_spelling_of_a_private_or_local_host(url: str) -> None:
    with pytest.raises(ImageUrlRejected) as refused:
        check_image_url(url)
    assert refused.value.code == "IMAGE_URL_REJECTED"
    assert refused.value.status == 422


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/a.jpg",
        "https://example.com./a.jpg",
        "https://EXAMPLE.com/a.jpg",
        "https://cdn.example.co.kr:8443/p/a.jpg?x=1",
        "https://예시.한국/사진.jpg",
        "https://xn--9n2bp8q.xn--3e0b707e/a.jpg",
        "https://example。com/a.jpg",  # a public name in ideographic dots is still that name
        "https://8.8.8.8/a.jpg",
        "https://[2606:4700:4700::1111]/a.jpg",
        "https://[2002:808:808::1]/a.jpg",  # 6to4 of a public address
        "https://ex%61mple.com/a.jpg",
        "https://1e100.net/a.jpg",  # a last label that is not a number
    ],
)
def test_passes_public_hosts_unchanged(url: str) -> None:
    assert check_image_url(url) == url


def test_the_refusal_says_why_without_echoing_the_host() -> None:
    with pytest.raises(ImageUrlRejected) as refused:
        check_image_url("https://0x7f.1/")
    assert refused.value.message == "image_url has an invalid IP address."
    with pytest.raises(ImageUrlRejected) as refused:
        check_image_url("https://localhost。/")
    assert "localhost" in refused.value.message and "。" not in refused.value.message
