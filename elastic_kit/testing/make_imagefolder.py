"""The command ``python -m elastic_kit.testing.make_imagefolder OUT [--classes N] ...``.

It is the command-line form of :func:`elastic_kit.testing.make_imagefolder`; the
implementation lives in :mod:`elastic_kit.testing._imagefolder` so that this module's
name (the command) and the function's name (the API) do not shadow each other.
"""

from __future__ import annotations

from elastic_kit.testing._imagefolder import main, make_imagefolder

__all__ = ["main", "make_imagefolder"]

if __name__ == "__main__":
    raise SystemExit(main())
