"""``python -m elastic_kit``: the store inspection tool (see :mod:`elastic_kit.cli`)."""

import sys

from elastic_kit.cli import main

if __name__ == "__main__":
    sys.exit(main())
