"""Generate the load-test photos into ``k6/images/`` (gitignored).

    .venv/bin/python k6/make_images.py               # 4 big (4032x3024), 4 small (1280x960), 4 tiny (320x240)
    .venv/bin/python k6/make_images.py --sets small  # only the sets named
    .venv/bin/python k6/make_images.py --force       # regenerate even if the files exist

The sweep and the bench drivers call ``generate`` themselves before running k6, so
running this by hand is only needed for plain ``k6 run``s with ``IMAGE_SET`` big or
small: until ``k6/images/`` exists, the scripts send the committed samples in
``k6/sample-images/`` (the tiny set, written by ``--sets tiny --out k6/sample-images``).

The images are photo-like on purpose: a smooth background (gradients), blurred
"objects" (shapes), fine per-pixel sensor noise and blotchy low-frequency noise, saved
as quality-92 JPEG. That keeps them from compressing to nothing, so a big one weighs a
few megabytes like a phone photo and costs the service a realistic decode. Everything
is derived from a fixed seed per file (Pillow + ``random.Random``), so every run and
every machine produces the same bytes, and existing files are skipped.

Also writes ``manifest.json`` beside them: ``{"big": [{"file", "width", "height",
"bytes"}, ...], "small": [...], "tiny": [...]}``, which the k6 scripts read in their
init context.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "images"
QUALITY = 92
MAX_BYTES = 9 * 1024 * 1024  # the service's default IMAGE_MAX_BYTES is 10 MiB
GROUPS = ("big", "small", "tiny")
Manifest = dict[str, list[dict[str, object]]]


@dataclass(frozen=True)
class Variant:
    name: str
    group: str  # "big", "small" or "tiny"
    width: int
    height: int
    seed: int


VARIANTS = tuple(
    [Variant(f"big-{i}.jpg", "big", 4032, 3024, 1000 + i) for i in range(1, 5)]
    + [Variant(f"small-{i}.jpg", "small", 1280, 960, 2000 + i) for i in range(1, 5)]
    # Thumbnails: for runs about the streaming pipeline, where image decoding should not
    # be what saturates the CPU.
    + [Variant(f"tiny-{i}.jpg", "tiny", 320, 240, 3000 + i) for i in range(1, 5)]
)


def random_color(rng: random.Random, low: int = 0, high: int = 255) -> tuple[int, int, int]:
    return (rng.randint(low, high), rng.randint(low, high), rng.randint(low, high))


def background(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    """Two colours blended along a linear gradient, lit by a radial vignette."""
    top, bottom = random_color(rng, 40, 220), random_color(rng, 20, 200)
    mask = Image.linear_gradient("L").rotate(rng.uniform(-40, 40), resample=Image.Resampling.BICUBIC)
    mask = mask.resize(size, Image.Resampling.BICUBIC)
    base = Image.composite(Image.new("RGB", size, top), Image.new("RGB", size, bottom), mask)
    vignette = Image.radial_gradient("L").resize(size, Image.Resampling.BICUBIC)
    return Image.composite(Image.new("RGB", size, (10, 10, 10)), base, vignette.point(lambda v: v // 3))


def draw_objects(rng: random.Random, image: Image.Image) -> Image.Image:
    """Blurred ellipses, rectangles and polygons: the 'things' in the photo."""
    w, h = image.size
    layer = image.copy()
    draw = ImageDraw.Draw(layer)
    for _ in range(rng.randint(8, 14)):
        x, y = rng.uniform(-0.1, 1.0) * w, rng.uniform(-0.1, 1.0) * h
        sw, sh = rng.uniform(0.05, 0.45) * w, rng.uniform(0.05, 0.45) * h
        fill = random_color(rng)
        kind = rng.choice(("ellipse", "rect", "poly"))
        if kind == "ellipse":
            draw.ellipse((x, y, x + sw, y + sh), fill=fill)
        elif kind == "rect":
            draw.rounded_rectangle((x, y, x + sw, y + sh), radius=int(min(sw, sh) / 6), fill=fill)
        else:
            points = [(x + rng.uniform(0, sw), y + rng.uniform(0, sh)) for _ in range(rng.randint(3, 7))]
            draw.polygon(points, fill=fill)
        if rng.random() < 0.5:  # a label-like stripe with "text" ticks
            stripe_y = y + sh * rng.uniform(0.3, 0.7)
            draw.rectangle((x, stripe_y, x + sw, stripe_y + sh * 0.1), fill=random_color(rng, 200, 255))
            for tick in range(int(sw // max(8, w // 200))):
                tx = x + tick * max(8, w // 200)
                draw.line((tx, stripe_y + 2, tx, stripe_y + sh * 0.08), fill=(20, 20, 20), width=2)
    return layer.filter(ImageFilter.GaussianBlur(radius=max(1, w // 1500)))


def noise(rng: random.Random, size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    return Image.frombytes(mode, size, rng.randbytes(size[0] * size[1] * channels))


def photo(variant: Variant) -> Image.Image:
    rng = random.Random(variant.seed)
    size = (variant.width, variant.height)
    image = draw_objects(rng, background(rng, size))
    # Low-frequency blotches (lighting, texture), then per-pixel sensor noise.
    blotches = noise(rng, (max(2, variant.width // 64), max(2, variant.height // 64)))
    image = Image.blend(image, blotches.resize(size, Image.Resampling.BICUBIC), 0.18)
    grain = noise(rng, size).filter(ImageFilter.GaussianBlur(radius=0.5))
    return Image.blend(image, grain, 0.16)


def save(image: Image.Image, path: Path) -> None:
    """Write through a temporary file: an interrupted run never leaves a truncated image
    that later runs would skip as present."""
    tmp = path.with_name(path.name + ".tmp")
    image.save(tmp, "JPEG", quality=QUALITY, subsampling=2, optimize=False)
    tmp.replace(path)
    size = path.stat().st_size
    print(f"wrote {path.name} {image.width}x{image.height} {size / 2**20:.2f} MiB")
    if size > MAX_BYTES:
        print(f"warning: {path.name} is {size / 2**20:.1f} MiB, above {MAX_BYTES / 2**20:.0f} MiB")


def manifest_of(out: Path) -> Manifest:
    """Every known image present in `out`, by set (a set not generated is empty)."""
    manifest: Manifest = {group: [] for group in GROUPS}
    for variant in VARIANTS:
        path = out / variant.name
        if path.exists():
            entry = {"file": variant.name, "width": variant.width, "height": variant.height}
            manifest[variant.group].append({**entry, "bytes": path.stat().st_size})
    return manifest


def generate(out: Path = DEFAULT_OUT, *, sets: Iterable[str] = GROUPS, force: bool = False) -> Manifest:
    """Write the missing images of `sets` and the manifest of what `out` holds. Cheap when
    nothing is missing, so the sweep and bench drivers call it before every run."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(sets)
    for variant in VARIANTS:
        path = out / variant.name
        if variant.group in wanted and (force or not path.exists()):
            save(photo(variant), path)
    manifest = manifest_of(out)
    text = json.dumps(manifest, indent=2) + "\n"
    manifest_path = out / "manifest.json"
    if not manifest_path.exists() or manifest_path.read_text() != text:
        manifest_path.write_text(text)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default k6/images)")
    parser.add_argument(
        "--sets",
        type=lambda text: text.split(","),
        default=list(GROUPS),
        help="comma-separated (default all)",
    )
    parser.add_argument("--force", action="store_true", help="regenerate files that already exist")
    args = parser.parse_args(argv)
    unknown = set(args.sets) - set(GROUPS)
    if unknown:
        parser.error(f"unknown set(s) {', '.join(sorted(unknown))}; known: {', '.join(GROUPS)}")
    manifest = generate(args.out, sets=args.sets, force=args.force)
    counts = ", ".join(f"{group} {len(entries)}" for group, entries in manifest.items())
    print(f"{args.out / 'manifest.json'}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
