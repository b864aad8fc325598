"""What a test's snapshot root holds after a run: this user's directory in it stays
when runs end (gone, another user could make one of its name), so a finished run
leaves nothing but that empty directory."""

from __future__ import annotations

import os
from pathlib import Path


def left_in(root: str | os.PathLike[str]) -> list[str]:
    """The entries below ``root`` (relative paths), except this user's empty
    ``elastic_kit-<uid>`` directory."""
    root = Path(root)
    user = root / f"elastic_kit-{os.geteuid()}"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if not (p == user and p.is_dir() and not any(p.iterdir())))
