#!/usr/bin/env python3
"""output: content: stdout is one JSON object with text and images; logs go to stderr."""

import base64
import json
import struct
import sys
import zlib


def png(rgb: tuple[int, int, int], size: int = 16) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * size
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(row * size))
        + chunk(b"IEND", b"")
    )


args = json.load(sys.stdin)
color = args["color"]
rgb = tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))
print(f"rendering {color}", file=sys.stderr)
json.dump(
    {
        "text": f"Swatch {color.lower()} = rgb{rgb}",
        "images": [{"mimeType": "image/png", "base64": base64.b64encode(png(rgb)).decode()}],
    },
    sys.stdout,
)
