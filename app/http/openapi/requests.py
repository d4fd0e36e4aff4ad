"""The scan's request bodies, with this deployment's limits (`USER_INPUT_MAX_CHARS`,
`IMAGE_MAX_BYTES`...)."""

from __future__ import annotations

from typing import Any

from app.intake.image_url import MAX_IMAGE_URL_CHARS
from app.settings import Settings

IMAGE_TYPES = "image/jpeg, image/png, image/webp, image/gif"
# A 1x1 PNG: the smallest image a scan accepts.
EXAMPLE_DATA_URL = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR42mPQWBAFAAIWASMT0+0EAAAAAElFTkSuQmCC"
)


def scan_request_schema(settings: Settings) -> dict[str, Any]:
    return {
        "title": "ScanRequest",
        "description": "A scan of an image given by URL: an `https://` URL the model fetches, or a data URL.",
        "type": "object",
        "required": ["image_url"],
        "properties": {
            "image_url": {
                "type": "string",
                "minLength": 1,
                "pattern": "^(https://|data:)",
                "description": (
                    "An `https://` URL (at most "
                    f"{MAX_IMAGE_URL_CHARS} characters, a public host name: no user name or password, "
                    "no private, loopback, link-local or reserved IP address, no `localhost`, "
                    "`*.local`, `*.internal` or single-label host), or a base64 data URL "
                    f"(`data:image/jpeg;base64,...`; {IMAGE_TYPES}; the image at most "
                    f"{settings.image_max_bytes} bytes and {settings.image_max_pixels} pixels)."
                ),
                "examples": ["https://example.com/bottle.jpg", EXAMPLE_DATA_URL],
            },
            "user_input": _user_input_schema(settings),
        },
    }


def scan_upload_schema(settings: Settings) -> dict[str, Any]:
    return {
        "title": "ScanUpload",
        "description": "A scan of an uploaded image.",
        "type": "object",
        "required": ["image"],
        "properties": {
            "image": {
                "type": "string",
                "format": "binary",
                "description": (
                    f"The photo: {IMAGE_TYPES} (recognised from its bytes), at most "
                    f"{settings.image_max_bytes} bytes and {settings.image_max_pixels} pixels."
                ),
            },
            "user_input": _user_input_schema(settings),
        },
    }


def _user_input_schema(settings: Settings) -> dict[str, Any]:
    return {
        "type": "string",
        "maxLength": settings.user_input_max_chars,
        "description": (
            "The user's question or remarks about the item, at most "
            f"{settings.user_input_max_chars} characters (USER_INPUT_MAX_CHARS) after trimming."
        ),
    }
