"""Render the 27 food photos of the Cube Rule page (/cube) into app/static/cube/.

Each image is one food emoji from Noto Color Emoji (Debian's fonts-noto-color-emoji, SIL Open Font
License 1.1) drawn on a plate over a table, 512x512 JPEG. Everything is made here, from the font
and a few drawing primitives, so the images carry no third-party photo rights. The backgrounds are
varied but deterministic: the same font gives the same bytes on every run.

    apt-get install fonts-noto-color-emoji
    .venv/bin/python scripts/make_cube_images.py            # images + foods.json
    .venv/bin/python scripts/make_cube_images.py --check    # only report sizes

foods.json (the page's list, in display and processing order) is written from FOODS below; the
replay of a recorded run lives next to it in replay.json (scripts/record_cube_replay.py).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "app" / "static" / "cube"
FONT = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
FONT_SIZE = 109  # the one bitmap strike of the CBDT font (136x128 glyphs)
SIZE = 512
QUALITY = 80
MAX_BYTES = 40 * 1024

CATEGORIES = ("toast", "sandwich", "taco", "sushi", "quiche", "calzone", "salad", "soup")

# name, emoji, the Cube Rule category a person would expect, a note on why. Display order: the
# categories are mixed so a run fills the rows unevenly, as a real one would.
FOODS: list[tuple[str, str, str, str]] = [
    ("Hot dog", "\U0001F32D", "taco", "the bun holds the sausage on the bottom and two sides"),
    ("Pizza", "\U0001F355", "toast", "crust on the bottom, toppings open on top"),
    ("Sandwich", "\U0001F96A", "sandwich", "bread on the top and the bottom"),
    ("Sushi", "\U0001F363", "sushi", "rice and nori around the filling, ends open"),
    ("Salad", "\U0001F957", "salad", "no structural starch"),
    ("Ramen", "\U0001F35C", "soup", "noodles in broth, served in a bowl"),
    ("Dumpling", "\U0001F95F", "calzone", "dough sealed around the filling"),
    ("Pie", "\U0001F967", "quiche", "crust on the bottom and sides, filling open on top"),
    ("Taco", "\U0001F32E", "taco", "the tortilla folds up on two sides"),
    ("Hamburger", "\U0001F354", "sandwich", "bun on the top and the bottom"),
    ("Burrito", "\U0001F32F", "sushi", "tortilla rolled around the filling, ends open"),
    ("Toast", "\U0001F35E", "toast", "one slice, whatever goes on it sits on top"),
    ("Steak", "\U0001F969", "salad", "meat with no starch around it"),
    ("Stew", "\U0001F372", "soup", "a liquid dish in a pot or bowl"),
    ("Mooncake", "\U0001F96E", "calzone", "pastry fully around a sweet filling"),
    ("Ice cream cone", "\U0001F366", "quiche", "the cone is a starch cup with an open top"),
    ("Flatbread", "\U0001FAD3", "toast", "a flat starch base for toppings"),
    ("Stuffed pita", "\U0001F959", "taco", "flatbread folded around the filling, open top"),
    ("Tamale", "\U0001FAD4", "sushi", "masa wrapped around the filling in a husk"),
    ("Fried egg", "\U0001F373", "salad", "egg in a pan, no starch"),
    ("Green tea", "\U0001F375", "soup", "a drink in a cup"),
    ("Rice ball", "\U0001F359", "calzone", "rice closed all around a filling"),
    ("Pancakes", "\U0001F95E", "toast", "butter and syrup on top of the stack"),
    ("Ice cream bowl", "\U0001F368", "salad", "ice cream out of a cone, in a dish"),
    ("Spaghetti", "\U0001F35D", "salad", "pasta as an ingredient, not a structure"),
    ("Fondue", "\U0001FAD5", "soup", "melted cheese in a pot"),
    ("Coffee", "\u2615", "soup", "a hot drink in a cup"),
]

# Table surfaces: (name, base RGB, grain RGB, kind).
TABLES = [
    ("oak", (196, 150, 98), (170, 122, 74), "wood"),
    ("walnut", (112, 76, 52), (90, 58, 38), "wood"),
    ("pine", (222, 190, 140), (200, 164, 112), "wood"),
    ("slate", (74, 84, 96), (62, 70, 82), "stone"),
    ("linen", (232, 224, 208), (214, 204, 186), "cloth"),
    ("teal", (46, 110, 114), (38, 94, 98), "cloth"),
    ("gingham", (236, 236, 232), (196, 64, 58), "check"),
    ("blue check", (236, 238, 242), (70, 110, 180), "check"),
    ("terracotta", (186, 98, 70), (166, 84, 58), "stone"),
]

# Plates: (face RGB, rim RGB, rim width).
PLATES = [
    ((250, 250, 247), (226, 224, 218), 22),
    ((246, 240, 226), (214, 200, 172), 20),
    ((240, 245, 250), (120, 150, 196), 10),
    ((252, 252, 252), (40, 44, 52), 6),
    ((236, 230, 216), (168, 150, 120), 26),
    ((244, 248, 242), (130, 170, 132), 12),
]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def rng_for(name: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big"))


def table(rng: random.Random, index: int) -> Image.Image:
    _, base, grain, kind = TABLES[index % len(TABLES)]
    img = Image.new("RGB", (SIZE, SIZE), base)
    draw = ImageDraw.Draw(img)
    if kind == "wood":
        y = 0
        while y < SIZE:
            height = rng.randint(28, 64)
            shade = rng.uniform(-10, 10)
            color = tuple(max(0, min(255, int(c + shade))) for c in base)
            draw.rectangle([0, y, SIZE, y + height], fill=color)
            for _ in range(rng.randint(2, 4)):  # grain lines, blurred below
                gy = y + rng.randint(2, max(3, height - 2))
                wave = rng.uniform(2, 6)
                phase = rng.uniform(0, math.tau)
                points = [(x, gy + wave * math.sin(x / 70 + phase)) for x in range(0, SIZE + 16, 16)]
                draw.line(points, fill=grain, width=2)
            draw.line([(0, y), (SIZE, y)], fill=tuple(int(c * 0.78) for c in base), width=2)
            y += height
        img = img.filter(ImageFilter.GaussianBlur(1.6))
    elif kind == "check":
        step = rng.choice([48, 56, 64])
        over = Image.new("RGBA", (SIZE, SIZE), (0, 0, 0, 0))
        od = ImageDraw.Draw(over)
        for i in range(0, SIZE, step * 2):
            od.rectangle([i, 0, i + step - 1, SIZE], fill=(*grain, 90))
            od.rectangle([0, i, SIZE, i + step - 1], fill=(*grain, 90))
        img = Image.alpha_composite(img.convert("RGBA"), over).convert("RGB").filter(ImageFilter.GaussianBlur(1.2))
    elif kind == "cloth":
        for x in range(0, SIZE, 6):
            draw.line([(x, 0), (x, SIZE)], fill=grain if rng.random() < 0.35 else base, width=1)
        img = img.filter(ImageFilter.GaussianBlur(2.2))
    else:  # stone: broad soft blotches
        for _ in range(14):
            r = rng.randint(60, 160)
            cx, cy = rng.randint(0, SIZE), rng.randint(0, SIZE)
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=grain if rng.random() < 0.5 else base)
        img = img.filter(ImageFilter.GaussianBlur(28))
    # light from the top left
    ramp = np.linspace(0.0, 1.0, SIZE, dtype=np.float32)
    shade = (ramp[None, :] * 0.45 + ramp[:, None] * 0.55) * 56  # darker toward the bottom right
    dark = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
    return Image.composite(dark, img, Image.fromarray(shade.astype(np.uint8), "L"))


def plate(img: Image.Image, rng: random.Random, index: int, small: bool) -> tuple[int, int]:
    face, rim, rim_width = PLATES[index % len(PLATES)]
    radius = rng.randint(150, 165) if small else rng.randint(200, 226)
    cx = SIZE // 2 + rng.randint(-14, 14)
    cy = SIZE // 2 + rng.randint(-10, 18)
    shadow = Image.new("L", (SIZE, SIZE), 0)
    ImageDraw.Draw(shadow).ellipse([cx - radius + 10, cy - radius + 18, cx + radius + 10, cy + radius + 18], fill=120)
    shadow = shadow.filter(ImageFilter.GaussianBlur(16))
    img.paste(Image.new("RGB", (SIZE, SIZE), (20, 16, 12)), (0, 0), shadow)
    draw = ImageDraw.Draw(img)
    draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=rim)
    inner = radius - rim_width
    draw.ellipse([cx - inner, cy - inner, cx + inner, cy + inner], fill=face)
    well = int(inner * 0.72)  # the plate's well, a shade darker
    well_color = tuple(int(c * 0.965) for c in face)
    draw.ellipse([cx - well, cy - well, cx + well, cy + well], fill=well_color)
    return cx, cy


def emoji(char: str, font: ImageFont.FreeTypeFont) -> Image.Image:
    canvas = Image.new("RGBA", (160, 160), (0, 0, 0, 0))
    ImageDraw.Draw(canvas).text((8, 8), char, font=font, embedded_color=True)
    box = canvas.getbbox()
    if box is None:
        raise SystemExit(f"the font has no glyph for {char!r} (U+{ord(char):04X})")
    return canvas.crop(box)


def render(index: int, name: str, char: str, font: ImageFont.FreeTypeFont) -> bytes:
    rng = rng_for(name)
    img = table(rng, rng.randrange(len(TABLES)))
    small = char in ("\U0001F375", "\u2615")  # a cup sits on a saucer
    cx, cy = plate(img, rng, rng.randrange(len(PLATES)), small)
    glyph = emoji(char, font)
    target = rng.randint(250, 290) if not small else 220
    scale = target / max(glyph.size)
    glyph = glyph.resize((round(glyph.width * scale), round(glyph.height * scale)), Image.LANCZOS)
    glyph = glyph.rotate(rng.uniform(-9, 9), resample=Image.BICUBIC, expand=True)
    x = cx - glyph.width // 2
    y = cy - glyph.height // 2
    # a soft contact shadow under the food
    alpha = glyph.getchannel("A").point(lambda v: 110 if v > 40 else 0)
    shadow = Image.new("L", (SIZE, SIZE), 0)
    shadow.paste(alpha, (x + 8, y + 12))
    shadow = shadow.filter(ImageFilter.GaussianBlur(10))
    img.paste(Image.new("RGB", (SIZE, SIZE), (30, 24, 18)), (0, 0), shadow)
    img.paste(glyph, (x, y), glyph)
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", quality=QUALITY, optimize=True, progressive=True)
    return buffer.getvalue()


def foods_json() -> list[dict]:
    return [{"name": name, "file": f"{slug(name)}.jpg", "category": category, "note": note}
            for name, _, category, note in FOODS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="report the sizes of existing images only")
    args = parser.parse_args(argv)
    assert len(FOODS) == 27 and {c for _, _, c, _ in FOODS} == set(CATEGORIES)
    if args.check:
        for entry in foods_json():
            path = args.out / entry["file"]
            print(f"{entry['file']:24} {path.stat().st_size:6d} B")
        return 0
    if not FONT.exists():
        print(f"missing {FONT}: apt-get install fonts-noto-color-emoji", file=sys.stderr)
        return 2
    font = ImageFont.truetype(str(FONT), FONT_SIZE)
    args.out.mkdir(parents=True, exist_ok=True)
    for index, (name, char, _, _) in enumerate(FOODS):
        data = render(index, name, char, font)
        (args.out / f"{slug(name)}.jpg").write_bytes(data)
        flag = "" if len(data) <= MAX_BYTES else "  (over the 40 KB aim)"
        print(f"{slug(name)}.jpg {len(data)} B{flag}")
    (args.out / "foods.json").write_text(json.dumps(foods_json(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(FOODS)} images and foods.json to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
