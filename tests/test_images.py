"""Image preparation (the CPU lane's main job) on real JPEG/PNG bytes."""

from __future__ import annotations

import base64
import dataclasses
import io
import random
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from PIL import Image, ImageDraw, ImageFile

from app.errors import CpuLaneSaturated, ImageInvalid, ImageTooLarge, ImageTooManyPixels, ImageTypeUnsupported
from app.images.budget import DecodeBudget, decode_budget
from app.images.data_url import decode_data_url
from app.images.jpeg_markers import MAX_JPEG_SCANS, jfif_walk, jpeg_is_multiscan, scan_head
from app.images.limits import ImageLimits
from app.images.prepare import NotInline, decode_plan, prepare_image
from app.images.sniff import sniff_mime

from .conftest import Service, data_url, make_jpeg, run_scan

LIMITS = ImageLimits(max_bytes=10_000_000, max_pixels=40_000_000, long_side=768, jpeg_quality=85)


def decoded(prepared_url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(prepared_url.split(",", 1)[1])))


def test_large_photo_is_downscaled_to_the_long_side() -> None:
    prepared = prepare_image(make_jpeg(1, (4032, 3024)), LIMITS)
    assert (prepared.width, prepared.height) == (768, 576)
    assert (prepared.original_width, prepared.original_height) == (4032, 3024)
    img = decoded(prepared.data_url)
    assert img.format == "JPEG" and img.size == (768, 576)


def test_small_images_are_not_upscaled() -> None:
    prepared = prepare_image(make_jpeg(1, (320, 240)), LIMITS)
    assert (prepared.width, prepared.height) == (320, 240)


@pytest.mark.parametrize(
    ("orientation", "size"), [(1, (768, 576)), (6, (576, 768)), (8, (576, 768)), (3, (768, 576))]
)
def test_exif_orientation_is_applied(orientation: int, size: tuple[int, int]) -> None:
    prepared = prepare_image(make_jpeg(2, (2000, 1500), exif_orientation=orientation), LIMITS)
    assert (prepared.width, prepared.height) == size


def test_a_clean_jpeg_within_the_long_side_goes_on_as_it_came() -> None:
    raw = make_jpeg(4, (640, 480))  # what our page sends: a canvas's JPEG, JFIF header only
    prepared = prepare_image(raw, LIMITS)
    assert base64.b64decode(prepared.data_url.split(",", 1)[1]) == raw
    assert prepared.prepared_sha256 == prepared.sha256
    assert (prepared.width, prepared.height) == (640, 480)


def _with_exif_gps(raw: bytes) -> bytes:
    img, exif = Image.open(io.BytesIO(raw)), Image.Exif()
    exif[0x8825] = {1: "N", 2: (37.0, 33.0, 59.0)}  # GPSInfo: where the photo was taken
    out = io.BytesIO()
    img.save(out, "JPEG", quality=85, exif=exif.tobytes())
    return out.getvalue()


def _resaved(raw: bytes, **options: Any) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(raw)).save(out, "JPEG", **options)
    return out.getvalue()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda raw: _with_exif_gps(raw), id="exif"),
        pytest.param(lambda raw: _resaved(raw, quality=85, icc_profile=b"\0" * 128), id="icc-profile"),
        pytest.param(lambda raw: _resaved(raw, quality=85, comment=b"Jane's kitchen"), id="comment"),
        pytest.param(lambda raw: raw + b"PK\x03\x04 appended", id="trailing-bytes"),
        pytest.param(lambda raw: _cmyk(raw), id="cmyk"),
        pytest.param(lambda raw: _resaved(raw, quality=100, subsampling=0), id="bloated"),
    ],
)
def test_a_jpeg_with_more_than_pixels_is_re_encoded_bare(make: Callable[[bytes], bytes]) -> None:
    noisy = Image.effect_noise((320, 240), 90).convert("RGB")  # noise: q100 takes > 1 byte/pixel
    out = io.BytesIO()
    noisy.save(out, "JPEG", quality=85)
    clean = out.getvalue()
    assert prepare_image(clean, LIMITS).prepared_sha256 == prepare_image(clean, LIMITS).sha256  # as it came
    raw = make(clean)
    prepared = prepare_image(raw, LIMITS)
    sent = base64.b64decode(prepared.data_url.split(",", 1)[1])
    assert sent != raw and prepared.prepared_sha256 != prepared.sha256
    img = Image.open(io.BytesIO(sent))
    assert img.mode == "RGB" and (img.width, img.height) == (320, 240)
    assert not img.getexif() and "icc_profile" not in img.info and "comment" not in img.info
    assert sent.endswith(b"\xff\xd9")


