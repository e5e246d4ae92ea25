"""``python -m training.launcher ...`` is ``hetero launch ...`` (the image's entry point)."""

from __future__ import annotations

import argparse
import logging
import sys

from training.launcher import launch
from training.spec import SpecError

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="hetero launch")
    launch.add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(launch.run(args))
    except SpecError as e:  # as ``hetero`` reports a bad spec
        print(e, file=sys.stderr)
        sys.exit(2)
