"""`/docs` (app/http/docs_page.py): Swagger UI from this service only — the page references
no other origin, its policy allows its one inline script by hash and nothing else — and in
a real browser (Debian's chromium) it renders the API with no policy violation and no
request leaving the service."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
from urllib.parse import urlsplit

from playwright.async_api import Request as BrowserRequest
from playwright.async_api import Route, async_playwright

from app.http.docs_page import ASSETS_PATH, assets
from tests.conftest import Service
from tests.test_page import chromium_path

RENDER_TIMEOUT_S = 60.0
SCAN_OPERATION = ".opblock-summary-path[data-path='/api/v1/scan/classify/completion']"


def csp_directives(policy: str) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in (part.strip() for part in policy.split(";")) if d}


async def test_docs_reference_only_this_service(service: Service) -> None:
    response = await service.client.get("/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    references = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert references, html
    for ref in references:
        assert ref.startswith(ASSETS_PATH + "/") and not urlsplit(ref).netloc, ref
    assert "cdn" not in html.lower() and "https://" not in html and "http://" not in html

    policy = csp_directives(response.headers["content-security-policy"])
    inline = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    assert len(inline) == 1 and "SwaggerUIBundle" in inline[0]
    digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
    assert policy["script-src"] == ["'self'", f"'sha256-{digest}'"]
    assert policy["default-src"] == ["'self'"] and policy["object-src"] == ["'none'"]
    assert policy["frame-ancestors"] == ["'none'"] and policy["base-uri"] == ["'none'"]
    for sources in policy.values():
        assert not any("://" in s or s == "*" or s.startswith("'unsafe-eval") for s in sources), policy
    head = await service.client.head("/docs")
    assert head.status_code == 200 and head.content == b""

    # The assets, each with its type; versioned URLs are cached; nothing else is served.
    for ref in references:
        asset = await service.client.get(ref)
        assert asset.status_code == 200, ref
        assert asset.headers["cache-control"].startswith("public, max-age=")
        assert asset.headers["x-content-type-options"] == "nosniff"
        again = await service.client.get(ref, headers={"If-None-Match": asset.headers["etag"]})
        assert again.status_code == 304
    bundle = await service.client.get(f"{ASSETS_PATH}/swagger-ui-bundle.js")
    assert bundle.headers["content-type"].startswith("text/javascript")
    assert bundle.headers["cache-control"] == "no-cache"  # not the versioned URL
    assert b"SwaggerUIBundle" in bundle.content and bundle.content == assets()["swagger-ui-bundle.js"].body
    for missing in ("redoc.standalone.js", "..%2Fcore.py", "nope.js"):
        assert (await service.client.get(f"{ASSETS_PATH}/{missing}")).status_code == 404, missing
    assert (await service.client.get("/redoc")).status_code == 404  # FastAPI's CDN page is gone
    paths = (await service.client.get("/openapi.json")).json()["paths"]
    assert "/docs" not in paths and not any(p.startswith(ASSETS_PATH) for p in paths)


# Every Content-Security-Policy violation the page meets, as the browser reports it.
RECORD_VIOLATIONS = """
window.violations = [];
document.addEventListener("securitypolicyviolation", (e) =>
  window.violations.push(`${e.violatedDirective} ${e.blockedURI}`));
"""


async def test_docs_render_in_a_browser_from_this_service_alone(service: Service) -> None:
    origin = service.url
    foreign: list[str] = []
    problems: list[str] = []

    async def only_ours(route: Route, request: BrowserRequest) -> None:
        if request.url.startswith(origin + "/") or request.url.startswith("data:"):
            await route.continue_()
        else:
            foreign.append(request.url)
            await route.abort()

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            page = await browser.new_page()
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
            await page.route("**/*", only_ours)
            await page.add_init_script(RECORD_VIOLATIONS)
            await page.goto(origin + "/docs")
            async with asyncio.timeout(RENDER_TIMEOUT_S):
                await page.wait_for_selector(".swagger-ui .info .title")
                await page.wait_for_selector(
                    ".opblock-summary-path[data-path='/api/v1/scan/classify/completion']"
                )
            title = await page.inner_text(".swagger-ui .info .title")
            assert "ecoscan" in title
            # Opening an operation renders its schemas (and the styles of its parts).
            await page.click(SCAN_OPERATION)
            await page.wait_for_selector(".opblock.is-open .responses-table")
            violations = await page.evaluate("window.violations")
        finally:
            await browser.close()
    assert foreign == []
    assert violations == [], violations
    assert problems == [], problems