def test_a_data_url_sent_as_it_came_keeps_its_base64_and_bad_base64_is_refused() -> None:
    raw = make_jpeg(3, (320, 240))
    url = data_url(raw)
    data, encoded = decode_data_url(url, LIMITS.max_bytes)
    assert data == raw and encoded == url.split(",", 1)[1]
    as_is = prepare_image(data, LIMITS, encoded=encoded)
    assert as_is.prepared_sha256 == as_is.sha256 and as_is.data_url == "data:image/jpeg;base64," + encoded
    # Strictly valid but not b64encode's (a surplus "=", or unused low bits set): the same
    # bytes, sent in the standard spelling.
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    if encoded.endswith("="):
        last = encoded.rstrip("=")
        odd = last[:-1] + alphabet[alphabet.index(last[-1]) + 1] + encoded[len(last) :]
    else:
        odd = encoded + "="
    data_again, odd_text = decode_data_url("data:image/jpeg;base64," + odd, LIMITS.max_bytes)
    assert data_again == raw and odd_text == odd
    assert prepare_image(data_again, LIMITS, encoded=odd).data_url == "data:image/jpeg;base64," + encoded
    big = make_jpeg(3, (2000, 1500))  # re-encoded: the text is the new JPEG's
    resized = prepare_image(big, LIMITS, encoded=base64.b64encode(big).decode())
    assert base64.b64decode(resized.data_url.split(",", 1)[1]) != big
    payload = encoded[:40]
    for bad in (
        payload + " ",
        payload[:-1],
        payload[:-2] + "=A",
        "=" + payload,
        payload[:20] + "\n" + payload[20:],
        "é" * 4,
    ):
        with pytest.raises(ImageInvalid):
            decode_data_url("data:image/jpeg;base64," + bad, LIMITS.max_bytes)


def _jfif_thumbnail(raw: bytes) -> bytes:  # APP0 with a 1x1 RGB thumbnail (another picture)
    return raw[:4] + b"\x00\x13" + raw[6:18] + b"\x01\x01\xff\x00\x00" + raw[20:]


def _before_eoi(raw: bytes, segment: bytes) -> bytes:
    return raw[:-2] + segment + raw[-2:]


HIDDEN = [
    pytest.param(_jfif_thumbnail, id="jfif-thumbnail"),
    pytest.param(lambda raw: raw[:20] + b"GPS 37.56N alice@example.com" + raw[20:], id="stray-bytes"),
    pytest.param(lambda raw: _before_eoi(raw, b"\xff\xe1\x00\x0dExif\x00\x00GPS!"), id="exif-after-scan"),
    pytest.param(lambda raw: raw + _with_exif_gps(raw), id="a-second-jpeg-appended"),
    pytest.param(lambda raw: raw[:20] + b"\xff\xf0\x00\x06JPG0" + raw[20:], id="jpgn-segment"),
    pytest.param(lambda raw: raw[:20] + b"\xff\xfe\x00\x06hi!!" + raw[20:], id="comment"),
]


@pytest.mark.parametrize("hide", HIDDEN)
def test_anything_but_a_bare_jfif_image_is_not_sent_as_it_came(hide: Callable[[bytes], bytes]) -> None:
    raw = make_jpeg(5, (320, 240))
    assert jfif_walk(raw).scans > 0
    assert jfif_walk(hide(raw)).scans == 0


def test_a_progressive_jfif_is_bare_too() -> None:
    out = io.BytesIO()
    Image.open(io.BytesIO(make_jpeg(6, (320, 240)))).save(out, "JPEG", quality=85, progressive=True)
    assert jfif_walk(out.getvalue()).scans > 0


def _cmyk(raw: bytes) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(raw)).convert("CMYK").save(out, "JPEG", quality=85)
    return out.getvalue()


def test_same_bytes_give_the_same_prepared_image_and_hash() -> None:
    raw = make_jpeg(3, (1200, 900))
    a, b = prepare_image(raw, LIMITS), prepare_image(raw, LIMITS)
    assert a.data_url == b.data_url and a.sha256 == b.sha256


def test_sniffing_trusts_bytes_not_labels() -> None:
    assert sniff_mime(make_jpeg(1)) == "image/jpeg"
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    assert sniff_mime(png.getvalue()) == "image/png"
    webp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(webp, "WEBP")
    assert sniff_mime(webp.getvalue()) == "image/webp"
    assert sniff_mime(b"%PDF-1.7 ...") is None


def test_webp_is_prepared_as_jpeg() -> None:
    webp = io.BytesIO()
    Image.new("RGB", (1000, 500), (1, 2, 3)).save(webp, "WEBP")
    prepared = prepare_image(webp.getvalue(), LIMITS)
    assert decoded(prepared.data_url).format == "JPEG" and prepared.width == 768


