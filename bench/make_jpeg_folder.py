#!/usr/bin/env python3
"""Writes a folder of JPEG photographs-alike for bench/folder_pipeline.sh: DIR/train/<class>/NNNN.jpg,
CLASSES classes of PER images, each about ImageNet's typical size (500x375, some portrait, some
larger or smaller), quality 90, with real texture: Pillow's Mandelbrot and Gaussian noise mixed
with per-image gradients and shapes, blurred a little — content JPEG must spend bits on, not flat
colour. Deterministic in the seed. Needs PIL (Debian's python3-pil).
  make_jpeg_folder.py DIR [CLASSES=10] [PER=100]"""
import os
import random
import sys

from PIL import Image, ImageDraw, ImageFilter


def picture(rng, w, h):
    noise = Image.effect_noise((w, h), rng.uniform(30, 90))
    fractal = Image.effect_mandelbrot((w, h), (rng.uniform(-2.2, -1.2), rng.uniform(-1.2, -0.6),
                                               rng.uniform(0.3, 1.0), rng.uniform(0.6, 1.2)), rng.randrange(20, 120))
    grad = Image.linear_gradient("L").resize((w, h)).rotate(rng.uniform(0, 360), expand=False)
    im = Image.merge("RGB", (noise, fractal, grad))
    draw = ImageDraw.Draw(im)
    for _ in range(rng.randrange(3, 12)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        box = (x0, y0, x0 + rng.randrange(10, w // 2), y0 + rng.randrange(10, h // 2))
        fill = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    return im.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2)))


def main():
    root = sys.argv[1]
    classes = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    per = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    rng = random.Random(46)
    sizes = [(500, 375), (500, 375), (500, 333), (375, 500), (640, 480), (400, 300)]
    for c in range(classes):
        d = os.path.join(root, "train", "class{:03d}".format(c))
        os.makedirs(d, exist_ok=True)
        for i in range(per):
            w, h = rng.choice(sizes)
            picture(rng, w, h).save(os.path.join(d, "{:04d}.jpg".format(i)), quality=90)


if __name__ == "__main__":
    main()
