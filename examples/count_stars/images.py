"""Count-the-stars images: PNGs of ``count`` five-pointed stars, drawn here, seeded.

The same (count, seed) gives the same bytes on every machine (Pillow's PNG writer with
fixed settings), so an image's digest names it across runs.
"""

from __future__ import annotations

import io
import math
import random

from PIL import Image, ImageDraw

SIZE = 64
RADIUS = 6  # outer radius of a star, in pixels
BACKGROUND = (16, 24, 48)
STAR = (255, 214, 64)


def star_points(cx: float, cy: float, r: float, turn: float) -> list[tuple[float, float]]:
    """The ten corners of a five-pointed star, outer and inner in turn."""
    out = []
    for k in range(10):
        radius = r if k % 2 == 0 else r * 0.45
        angle = turn + k * math.pi / 5
        out.append((cx + radius * math.sin(angle), cy - radius * math.cos(angle)))
    return out


def star_centres(count: int, rng: random.Random, size: int = SIZE) -> list[tuple[int, int]]:
    """``count`` centres whose stars neither overlap nor leave the image."""
    centres: list[tuple[int, int]] = []
    while len(centres) < count:
        c = (rng.randint(RADIUS + 1, size - RADIUS - 2), rng.randint(RADIUS + 1, size - RADIUS - 2))
        if all((c[0] - x) ** 2 + (c[1] - y) ** 2 > (2 * RADIUS + 2) ** 2 for x, y in centres):
            centres.append(c)
    return centres


def star_image(count: int, seed: int, size: int = SIZE) -> bytes:
    """A PNG of ``count`` stars (0-9) at seeded places and angles."""
    if not 0 <= count <= 9:
        raise ValueError(f"count must be 0-9 (room for them in {size}px), not {count}")
    rng = random.Random(f"stars:{count}:{seed}")
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for cx, cy in star_centres(count, rng, size):
        draw.polygon(star_points(cx, cy, RADIUS, rng.uniform(0, math.pi)), fill=STAR)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=False, compress_level=6)
    return out.getvalue()