def test_rejections() -> None:
    with pytest.raises(ImageInvalid):
        prepare_image(b"", LIMITS)
    with pytest.raises(ImageInvalid):
        prepare_image(make_jpeg(1)[:1000], LIMITS)
    with pytest.raises(ImageTooLarge):
        prepare_image(make_jpeg(1), ImageLimits(100, 40_000_000, 768, 85))
    with pytest.raises(ImageTooManyPixels):
        prepare_image(make_jpeg(1, (1000, 1000)), ImageLimits(10_000_000, 999_999, 768, 85))
    with pytest.raises(ImageTypeUnsupported):
        decode_data_url("data:image/tiff;base64,AAAA", 1000)
    with pytest.raises(ImageTooLarge):
        decode_data_url(data_url(make_jpeg(1)), 1000)


# --- formats we recognise but do not accept: 415, and garbage: 400 ---------------------


def pillow_bytes(fmt: str, mode: str = "RGB", size: tuple[int, int] = (64, 48)) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, (10, 200, 30) if mode == "RGB" else 1).save(out, fmt)
    return out.getvalue()


UNSUPPORTED_IMAGES: dict[str, tuple[Callable[[], bytes], str]] = {
    "tiff": (lambda: pillow_bytes("TIFF"), "image/tiff"),
    "tiff-big-endian": (lambda: b"MM\x00*\x00\x00\x00\x08" + b"\x00" * 64, "image/tiff"),
    "bmp": (lambda: pillow_bytes("BMP"), "image/bmp"),
    "ico": (lambda: pillow_bytes("ICO"), "image/x-icon"),
    "ppm": (lambda: pillow_bytes("PPM"), "image/x-portable-anymap"),
    "qoi": (lambda: pillow_bytes("QOI"), "image/qoi"),
    "dds": (lambda: pillow_bytes("DDS"), "image/vnd-ms.dds"),
    "pcx": (lambda: pillow_bytes("PCX"), "image/x-pcx"),
    "tga": (lambda: pillow_bytes("TGA"), "image/x-tga"),
    "sgi": (lambda: pillow_bytes("SGI"), "image/x-sgi"),
    "jpeg2000": (
        lambda: b"\x00\x00\x00\x0cjP  \r\n\x87\n\x00\x00\x00\x14ftypjp2 " + b"\x00" * 32,
        "image/jp2",
    ),
    "jpeg-xl": (lambda: b"\x00\x00\x00\x0cJXL \r\n\x87\n" + b"\x00" * 32, "image/jxl"),
    "psd": (lambda: b"8BPS\x00\x01" + b"\x00" * 64, "image/vnd.adobe.photoshop"),
    "heic": (lambda: b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 64, "image/heic"),
    "heif": (lambda: b"\x00\x00\x00\x18ftypmif1\x00\x00\x00\x00mif1heic" + b"\x00" * 64, "image/heif"),
    "avif": (lambda: b"\x00\x00\x00\x20ftypavif\x00\x00\x00\x00avifmif1miaf" + b"\x00" * 64, "image/avif"),
    "svg": (
        lambda: b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>',
        "image/svg+xml",
    ),
    "svg-xml-prolog": (
        lambda: (
            b'\xef\xbb\xbf\n  <?xml version="1.0" encoding="UTF-8"?>\n'
            b'<!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN" "http://www.w3.org/Graphics/SVG/1.1/DTD/svg11.dtd">\n'
            b'<svg xmlns="http://www.w3.org/2000/svg"><rect width="5" height="5"/></svg>'
        ),
        "image/svg+xml",
    ),
}


@pytest.mark.parametrize("name", UNSUPPORTED_IMAGES)
def test_recognised_images_we_do_not_accept_are_unsupported_not_invalid(name: str) -> None:
    make, mime = UNSUPPORTED_IMAGES[name]
    raw = make()
    assert sniff_mime(raw) == mime
    with pytest.raises(ImageTypeUnsupported) as caught:
        prepare_image(raw, LIMITS)
    assert caught.value.status == 415 and mime in caught.value.message


@pytest.mark.parametrize(
    "raw",
    [
        b"hello, world",
        b"BMW is a car maker, not a bitmap header",  # "BM" without a DIB header
        b"P1 is the first parking level",  # "P1" without a PNM size
        b"<html><body><svg></svg></body></html>",  # markup, but not an SVG document
        b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n",
        b"\x00\x00\x01\x00",  # an ICO magic with nothing after it
        b"GIF89a but not really a gif",
        bytes(range(256)) * 4,
    ],
)
def test_bytes_that_are_no_image_are_invalid(raw: bytes) -> None:
    with pytest.raises(ImageInvalid) as caught:
        prepare_image(raw, LIMITS)
    assert caught.value.status == 400


