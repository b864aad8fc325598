"""Small, deterministic data sets for running the examples and tests on a CPU.

:func:`make_imagefolder` writes an ImageNet-style ``train/`` and ``val/`` tree of
real JPEG files that ``torchvision.datasets.ImageFolder`` reads unchanged, so the
ImageNet example runs end to end on a laptop in seconds instead of needing the
real 150 GB data set. The same thing from a shell::

    python -m elastic_kit.data.make_imagefolder OUT --classes 10 --per-class 64 --size 64 --seed 0
"""

from __future__ import annotations

from elastic_kit.data._imagefolder import make_imagefolder

__all__ = ["make_imagefolder"]
