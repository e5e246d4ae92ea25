"""torchrun entry: ``python -m training.trainer --spec SPEC --run-dir DIR [--data-servers ...]``.

Builds the configuration once and hands it to one ``Trainer``. Exit codes
(``training.common.outcome``):
0 the job finished (its steps or epochs; last checkpoint durable); 75 it stopped gracefully
(SIGTERM, SIGINT, ``--max-seconds`` or a peer's stop) with a durable checkpoint of its last
step, to be resumed; 1 any failure (a crash, a lost peer, a last checkpoint that could not be
saved); 2 a bad spec, flags or environment; 65 more unreadable training samples than
``job.dataset.max_unreadable`` allows (``EXIT_DATA``: the EC2 launcher does not retry it).
With ``--outcome-dir`` each rank also writes ``rank-<RANK>.json``
(``training.common.outcome.write_rank_outcome``) before it exits, failures included, since
torchrun reports every non-zero rank exit as 1, and keeps ``progress-<RANK>.json`` there,
answering SIGUSR2 with its stacks (``training.common.progress``: the launcher's hang watch).
SIGUSR1 asks for a checkpoint without stopping (a rebalance recommendation).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from training.common.outcome import (
    EXIT_CONFIG,
    EXIT_DATA,
    EXIT_FAILED,
    Outcome,
    RankOutcome,
    write_rank_outcome,
)
from training.common.progress import ProgressWriter
from training.spec import SpecError, load_spec
from training.trainer.config import ConfigError, TrainerConfig

if TYPE_CHECKING:
    from training.trainer.train import Trainer

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
    p.add_argument(
        "--autoscale",
        default="",
        help="where rank 0's data-tier controller acts, for an elastic dataprep group: "
        "file:PATH (hetero local's server count), asg:NAME (the dataprep Auto Scaling group) or "
        "report (log only: SageMaker); default: no controller",
    )
    p.add_argument(
        "--steps",
        type=int,
        help="stop after N optimizer steps (overrides job.steps/epochs; the learning-rate "
        "schedule keeps the spec's length)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        help="stop with a checkpoint after S seconds of training (also, whatever this says, "
        "at $HETERO_BUDGET_DEADLINE, epoch seconds, when the launcher sets it: the job's budget)",
    )
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
        "--outcome-dir",
        help="write this rank's outcome (finished, stopped or failed; last step; newest "
        "durable checkpoint; reason) to DIR/rank-<RANK>.json before exiting",
    )
    p.add_argument(
        "--synthetic-data",
        action="store_true",
        help="in-memory synthetic batches, no augmentation (tests, loop-overhead benchmarks)",
    )
    p.add_argument(
        "--emf",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rank 0 prints each logged interval as a CloudWatch Embedded Metric Format JSON "
        "line on stdout (default: on where HETERO_CLUSTER is set, as on the stack's instances)",
    )
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    # A rebalance notice (SIGUSR1) before the trainer listens for it must not kill the rank.
    previous_usr1 = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
    )
    outcome_dir = Path(args.outcome_dir) if args.outcome_dir else None
    # What the launcher watches for a hang, and the stacks it asks for when it sees one.
    progress = ProgressWriter(outcome_dir, rank).install_stacks()
    progress.beat(0, "start")
    try:
        return _run(args, rank, outcome_dir, progress)
    finally:
        progress.close()


def _run(
    args: argparse.Namespace, rank: int, outcome_dir: Path | None, progress: ProgressWriter
) -> int:
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
            emf=args.emf,
            autoscale=args.autoscale,
        )
    except (SpecError, ConfigError) as e:
        print(e, file=sys.stderr)
        _write_outcome(outcome_dir, _failed(rank, None, f"configuration: {e}"))
        return EXIT_CONFIG
    # Imported here so a bad spec is reported without loading torch.
    from training.trainer.train import Trainer
    from training.trainer.unreadable import UnreadableDataError

    trainer: Trainer | None = None
    try:
        trainer = Trainer(config, progress=progress)
        code = trainer.train()
        assert trainer.outcome is not None
        _write_outcome(outcome_dir, trainer.outcome)
    except ConfigError as e:
        print(e, file=sys.stderr)
        _write_outcome(outcome_dir, _failed(rank, trainer, f"configuration: {e}"))
        code = EXIT_CONFIG
    except UnreadableDataError as e:
        log.error("%s", e)  # the message names the files and the fix: no traceback
        reason = f"{type(e).__name__}: {e}"
        _write_outcome(outcome_dir, _failed(rank, trainer, reason, exit_code=EXIT_DATA))
        code = EXIT_DATA
    except Exception as e:
        log.exception("trainer failed")
        _write_outcome(outcome_dir, _failed(rank, trainer, f"{type(e).__name__}: {e}"))
        code = EXIT_FAILED
    if code != 0 and trainer is not None and trainer.policy.in_flight is not None:
        # The background save's thread may be blocked on a peer that is gone (for up to the
        # checkpoint timeout), and the interpreter would wait for it at exit; the outcome is
        # written, so leave now.
        log.error("exiting with %d without waiting for the background checkpoint save", code)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if trainer is not None:
        trainer.close()
    else:
        _leave_process_group()
    return code


def _failed(
    rank: int, trainer: Trainer | None, reason: str, *, exit_code: int | None = None
) -> RankOutcome:
    return RankOutcome(
        rank=rank,
        outcome=Outcome.FAILED,
        step=trainer.step if trainer is not None else 0,
        checkpoint_step=trainer.policy.checkpoint_step if trainer is not None else None,
        reason=reason,
        exit_code=exit_code,
    )


def _write_outcome(folder: Path | None, outcome: RankOutcome) -> None:
    """Best effort: a rank that cannot write its file counts as failed anyway."""
    if folder is None:
        return
    try:
        write_rank_outcome(folder, outcome)
    except Exception as e:
        log.error("could not write the outcome file into %s: %s", folder, e)


def _leave_process_group() -> None:
    """After a failed start, leave the group so torchrun sees a clean exit code."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
