"""``hetero export``: a checkpoint's weights out as ``model.safetensors`` + ``config.json``
(``training.trainer.export``)."""

from __future__ import annotations

import argparse
import sys

from training.spec import load_spec
from training.trainer.checkpoint_read import WEIGHTS_CHOICES
from training.trainer.config import ConfigError
from training.trainer.export import ExportError, export_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", required=True, help="the cluster spec the job ran with")
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a complete step-N folder, or a checkpoint root (its newest complete step); "
        "local or s3://",
    )
    parser.add_argument("--out", required=True, help="a local folder or an s3:// prefix")
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="auto",
        help="auto (default): the EMA weights when the checkpoint has them, else the model's",
    )


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    try:
        result = export_checkpoint(args.checkpoint, spec=spec, out=args.out, weights=args.weights)
    except (ExportError, ConfigError) as e:
        print(f"hetero export: {e}", file=sys.stderr)
        return 2
    print(f"exported {result.describe()}")
    print(f"wrote {result.model_file} ({result.bytes / 1e6:.1f} MB)")
    print(f"wrote {result.config_file}")
    print(f"in {result.seconds:.2f}s (read {result.read_s:.2f}s, write {result.write_s:.2f}s)")
    return 0