def test_the_accepted_formats_are_unchanged() -> None:
    for fmt, mime in (
        ("JPEG", "image/jpeg"),
        ("PNG", "image/png"),
        ("GIF", "image/gif"),
        ("WEBP", "image/webp"),
    ):
        raw = pillow_bytes(fmt)
        assert sniff_mime(raw) == mime
        assert decoded(prepare_image(raw, LIMITS).data_url).format == "JPEG"


async def test_unsupported_formats_get_415_over_http(service: Service) -> None:
    tiff = await run_scan(service.client, files={"image": ("x.tif", pillow_bytes("TIFF"), "image/tiff")})
    assert (tiff.status, tiff.body["code"]) == (415, "IMAGE_TYPE_UNSUPPORTED")
    # The label says PNG; the bytes are an SVG document.
    svg = UNSUPPORTED_IMAGES["svg"][0]()
    labelled = await run_scan(service.client, json={"image_url": data_url(svg, "image/png")})
    assert (labelled.status, labelled.body["code"]) == (415, "IMAGE_TYPE_UNSUPPORTED")
    garbage = await run_scan(service.client, files={"image": ("x.bmp", b"BMW, not a bitmap", "image/bmp")})
    assert (garbage.status, garbage.body["code"]) == (400, "IMAGE_INVALID")


# --- memory: estimate before decoding, a budget, no full-size copies -------------------


def close_to(pixel: object, expected: tuple[int, ...], tolerance: int = 6) -> bool:
    assert isinstance(pixel, tuple)
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, expected, strict=True))


BIG_SIDE = 6300  # the reported case: 39.7 Mpx, under the 40 Mpx limit


