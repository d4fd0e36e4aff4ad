"""What image preparation is allowed to take: one value object, read by every step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    long_side: int
    jpeg_quality: int
    # Decode memory in flight across all threads; None: 8 bytes x max_pixels.
    decode_budget_bytes: int | None = None

    @property
    def decode_budget(self) -> int:
        if self.decode_budget_bytes is not None:
            return self.decode_budget_bytes
        return 8 * self.max_pixels
