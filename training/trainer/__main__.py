"""torchrun entry: ``python -m training.trainer --spec SPEC --run-dir DIR [--data-servers ...]``.

Builds the configuration once and hands it to one ``Trainer``. Exit codes: 0 when training
finished or stopped gracefully (SIGTERM/SIGINT, ``--max-seconds``), 2 for a bad spec or flags,
1 for any other failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from training.spec import SpecError, load_spec
from training.trainer.config import ConfigError, TrainerConfig

log = logging.getLogger("training.trainer")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.trainer", description=__doc__)
    p.add_argument("--spec", required=True, help="cluster spec (TOML)")
    p.add_argument("--run-dir", required=True, help="folder for metrics, plot and summary")
    p.add_argument(
        "--data-servers",
        default="",
        help="where the data servers are: host:port[,host:port...], file:PATH (one address a "
        "line, read again every few seconds), ec2[:CLUSTER] (instances by the cluster's tags), "
        "sagemaker[:PATH] (resourceconfig.json) or loopback (default: local DataLoader)",
    )
    p.add_argument("--steps", type=int, help="optimizer steps (overrides job.steps/epochs)")
    p.add_argument("--max-seconds", type=float, help="stop with a checkpoint after S seconds")
    p.add_argument(
        "--checkpoint-dir",
        help="overrides job.checkpoint.dir (with --checkpoint-s3-uri: this host's staging folder)",
    )
    p.add_argument(
        "--checkpoint-s3-uri",
        help="s3://bucket/prefix: keep checkpoints there (every host uploads its own shards; "
        "resume downloads the newest complete step on every host)",
    )
    p.add_argument(
        "--synthetic-data",
        action="store_true",
        help="in-memory synthetic batches, no augmentation (tests, loop-overhead benchmarks)",
    )
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
    )
    try:
        config = TrainerConfig.from_spec(
            load_spec(args.spec),
            run_dir=args.run_dir,
            data_servers=args.data_servers,
            steps=args.steps,
            max_seconds=args.max_seconds,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_s3_uri=args.checkpoint_s3_uri,
            synthetic=args.synthetic_data,
        )
    except (SpecError, ConfigError) as e:
        print(e, file=sys.stderr)
        return 2
    # Imported here so a bad spec is reported without loading torch.
    from training.trainer.train import Trainer

    trainer: Trainer | None = None
    try:
        trainer = Trainer(config)
        return trainer.train()
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except Exception:
        log.exception("trainer failed")
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        else:
            _leave_process_group()


def _leave_process_group() -> None:
    """After a failed start, leave the group so torchrun sees a clean exit code."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
