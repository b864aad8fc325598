"""Write a tiny ImageNet-style image folder of real JPEG files, deterministically.

Usage (the command is :mod:`elastic_kit.testing.make_imagefolder`)::

    python -m elastic_kit.testing.make_imagefolder OUT --classes 10 --per-class 64 --size 64 --seed 0

writes ``OUT/train/class_XX/img_YYYY.jpg`` and ``OUT/val/class_XX/img_YYYY.jpg`` plus
``OUT/dataset.json`` describing how it was made.

Why synthetic but real files: the example must exercise the same code path as
ImageNet (``ImageFolder``, PIL decoding, random crops and flips) yet run on two CPU
cores in seconds. Each class has its own hue and its own pattern (stripes, checker,
disc, ring, ...) drawn with random position, frequency and colour jitter plus pixel
noise, so a small CNN learns it well above chance within a few epochs even through
``RandomResizedCrop``, while no two images are identical.

Determinism: every image is drawn from its own generator seeded by
``(seed, split, class, index)``, so the same seed gives byte-identical files
whatever order they are written in and whatever the other options are.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

__all__ = ["make_imagefolder", "main", "PATTERNS"]

log = logging.getLogger(__name__)

#: The pattern families; class ``c`` uses ``PATTERNS[c % len(PATTERNS)]``.
PATTERNS = ("hstripes", "vstripes", "checker", "disc", "ring", "diagonal")
_SPLIT_IDS = {"train": 0, "val": 1}
_FORMAT_VERSION = 1


def _class_colour(c: int, classes: int) -> np.ndarray:
    # Evenly spaced hues; alternate lightness so neighbouring hues also differ in value.
    h = c / classes
    v = 0.95 if c % 2 == 0 else 0.7
    return np.array(colorsys.hsv_to_rgb(h, 0.85, v), dtype=np.float32)


def _pattern_mask(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A [size, size] mask in [0, 1] of the class's pattern with random jitter."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    freq = rng.uniform(3.0, 5.0)
    phase = rng.uniform(0, 2 * np.pi)
    if kind == "hstripes":
        m = np.sin(2 * np.pi * freq * yy + phase) > 0
    elif kind == "vstripes":
        m = np.sin(2 * np.pi * freq * xx + phase) > 0
    elif kind == "checker":
        m = (np.sin(2 * np.pi * freq * xx + phase) * np.sin(2 * np.pi * freq * yy + phase)) > 0
    elif kind == "diagonal":
        m = np.sin(2 * np.pi * freq * (xx + yy) / 1.4 + phase) > 0
    else:
        cy, cx = rng.uniform(0.35, 0.65, size=2)
        r = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
        radius = rng.uniform(0.25, 0.38)
        m = r < radius if kind == "disc" else (r < radius) & (r > radius * 0.55)
    return m.astype(np.float32)


def _draw(c: int, classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One uint8 HxWx3 image of class ``c``."""
    fg = _class_colour(c, classes) * rng.uniform(0.85, 1.15, size=3).astype(np.float32)
    bg = np.full(3, rng.uniform(0.05, 0.3), dtype=np.float32) + rng.uniform(-0.05, 0.05, 3).astype(
        np.float32
    )
    mask = _pattern_mask(PATTERNS[c % len(PATTERNS)], size, rng)[..., None]
    img = mask * fg + (1.0 - mask) * bg
    img = img + rng.normal(0.0, 0.08, size=img.shape).astype(np.float32)
    return (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _write_split(root: Path, split: str, classes: int, n: int, size: int, seed: int) -> None:
    for c in range(classes):
        d = root / split / f"class_{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            rng = np.random.default_rng([seed, _SPLIT_IDS[split], c, i])
            Image.fromarray(_draw(c, classes, size, rng), mode="RGB").save(
                d / f"img_{i:04d}.jpg", format="JPEG", quality=90
            )


def make_imagefolder(
    out: str | os.PathLike[str],
    *,
    classes: int = 10,
    per_class: int = 64,
    val_per_class: int = 16,
    size: int = 64,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write (or reuse) a synthetic ImageNet-style ``train/`` + ``val/`` tree at ``out``.

    Args:
        out: directory to create. The tree is written under a temporary name beside
            it and renamed into place, so an interrupted run never leaves a
            half-written data set that a later run would mistake for a complete one.
        classes: number of classes (sub-directories per split), 2..1000.
        per_class: training images per class.
        val_per_class: validation images per class.
        size: image side in pixels (>= 8).
        seed: the data set is a pure function of the arguments and this seed.
        overwrite: replace an existing ``out`` made with other arguments. Without it
            a mismatching existing directory is an error; a matching one is reused.

    Returns:
        ``Path(out)``.

    Example::

        root = make_imagefolder("/tmp/tiny", classes=4, per_class=8, size=32)
        train = torchvision.datasets.ImageFolder(root / "train")
    """
    if not 2 <= classes <= 1000:
        raise ValueError(f"classes={classes} must be in [2, 1000]")
    if per_class < 1 or val_per_class < 1:
        raise ValueError(
            f"per_class={per_class} and val_per_class={val_per_class} must both be >= 1"
        )
    if size < 8:
        raise ValueError(f"size={size} must be >= 8 pixels")
    out = Path(out)
    spec = {
        "format_version": _FORMAT_VERSION,
        "classes": classes,
        "per_class": per_class,
        "val_per_class": val_per_class,
        "size": size,
        "seed": seed,
    }
    marker = out / "dataset.json"
    if out.exists() or out.is_symlink():
        owner = out.lstat().st_uid
        if owner not in (os.geteuid(), 0):
            # another user's data set (made first in /tmp, say) could hold any images
            raise PermissionError(
                f"{out} belongs to uid {owner}, not to this user (uid {os.geteuid()}): "
                f"its images could be anyone's; choose a directory of your own")
    if marker.exists():
        try:
            existing = json.loads(marker.read_text())
        except (OSError, ValueError):
            existing = None
        if existing == spec:
            log.info("reusing %s (made with the same arguments)", out)
            return out
        if not overwrite:
            raise FileExistsError(
                f"{out} holds a data set made with {existing}, not {spec}; "
                "pass overwrite=True (--overwrite) to replace it"
            )
    elif out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (--overwrite)")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_split(tmp, "train", classes, per_class, size, seed)
        _write_split(tmp, "val", classes, val_per_class, size, seed)
        (tmp / "dataset.json").write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "wrote %s: %d classes x (%d train + %d val) images of %dx%d",
        out, classes, per_class, val_per_class, size, size,
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point (``python -m elastic_kit.testing.make_imagefolder``)."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_kit.testing.make_imagefolder",
        description="Write a small synthetic ImageNet-style train/ + val/ tree of JPEG files.",
    )
    parser.add_argument("out", help="output directory")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=64, help="training images per class")
    parser.add_argument("--val-per-class", type=int, default=16, help="validation images per class")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a different data set at OUT")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        make_imagefolder(
            args.out,
            classes=args.classes,
            per_class=args.per_class,
            val_per_class=args.val_per_class,
            size=args.size,
            seed=args.seed,
            overwrite=args.overwrite,
        )
    except (FileExistsError, ValueError) as e:  # a usage error: one line, exit 2
        parser.error(str(e))
    return 0
