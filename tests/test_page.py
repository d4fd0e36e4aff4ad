"""The "try it" page (`/`, app/http/page.py + app/static/): its HTTP caching, and a real
browser — Debian's chromium driven by Playwright — taking a photo through a whole scan
at 360 px wide, against the simulator slowed down enough to watch the answer stream."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image
from playwright.async_api import Page, Route, async_playwright

from app.http.page import package_version
from app.sim.server import RunningSimulator
from app.stages.order import stage_names
from tests.conftest import Service, make_jpeg, sim_configure

ROOT = Path(__file__).resolve().parent.parent
DOCS_SCREENSHOT = ROOT / "docs" / "page.png"
STEPS = stage_names()


async def test_index_is_html_with_an_etag_and_revalidates(service: Service) -> None:
    response = await service.client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["cache-control"] == "no-cache"
    assert "default-src 'self'" in response.headers["content-security-policy"]
    etag = response.headers["etag"]
    assert etag.startswith(f'"{package_version()}-')
    assert 'lang="ko"' in response.text
    assert "__VERSION__" not in response.text
    assert '<meta name="ecoscan-image-long-side" content="768">' in response.text
    assert f"/static/app.js?v={package_version()}" in response.text

    again = await service.client.get("/", headers={"If-None-Match": etag})
    assert again.status_code == 304
    assert again.content == b""
    assert again.headers["etag"] == etag
    assert (await service.client.get("/", headers={"If-None-Match": '"other"'})).status_code == 200
    assert (await service.client.get("/", headers={"If-None-Match": f'"x", W/{etag}'})).status_code == 304


async def test_static_assets_are_cached_by_version(service: Service) -> None:
    versioned = await service.client.get(f"/static/app.js?v={package_version()}")
    assert versioned.status_code == 200
    assert versioned.headers["content-type"].startswith("text/javascript")
    assert versioned.headers["cache-control"] == "public, max-age=86400"
    assert "X-Scan-Token" in versioned.text
    stale = await service.client.get("/static/style.css?v=0.0.0-old")
    assert stale.headers["cache-control"] == "no-cache"
    assert stale.headers["content-type"].startswith("text/css")
    etag = stale.headers["etag"]
    assert (await service.client.get("/static/style.css", headers={"If-None-Match": etag})).status_code == 304
    for missing in ("/static/nope.js", "/static/..%2Fpage.py", "/static/%2e%2e%2fmain.py"):
        assert (await service.client.get(missing)).status_code == 404, missing
    paths = (await service.client.get("/openapi.json")).json()["paths"]
    assert "/" not in paths
    assert not any(p.startswith("/static") for p in paths)


def chromium_path() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if found is None:
        pytest.fail("Debian's chromium is needed for the page test: apt-get install -y chromium")
    return found


# The page's upload as the browser sent it (a Blob in FormData: not in Playwright's request).
KEEP_UPLOAD = """
const fetchAsIs = window.fetch;
window.fetch = async (url, init) => {
  const image = init && init.body instanceof FormData ? init.body.get("image") : null;
  if (image) window.keptUpload = Array.from(new Uint8Array(await image.arrayBuffer()));
  return fetchAsIs(url, init);
};
"""


async def _state(page: Page) -> str:
    value = await page.get_attribute("#result", "data-state")
    return value or ""


async def test_a_scan_in_the_browser_at_360px(
    service: Service, sim: RunningSimulator, tmp_path: Path
) -> None:
    # Slow enough to watch: vision ~1.4 s, the answer streams its tokens over ~1.4 s.
    await sim_configure(sim, time_scale=0.3, text_tokens=60, capture_requests=2)
    photo = tmp_path / "bottle.jpg"
    photo.write_bytes(make_jpeg(7, (1600, 1200)))

    problems: list[str] = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            page = await browser.new_page(viewport={"width": 360, "height": 740})
            page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
            await page.add_init_script(KEEP_UPLOAD)
            await page.goto(service.url + "/")
            assert await page.locator("#send").is_disabled()
            await page.set_input_files("#photo-camera", str(photo))
            await page.fill("#question", "라벨은 떼야 하나요?")
            await page.click("#send")

            # Sample the live answer while the scan streams, until `done` arrives.
            lengths_before_done: list[int] = []
            async with asyncio.timeout(60):
                while (state := await _state(page)) != "done":
                    assert state != "error", await page.inner_text("#error")
                    text = await page.text_content("#answer-text") or ""
                    if await _state(page) != "done":
                        lengths_before_done.append(len(text))
                    await asyncio.sleep(0.02)

            growing = sorted({n for n in lengths_before_done if n > 0})
            assert len(growing) >= 2, f"the answer did not grow while streaming: {lengths_before_done}"
            for step in STEPS:
                item = page.locator(f'#stages [data-step="{step}"]')
                assert await item.get_attribute("data-status") == "completed", step
                assert "완료" in await item.inner_text()
            assert await page.is_visible("#classification")
            assert (await page.inner_text("#item-name")).strip()
            assert await page.is_visible("#rule-card")
            assert (await page.inner_text("#rule-body")).strip()
            assert await page.is_visible("#answer-card")
            assert await page.is_visible("#reward-card")
            assert (await page.inner_text("#reward-body")).strip()
            assert await page.get_attribute("#answer-text", "aria-live") == "polite"
            assert "안내를 다 받았어요" in await page.inner_text("#form-status")
            # Nothing wider than the phone.
            assert await page.evaluate("document.documentElement.scrollWidth") <= 360

            artifact = tmp_path / "page-360.png"
            await page.screenshot(path=str(artifact), full_page=True)
            print(f"screenshot: {artifact}")
            # docs/page.png (README) is committed: written when missing, or on request.
            if not DOCS_SCREENSHOT.exists() or os.environ.get("UPDATE_PAGE_SCREENSHOT") == "1":
                # A 64-colour palette keeps it small (flat UI colours survive it).
                with Image.open(artifact) as shot:
                    shot.convert("RGB").quantize(64).save(DOCS_SCREENSHOT, optimize=True)
            upload = bytes(await page.evaluate("window.keptUpload"))
        finally:
            await browser.close()
    assert not problems, problems
    _assert_sent_as_uploaded(sim, upload)


def _assert_sent_as_uploaded(sim: RunningSimulator, upload: bytes) -> None:
    """The page downscaled the photo to the service's IMAGE_LONG_SIDE (768 here), so the
    model got the JPEG the browser uploaded, byte for byte: checked, not re-encoded."""
    vision = next(
        body
        for body in sim.state.captured
        if body.get("response_format", {}).get("json_schema", {}).get("name") == "waste_classification"
    )
    parts = vision["messages"][1]["content"]
    url = next(part["image_url"]["url"] for part in parts if part["type"] == "image_url")
    sent = base64.b64decode(url.removeprefix("data:image/jpeg;base64,"))
    with Image.open(io.BytesIO(sent)) as img:
        assert img.size == (768, 576)
    assert sent == upload, "the service re-encoded the page's photo"


async def test_a_photo_of_several_items_draws_each_box_and_rule_card_at_360px(
    service: Service, sim: RunningSimulator, tmp_path: Path
) -> None:
    await sim_configure(sim, time_scale=0.05, text_tokens=200)
    photo = tmp_path / "pet.jpg"
    photo.write_bytes(make_jpeg(11, (1600, 1200)))
    problems: list[str] = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            page = await browser.new_page(viewport={"width": 360, "height": 740})
            page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
            await page.goto(service.url + "/")
            await page.set_input_files("#photo-pick", str(photo))
            await page.fill("#question", "생수병, 라벨, 플라스틱 뚜껑 어떻게 버려요?")
            await page.click("#send")
            await page.wait_for_selector(
                '#result[data-state="done"], #result[data-state="error"]', timeout=60_000
            )
            assert await _state(page) == "done", await page.inner_text("#error")
            assert await page.is_visible("#items-card")
            await page.wait_for_function("document.getElementById('items-img').complete")
            photo_box = await page.locator("#items-img").bounding_box()
            assert photo_box is not None and photo_box["width"] <= 360
            labels = []
            for index in range(3):
                frame = page.locator(f'#items-boxes [data-index="{index}"]')
                box = await frame.bounding_box()
                assert box is not None, index
                # Inside the photo as shown (a box past the frame's edge was clamped).
                assert box["x"] >= photo_box["x"] - 1 and box["y"] >= photo_box["y"] - 1
                assert box["x"] + box["width"] <= photo_box["x"] + photo_box["width"] + 1
                assert box["y"] + box["height"] <= photo_box["y"] + photo_box["height"] + 1
                labels.append(await frame.inner_text())
            assert labels == ["1. 생수병", "2. 라벨", "3. 플라스틱 뚜껑"]
            cards = page.locator("#items-list .item-entry")
            assert await cards.count() == 3
            for index in range(3):
                assert (await cards.nth(index).locator(".item-rule").inner_text()).strip(), index
            assert "(주 품목)" in await cards.nth(0).inner_text()
            assert await page.evaluate("document.documentElement.scrollWidth") <= 360
            await page.screenshot(path=str(tmp_path / "items-360.png"), full_page=True)
        finally:
            await browser.close()
    assert not problems, problems


async def test_the_page_resumes_an_anonymous_scan_with_its_token_in_the_header(
    service: Service, tmp_path: Path
) -> None:
    """The POST's stream is cut after two events (the browser gets them through a route
    that stops there); the page resumes with `X-Scan-Token`, never `?token=`, which would
    land in access logs, and reaches `done`."""
    photo = tmp_path / "bottle.jpg"
    photo.write_bytes(make_jpeg(8, (800, 600)))
    resumes: list[tuple[str, dict[str, str]]] = []
    tokens: list[str] = []

    async def cut_after_two_events(route: Route) -> None:
        response = await route.fetch()
        body = await response.text()
        tokens.append(response.headers["x-scan-token"])
        await route.fulfill(response=response, body="\r\n\r\n".join(body.split("\r\n\r\n")[:2]) + "\r\n\r\n")

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            page = await browser.new_page(viewport={"width": 360, "height": 740})
            await page.route("**/api/v1/scan/classify/completion", cut_after_two_events)
            page.on(
                "request",
                lambda r: (
                    resumes.append((r.url, r.headers)) if r.url.split("?")[0].endswith("/events") else None
                ),
            )
            await page.goto(service.url + "/")
            await page.set_input_files("#photo-camera", str(photo))
            await page.click("#send")
            async with asyncio.timeout(60):
                while (state := await _state(page)) != "done":
                    assert state != "error", await page.inner_text("#error")
                    await asyncio.sleep(0.05)
        finally:
            await browser.close()
    assert tokens and resumes, (tokens, resumes)
    for url, headers in resumes:
        assert "token=" not in url
        assert headers["x-scan-token"] == tokens[0]
        assert headers["last-event-id"] == "2"
