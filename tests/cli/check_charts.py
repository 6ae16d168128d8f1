#!/usr/bin/env python3
"""Renders every chart of a talon HTML page (report.html, eval.html) in headless Chromium and
fails on a chart whose plot area is broken: mostly black (an unstyled SVG fill), blank (no
line or bar drawn), or without any of the page's series colours.

Usage: check_charts.py PAGE.html WORKDIR [MIN_CHARTS]
Each <svg> is cut out into a page of its own, shown at its viewBox width so one SVG unit is one
pixel, screenshotted, and its plot area (the rect with class "plot-area") is read back from the
PNG with a small decoder (zlib + the PNG filters; no imaging library needed).
"""
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
           "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def decode_png(data):
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, w = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), f"PNG depth {depth} colour type {ctype}"
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(h):
        f = raw[i]
        line = bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b = prev[x]
            c = prev[x - bpp] if x >= bpp else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    return w, h, bpp, rows


def main():
    page, work = Path(sys.argv[1]), Path(sys.argv[2])
    min_charts = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    exe = chromium()
    if not exe:
        print("FAIL - no headless Chromium (scripts/setup.sh --tests installs Debian's chromium)")
        return 1
    html = page.read_text()
    svgs = re.findall(r"<svg\b.*?</svg>", html, re.S)
    if len(svgs) < min_charts:
        print(f"FAIL - {page.name}: {len(svgs)} charts, expected at least {min_charts}")
        return 1
    # Grey (#7f7f7f) is left out: too close to the frame and the axis ticks to tell apart.
    palette = [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in PALETTE if c != "#7f7f7f"]
    failures = 0
    for n, svg in enumerate(svgs):
        name = re.search(r'data-chart="([^"]*)"', svg)
        name = name.group(1) if name else f"chart {n}"
        vb = re.search(r'viewBox="0 0 ([\d.]+) ([\d.]+)"', svg)
        area = re.search(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"[^>]*class="plot-area"', svg)
        if not vb or not area:
            print(f"FAIL - {page.name} {name}: no viewBox or plot-area rect")
            failures += 1
            continue
        W, H = int(float(vb.group(1))), int(float(vb.group(2)))
        x, y, w, h = (float(v) for v in area.groups())
        # The page's own chart styling is inline, so the chart alone must draw the same.
        one = work / f"chart{n}.html"
        one.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><style>body{margin:0;background:#fff}"
                       f"svg{{width:{W}px !important;max-width:none !important;margin:0 !important}}</style></head>"
                       f"<body>{svg}</body></html>")
        png = work / f"chart{n}.png"
        subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--force-device-scale-factor=1", f"--window-size={W},{H}", f"--screenshot={png}",
                        one.resolve().as_uri()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        if not png.exists():
            print(f"FAIL - {page.name} {name}: Chromium wrote no screenshot")
            failures += 1
            continue
        pw, ph, bpp, rows = decode_png(png.read_bytes())
        x0, y0 = int(x) + 2, int(y) + 2  # inside the frame's stroke
        x1, y1 = min(int(x + w) - 2, pw), min(int(y + h) - 2, ph)
        total = dark = white = coloured = 0
        for yy in range(y0, y1):
            row = rows[yy]
            for xx in range(x0, x1):
                r, g, b = row[xx * bpp], row[xx * bpp + 1], row[xx * bpp + 2]
                total += 1
                if r + g + b < 120:
                    dark += 1
                if r > 245 and g > 245 and b > 245:
                    white += 1
                if any(abs(r - pr) + abs(g - pg) + abs(b - pb) < 60 for pr, pg, pb in palette):
                    coloured += 1
        problems = []
        if total == 0:
            problems.append("empty plot area")
        else:
            if dark > 0.3 * total:
                problems.append(f"{100 * dark / total:.0f}% of the plot area is black")
            if white > 0.995 * total:
                problems.append("the plot area is blank")
            if coloured < 20:
                problems.append(f"only {coloured} pixels in a series colour")
        if problems:
            print(f"FAIL - {page.name} {name}: {'; '.join(problems)}")
            failures += 1
        else:
            print(f"ok   - {page.name} {name}: {coloured} series pixels, {100 * dark / total:.1f}% dark")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
