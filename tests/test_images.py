"""Image preparation (the CPU lane's main job) on real JPEG/PNG bytes."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from app.errors import ImageInvalid, ImageTooLarge, ImageTooManyPixels, ImageTypeUnsupported
from app.images import ImageLimits, decode_data_url, prepare_image, sniff_mime

from .conftest import data_url, make_jpeg

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
