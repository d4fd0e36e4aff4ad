"""CPU cost of preparing one upload (the CPU lane's job), against the naive way.

    .venv/bin/python k6/prepare_bench.py   # generates the big and small images first if missing

Reports the median process CPU time of 15 runs for: a naive full decode + resize
(Pillow's default bicubic) + re-encode; the published improvement, draft-mode decode at
1/2 scale; and ecoscan's `prepare_image` (draft at the smallest scale that still covers
768 px, EXIF orientation, bilinear finish, JPEG re-encode, sha256, base64 data URL).
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageOps

import make_images

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.images.limits import ImageLimits  # noqa: E402
from app.images.prepare import prepare_image  # noqa: E402

LIMITS = ImageLimits(max_bytes=10_000_000, max_pixels=40_000_000, long_side=768, jpeg_quality=85)


def encode(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, "JPEG", quality=85)
    return out.getvalue()


def naive(data: bytes) -> bytes:
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    img.thumbnail((768, 768), Image.Resampling.BICUBIC, reducing_gap=None)
    return encode(img)


def draft_half(data: bytes) -> bytes:
    source = Image.open(io.BytesIO(data))
    source.draft("RGB", (source.width // 2, source.height // 2))
    img = ImageOps.exif_transpose(source)
    img.thumbnail((768, 768), Image.Resampling.BICUBIC, reducing_gap=None)
    return encode(img)


def cpu_ms(fn: Callable[[bytes], object], data: bytes, runs: int = 15) -> float:
    fn(data)
    samples = []
    for _ in range(runs):
        started = time.process_time()
        fn(data)
        samples.append((time.process_time() - started) * 1000)
    return statistics.median(samples)


def main() -> None:
    make_images.generate(sets=["big", "small"])
    for name in ("big-1.jpg", "small-1.jpg"):
        data = (make_images.DEFAULT_OUT / name).read_bytes()
        size = Image.open(io.BytesIO(data)).size
        base = cpu_ms(naive, data)
        print(f"{name} {size[0]}x{size[1]} {len(data) / 1e6:.1f} MB")
        for label, fn in (
            ("naive decode+resize", naive),
            ("draft 1/2", draft_half),
            ("ecoscan prepare_image", lambda d: prepare_image(d, LIMITS)),
        ):
            ms = base if fn is naive else cpu_ms(fn, data)
            print(f"  {label:24s} {ms:7.1f} ms CPU  ({ms / base:4.0%} of naive)")


if __name__ == "__main__":
    main()
