"""Draw the walk page's home-screen icons into app/static/walk/: a white arrow pointing ahead on
the walk page's green, as an SVG and as the PNG sizes phones ask for (192 and 512 for the web app
manifest, 180 for iOS). The arrow stays inside the central 60% so the same picture works as a
maskable icon (Android crops to a circle or squircle). Run once after changing the drawing:

    .venv/bin/python scripts/draw_walk_icons.py
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent.parent / "app" / "static" / "walk"
GREEN = "#1f9d55"
WHITE = "#ffffff"
# The arrow on a 100x100 grid: a head (triangle) and a shaft (rectangle).
HEAD = [(50, 22), (76, 50), (24, 50)]
SHAFT = (41, 48, 59, 78)
SIZES = (180, 192, 512)


def svg() -> str:
    head = " ".join(f"{x},{y}" for x, y in HEAD)
    x0, y0, x1, y1 = SHAFT
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 100 100">'
        f'<rect width="100" height="100" fill="{GREEN}"/>'
        f'<polygon points="{head}" fill="{WHITE}"/>'
        f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="{WHITE}"/>'
        "</svg>\n"
    )


def png(size: int) -> Image.Image:
    scale = 4  # drawn large and scaled down: smooth edges without an anti-aliasing renderer
    big = size * scale
    unit = big / 100
    image = Image.new("RGB", (big, big), GREEN)
    draw = ImageDraw.Draw(image)
    draw.polygon([(x * unit, y * unit) for x, y in HEAD], fill=WHITE)
    x0, y0, x1, y1 = SHAFT
    draw.rectangle((x0 * unit, y0 * unit, x1 * unit - 1, y1 * unit - 1), fill=WHITE)
    return image.resize((size, size), Image.LANCZOS)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "icon.svg").write_text(svg())
    for size in SIZES:
        png(size).save(OUT / f"icon-{size}.png", optimize=True)
    print(f"wrote icon.svg and {', '.join(f'icon-{s}.png' for s in SIZES)} to {OUT}")


if __name__ == "__main__":
    main()