@pytest.fixture(scope="module")
def big_rgba_png() -> bytes:
    """A 6300x6300 RGBA PNG, mostly transparent: a few hundred KB that decode to 159 MB."""
    img = Image.new("RGBA", (BIG_SIDE, BIG_SIDE), (0, 0, 0, 0))
    draw = ImageDraw.Draw(img)
    draw.rectangle((BIG_SIDE // 2, 0, BIG_SIDE - 1, BIG_SIDE - 1), fill=(200, 30, 40, 255))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def test_the_big_rgba_png_is_estimated_from_its_header(big_rgba_png: bytes) -> None:
    plan = decode_plan(big_rgba_png, LIMITS)
    assert plan.decoded_size == (BIG_SIDE, BIG_SIDE)
    assert plan.decoder_bytes == BIG_SIDE * BIG_SIDE * 4  # RGBA, as Pillow stores it
    # Everything else (tiles, the reduced image, the thumbnail) is small beside it.
    assert plan.working_bytes < 16 * 2**20
    # It fits the default budget (8 B x max_pixels) alone, but two do not run at once.
    assert LIMITS.decode_budget == 320_000_000
    assert plan.cost <= LIMITS.decode_budget < 2 * plan.cost


def test_the_big_rgba_png_is_prepared_without_a_full_size_copy(
    big_rgba_png: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every image Pillow derives from another (convert, crop, copy, reduce, new, transpose...)
    # goes through Image._new; the decoded image itself does not.
    derived: list[tuple[int, int]] = []
    original_new = Image.Image._new

    def spy(self: Image.Image, im: Any) -> Image.Image:
        derived.append(im.size)
        return original_new(self, im)

    monkeypatch.setattr(Image.Image, "_new", spy)
    prepared = prepare_image(big_rgba_png, LIMITS)
    monkeypatch.undo()
    assert (prepared.width, prepared.height) == (768, 768)
    largest = max(w * h for w, h in derived)
    assert largest <= (BIG_SIDE * BIG_SIDE) // 40, f"a {largest}-pixel intermediate"
    img = decoded(prepared.data_url).convert("RGB")
    assert close_to(img.getpixel((100, 384)), (255, 255, 255))  # transparent: white
    assert close_to(img.getpixel((660, 384)), (200, 30, 40))


def test_an_image_over_the_budget_is_refused_before_decoding(
    big_rgba_png: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_decoding(self: ImageFile.ImageFile) -> None:
        raise AssertionError("decoded despite the budget")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    small_budget = dataclasses.replace(LIMITS, decode_budget_bytes=100 * 2**20)
    with pytest.raises(ImageTooManyPixels) as caught:
        prepare_image(big_rgba_png, small_budget)
    assert caught.value.status == 413 and "MiB" in caught.value.message


def test_the_decode_holds_its_estimate_of_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = pillow_bytes("PNG", "RGB", (2000, 1000))
    limits = dataclasses.replace(LIMITS, decode_budget_bytes=123_456_789)
    budget = decode_budget(limits.decode_budget)
    held_while_loading: list[int] = []
    original_load = ImageFile.ImageFile.load

    def load(self: ImageFile.ImageFile) -> Any:
        held_while_loading.append(budget.in_use)
        return original_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    prepare_image(raw, limits)
    assert held_while_loading and set(held_while_loading) == {decode_plan(raw, limits).cost}
    assert budget.in_use == 0


def test_jpeg_is_decoded_at_draft_scale() -> None:
    plan = decode_plan(make_jpeg(1, (4032, 3024)), LIMITS)
    assert plan.size == (4032, 3024) and plan.decoded_size == (1008, 756)
    assert plan.decoder_bytes == 1008 * 756 * 4


def test_progressive_jpeg_counts_the_coefficient_buffer() -> None:
    out = io.BytesIO()
    Image.new("RGB", (2000, 1500), (9, 99, 199)).save(out, "JPEG", progressive=True)  # 4:2:0
    plan = decode_plan(out.getvalue(), LIMITS)
    # Y at full size, Cb and Cr at half size each way, padded to 16x16 MCUs, 2 bytes a sample.
    coefficients = 2000 * 1504 * 2 + 2 * (1000 * 752 * 2)
    assert plan.decoder_bytes == plan.decoded_size[0] * plan.decoded_size[1] * 4 + coefficients


def test_a_baseline_jpeg_with_one_scan_per_component_is_multiscan() -> None:
    sof = b"\xff\xc0\x00\x11\x08\x00\x10\x00\x10\x03" + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    interleaved = b"\xff\xda\x00\x0c\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00"
    one_component = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"
    assert not jpeg_is_multiscan(b"\xff\xd8" + sof + interleaved)
    assert jpeg_is_multiscan(b"\xff\xd8" + sof + one_component)


def test_webp_counts_libwebps_buffers() -> None:
    raw = pillow_bytes("WEBP", "RGB", (1000, 500))
    assert decode_plan(raw, LIMITS).decoder_bytes == 1000 * 500 * 16
    with pytest.raises(ImageTooManyPixels):
        prepare_image(raw, dataclasses.replace(LIMITS, decode_budget_bytes=5 * 2**20))


def test_a_gif_frame_beyond_its_screen_is_checked_before_opening(monkeypatch: pytest.MonkeyPatch) -> None:
    # Screen 10x10; the first frame sits at x=30000, so Pillow's canvas would be 30001x10,
    # and Pillow allocates the frame's disposal buffer while opening.
    header = b"GIF89a" + struct.pack("<2H", 10, 10) + b"\x00\x00\x00"
    frame = b"," + struct.pack("<4H", 30000, 0, 1, 1) + b"\x00" + b"\x02\x02\x4c\x01\x00;"
    limits = dataclasses.replace(LIMITS, max_pixels=100_000)

    def no_opening(*args: object, **kwargs: object) -> None:
        raise AssertionError("opened despite the pixel limit")

    monkeypatch.setattr(Image, "open", no_opening)
    with pytest.raises(ImageTooManyPixels):
        prepare_image(header + frame, limits)
    monkeypatch.undo()
    # Pillow agrees about the canvas.
    assert decode_plan(header + frame, dataclasses.replace(limits, max_pixels=300_010)).size == (30001, 10)


@pytest.mark.parametrize(
    ("mode", "save_kwargs"),
    [
        ("RGBA", {}),
        ("LA", {}),
        ("P", {"transparency": 0}),
        ("RGB", {"transparency": (0, 0, 0)}),
        ("L", {"transparency": 0}),
    ],
)
def test_transparency_becomes_white_in_every_mode(mode: str, save_kwargs: dict[str, Any]) -> None:
    # Left half transparent (or the transparent colour), right half opaque grey.
    img = Image.new("RGBA", (3000, 1000), (0, 0, 0, 0))
    ImageDraw.Draw(img).rectangle((1500, 0, 2999, 999), fill=(128, 128, 128, 255))
    if mode == "P":
        source = img.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE)
        save_kwargs = {"transparency": source.getpixel((0, 0))}
    else:
        source = img.convert(mode)
    out = io.BytesIO()
    source.save(out, "PNG", **save_kwargs)
    prepared = decoded(prepare_image(out.getvalue(), LIMITS).data_url).convert("L")
    assert prepared.size == (768, 256)
    left, right = prepared.getpixel((100, 128)), prepared.getpixel((660, 128))
    assert isinstance(left, int) and isinstance(right, int)
    assert left >= 250  # was transparent: white
    assert abs(right - 128) <= 6  # opaque grey survives


@pytest.mark.parametrize("mode", ["1", "I;16", "CMYK"])
def test_other_modes_are_converted(mode: str) -> None:
    img = Image.new("L", (2400, 1200), 255).convert(mode)
    out = io.BytesIO()
    img.save(out, "JPEG" if mode == "CMYK" else "PNG")
    prepared = prepare_image(out.getvalue(), LIMITS)
    assert (prepared.width, prepared.height) == (768, 384)


# --- the budget itself ---------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool]) -> None:
    for _ in range(5000):
        if predicate():
            return
        time.sleep(0.001)
    raise AssertionError("condition not reached")


def test_the_budget_makes_a_decode_wait_until_it_fits() -> None:
    budget = DecodeBudget(10)
    entered: list[str] = []
    leave = threading.Event()

    def take() -> None:
        with budget.hold(6):
            entered.append("second")
            leave.wait(10)

    with budget.hold(6):
        second = threading.Thread(target=take)
        second.start()
        wait_until(lambda: budget.waiting == 1)
        assert entered == [] and budget.in_use == 6
    wait_until(lambda: entered == ["second"])
    assert budget.in_use == 6 and budget.waiting == 0
    leave.set()
    second.join(timeout=10)
    assert budget.in_use == 0


def test_the_budget_is_first_come_first_served() -> None:
    budget = DecodeBudget(10)
    order: list[str] = []

    def take(name: str, nbytes: int) -> None:
        with budget.hold(nbytes):
            order.append(name)

    first = budget.hold(6)
    first.__enter__()
    big = threading.Thread(target=take, args=("big", 6))
    big.start()
    wait_until(lambda: budget.waiting == 1)
    small = threading.Thread(target=take, args=("small", 2))  # would fit now, but is second in line
    small.start()
    wait_until(lambda: budget.waiting == 2)
    assert order == []
    first.__exit__(None, None, None)
    big.join(timeout=10)
    small.join(timeout=10)
    assert order == ["big", "small"] and budget.in_use == 0


def test_the_budget_refuses_what_can_never_fit() -> None:
    with pytest.raises(ValueError), DecodeBudget(10).hold(11):
        pass


def test_a_decode_waits_for_the_budget_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every wait is bounded: past DECODE_WAIT_TIMEOUT_S the request is refused (503)."""
    monkeypatch.setattr("app.images.budget.DECODE_WAIT_TIMEOUT_S", 0.05)
    budget = DecodeBudget(10)
    with budget.hold(6):
        with pytest.raises(CpuLaneSaturated), budget.hold(6):
            pass
        assert budget.waiting == 0 and budget.in_use == 6
    with budget.hold(10):  # the one that gave up left nothing behind
        assert budget.in_use == 10


async def test_a_small_body_whose_jpeg_goes_on_as_it_came_is_prepared_without_the_cpu_lane(
    service: Service,
) -> None:
    """Parsed on the loop (app/intake/acceptance.py, INLINE_MAX_BODY_BYTES): the CPU lane's job
    count does not move. A small body whose image needs work (a PNG, a JPEG past the long
    side) and a large body go to the lane, which prepares them as before."""

    def lane_jobs() -> float:
        return service.metric("ecoscan_cpu_job_seconds_count", {"phase": "run"})

    def done(outcome: Any) -> bool:
        return bool(outcome.status == 200 and outcome.events and outcome.events[-1].event == "done")

    small = make_jpeg(71, (320, 240))
    assert len(data_url(small)) < 64 * 1024
    before = lane_jobs()
    prepared = {"stage": "prepare"}
    prepares = service.metric("ecoscan_stage_service_seconds_count", prepared)
    outcome = await run_scan(service.client, json={"image_url": data_url(small)})
    assert done(outcome) and lane_jobs() == before
    assert service.metric("ecoscan_stage_service_seconds_count", prepared) == prepares + 1  # still observed
    png = io.BytesIO()
    Image.open(io.BytesIO(small)).save(png, "PNG")
    tall = make_jpeg(72, (2000, 1500), quality=20)  # small, but past the long side
    noise = io.BytesIO()
    Image.effect_noise((700, 500), 40).convert("RGB").save(noise, "JPEG", quality=80)
    large = noise.getvalue()  # goes on as it came, but a big body (~170 KB)
    progressive = io.BytesIO()  # as it came, but one pass per scan to decode
    Image.open(io.BytesIO(small)).save(progressive, "JPEG", quality=85, progressive=True)
    as_is = prepare_image(progressive.getvalue(), LIMITS)
    assert as_is.prepared_sha256 == as_is.sha256
    lane_bodies = [(png.getvalue(), "png"), (tall, "jpeg"), (large, "jpeg"), (progressive.getvalue(), "jpeg")]
    for raw, mime in lane_bodies:
        before = lane_jobs()
        outcome = await run_scan(service.client, json={"image_url": data_url(raw, f"image/{mime}")})
        assert done(outcome) and lane_jobs() == before + 1, mime
    invalid = data_url(small[: len(small) // 2])  # truncated: refused inline as in the lane
    assert (await run_scan(service.client, json={"image_url": invalid})).status == 400


def _many_scans(extra_scans: int, side: int = 768) -> bytes:
    """A valid progressive grey JPEG with `extra_scans` more AC refinement scans (a dozen
    bytes each, every one a pass over all coefficients): decodes slowly, from few bytes."""
    buf = io.BytesIO()
    Image.new("L", (side, side), 128).save(buf, "JPEG", progressive=True, quality=90)
    body = buf.getvalue()[:-2]  # without EOI
    # AC table 1: one 1-bit code for symbol 0xD0 (an end-of-band run of 2**13 + 13 bits)
    dht = b"\xff\xc4\x00\x14\x11" + bytes([1] + [0] * 15) + b"\xd0"
    blocks = (side // 8) ** 2
    bits = "0" + format(blocks - (1 << 13), "013b")
    bits += "1" * (-len(bits) % 8)
    run = int(bits, 2).to_bytes(len(bits) // 8, "big")
    sos = b"\xff\xda\x00\x08\x01\x01\x01\x01\x3f\x10"  # component 1, Ss=1 Se=63 Ah=1 Al=0
    return body + dht + (sos + run) * extra_scans + b"\xff\xd9"


def test_a_jpeg_of_many_scans_is_refused_before_decoding_and_never_prepared_inline() -> None:
    few = _many_scans(20)  # decodes (a valid file), in the lane: progressive
    assert prepare_image(few, LIMITS).width == 768
    with pytest.raises(NotInline):
        prepare_image(few, LIMITS, inline=True)
    many = _many_scans(MAX_JPEG_SCANS)
    assert len(many) < 64 * 1024
    for inline in (False, True):
        with pytest.raises((ImageInvalid, NotInline)) as refused:
            prepare_image(many, LIMITS, inline=inline)
        assert refused.type is (NotInline if inline else ImageInvalid)


def _whole_decode_verdict(raw: bytes) -> str:
    """What decoding the whole image at 1/8 scale says (the inline check before it read
    only the head of the scan)."""
    try:
        with Image.open(io.BytesIO(raw), formats=["JPEG"]) as img:
            img.draft(img.mode, (max(1, img.size[0] // 8), max(1, img.size[1] // 8)))
            img.load()
    except (OSError, SyntaxError, ValueError, EOFError):
        return "invalid"
    return "ok"


def _verdict(raw: bytes, *, inline: bool) -> str:
    try:
        prepare_image(raw, LIMITS, inline=inline)
    except ImageInvalid:
        return "invalid"
    except NotInline:
        return "lane"
    return "ok"


def _inline_verdict(raw: bytes) -> str:
    return _verdict(raw, inline=True)


def _segments(raw: bytes) -> list[tuple[int, int, int]]:
    """(marker, start, end) of each segment after APP0, up to and including the SOS header."""
    found, pos = [], 20
    while True:
        marker, end = raw[pos + 1], pos + 2 + int.from_bytes(raw[pos + 2 : pos + 4], "big")
        found.append((marker, pos, end))
        if marker == 0xDA:
            return found
        pos = end


def test_the_check_of_the_scans_head_refuses_what_a_whole_decode_refuses() -> None:
    """A single-scan JPEG sent as it came is checked by decoding only its headers and the
    head of its scan, inline and in the lane: corrupt any byte of the tables, the frame or
    the scan header, or garble the scan itself, and both say what decoding every
    coefficient says, for every corrupted file (fixed seed)."""
    raw = make_jpeg(9, (320, 240))
    assert jfif_walk(raw).scans == 1 and _inline_verdict(raw) == "ok"
    segments = _segments(raw)
    scan_start = segments[-1][2]
    rng = random.Random(14)
    verdicts: dict[str, int] = {}
    for trial in range(1500):
        bad = bytearray(raw)
        if trial % 5:  # a byte of a table, the frame or the scan header (not its marker or length)
            _marker, start, end = rng.choice(segments)
            bad[rng.randrange(start + 4, end)] = rng.randrange(256)
        else:  # the scan: a few bytes garbled, or cut short before its EOI
            for _ in range(4):
                bad[rng.randrange(scan_start, len(bad) - 2)] = rng.randrange(0xFF)
            if trial % 2:
                bad = bad[: rng.randrange(scan_start, len(bad) - 2)] + b"\xff\xd9"
        inline = _inline_verdict(bytes(bad))
        if inline == "lane":  # no longer a bare single-scan JPEG sent as it came
            continue
        assert inline == _whole_decode_verdict(bytes(bad)) == _verdict(bytes(bad), inline=False), trial
        verdicts[inline] = verdicts.get(inline, 0) + 1
    assert verdicts["invalid"] > 200 and verdicts["ok"] > 200, verdicts


def test_a_jpeg_with_a_segment_after_its_scan_is_checked_whole_in_the_lane() -> None:
    """libjpeg reads a table after the last scan at the end of a decode, beyond the head the
    inline check decodes: such a file is left to the lane, which refuses a bad one."""
    raw = make_jpeg(9, (320, 240))
    good_table = raw[:-2] + b"\xff\xdb\x00\x43\x01" + bytes(range(1, 65)) + b"\xff\xd9"  # DQT 1
    bad_table = raw[:-2] + b"\xff\xdb\x00\x43\x07" + bytes(64) + b"\xff\xd9"  # DQT id 7: no such table
    for trailing in (good_table, bad_table):
        assert jfif_walk(trailing).scans > 0
        with pytest.raises(NotInline):
            prepare_image(trailing, LIMITS, inline=True)
    assert prepare_image(good_table, LIMITS).width == 320
    with pytest.raises(ImageInvalid):
        prepare_image(bad_table, LIMITS)


def test_an_inline_jpeg_over_the_decode_budget_is_left_to_the_lane() -> None:
    """With a decode budget smaller than what even a check would hold, the lane refuses the
    image (413) whatever the body's size: the inline path does not take it."""
    tight = dataclasses.replace(LIMITS, decode_budget_bytes=64 * 1024)
    raw = make_jpeg(9, (320, 240))
    with pytest.raises(NotInline):
        prepare_image(raw, tight, inline=True)
    with pytest.raises(ImageTooManyPixels):
        prepare_image(raw, tight)
    assert prepare_image(raw, LIMITS, inline=True).width == 320


def _dc_climbing_jpeg(frame: int, side: int) -> bytes:
    """A grey JPEG whose one scan adds +32767 to the DC value in every block: libjpeg's
    progressive decoder refuses it once the sum overflows (~65,538 blocks in), far past the
    head of the scan; its sequential decoder does not check."""

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body

    size = side.to_bytes(2, "big")
    dc_table = segment(0xC4, b"\x00" + bytes([1, 1] + [0] * 14) + bytes([15, 0]))  # '0': 15 bits
    ac_table = segment(0xC4, b"\x10" + bytes([1] + [0] * 15) + b"\x00")  # '0': end of block
    progressive = frame == 0xC2
    sos = segment(0xDA, b"\x01\x01\x00" + (b"\x00\x00\x00" if progressive else b"\x00\x3f\x00"))
    per_block = "0" + "1" * 15 + ("" if progressive else "0")  # DC +32767, then the AC's EOB
    bits = per_block * (side // 8) ** 2
    bits += "1" * (-len(bits) % 8)
    scan = int(bits, 2).to_bytes(len(bits) // 8, "big").replace(b"\xff", b"\xff\x00")
    head = bytes.fromhex("ffd8ffe000104a46494600010100000100010000") + segment(0xDB, b"\x00" + b"\x01" * 64)
    frame_header = segment(frame, b"\x08" + size + size + b"\x01\x01\x11\x00")
    return head + frame_header + dc_table + ac_table + sos + scan + b"\xff\xd9"


def test_a_progressive_jpeg_is_checked_whole_even_with_one_scan() -> None:
    """The progressive decoder has a fatal error inside a scan (a DC value that overflows):
    a progressive JPEG sent as it came decodes whole, whatever its scans."""
    large = dataclasses.replace(LIMITS, long_side=2056)  # 257 x 257 blocks: past 65,538
    refused = _dc_climbing_jpeg(0xC2, 2056)
    walked = jfif_walk(refused)
    assert walked.scans == 1 and scan_head(refused, walked) is None
    with pytest.raises(ImageInvalid):
        prepare_image(refused, large)
    sequential = _dc_climbing_jpeg(0xC0, 2056)  # the same blocks, sequential: checked from its head
    assert scan_head(sequential, jfif_walk(sequential)) is not None
    assert prepare_image(sequential, large).width == 2056
