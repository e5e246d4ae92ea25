"""``python -m training.launcher ...`` is ``hetero launch ...`` (the image's entry point)."""

from __future__ import annotations

import sys

from training.cli import main

if __name__ == "__main__":
    sys.exit(main(["launch", *sys.argv[1:]]))
