"""``hetero launch``: the container's entry point on every instance.

Finds this host's instance group, finds its peers and runs the group's role under supervision.
On EC2 it runs the role in generations until the job is over (``ec2_job``: elastic trainer
membership, Spot and Auto Scaling notices, restarts within a budget, job end in every outcome).

Exit codes (``training.common.outcome``): 0 the job finished; 75 this host stopped (an interruption
notice, an Auto Scaling termination; the job goes on without it); 1 failed; 2 bad spec or no
group; 3 peers not found; 128+N stopped by signal N. On EC2 with a job pointer
(``HETERO_JOB_PARAMETER``), a host whose job was superseded starts again on the new job (76
only if that fails).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from training.common.names import (
    ENV_JOB_PARAMETER,
    ENV_SPEC,
    SAGEMAKER_FAILURE_FILE,
    SAGEMAKER_RESOURCECONFIG,
)
from training.common.outcome import (
    EXIT_CONFIG,
    EXIT_FAILED,
    LAUNCHER_STOP_S,
    ROLE_STOP_GRACE_S,
    Outcome,
)
from training.costs import backstop
from training.launcher import early_exit, host_checks, peers
from training.launcher.backends import Backend, Place, asks_imds, choose_place
from training.launcher.ec2_start import cannot_start, run_ec2
from training.launcher.group import (
    GroupDetectionError,
    detect_group,
)
from training.launcher.hang_watch import HANG_AFTER_STEPS, HANG_FLOOR_S
from training.launcher.imds import (
    DEFAULT_IMDS_URL,
    ENV_IMDS_ENDPOINT,
    ImdsClient,
    endpoint_from_env,
)
from training.launcher.plan import log_plan, make_plan, print_plan, trainer_efa_env
from training.launcher.trainer_watch import NO_TRAINER_TIMEOUT_S
from training.processes.roles import RENDEZVOUS_TIMEOUT_S
from training.processes.supervised import run_role
from training.processes.supervisor import Supervisor, exit_code_for_signal
from training.spec import Role, load_spec

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec",
        default=os.environ.get(ENV_SPEC, "cluster.toml"),
        help=f"cluster spec (default: ${ENV_SPEC} or cluster.toml)",
    )
    parser.add_argument("--group", help="this host's instance group (wins over detection)")
    parser.add_argument(
        "--backend",
        choices=["auto", *[b.value for b in Backend]],
        default="auto",
        help="where peers come from (default auto: from where the group was found)",
    )
    parser.add_argument("--run-dir", help="trainer output folder (default: per backend)")
    parser.add_argument(
        "--host-index",
        type=int,
        default=0,
        help="local backend only: this host's index in its group (trainer node rank)",
    )
    parser.add_argument(
        "--resourceconfig",
        default=str(SAGEMAKER_RESOURCECONFIG),
        help="SageMaker resource config path",
    )
    parser.add_argument(
        "--imds-url",
        default=endpoint_from_env(os.environ),
        help=f"instance metadata endpoint (default: ${ENV_IMDS_ENDPOINT}, as boto3 reads it, "
        f"else {DEFAULT_IMDS_URL})",
    )
    parser.add_argument("--imds-timeout", type=float, default=1.0, help="seconds per IMDS call")
    parser.add_argument(
        "--peer-timeout", type=float, default=900.0, help="seconds to wait for every peer (EC2)"
    )
    parser.add_argument(
        "--spot-poll", type=float, default=5.0, help="seconds between Spot notice polls (EC2)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=float(ROLE_STOP_GRACE_S),
        help="seconds the role gets to checkpoint and exit after SIGTERM before it is killed "
        "(the stack's docker run --stop-timeout leaves the launcher this plus "
        f"{LAUNCHER_STOP_S} s of its own: training.common.outcome)",
    )
    parser.add_argument(
        "--restart-budget",
        type=int,
        default=3,
        help="EC2: failed runs of the role this host retries before it ends the job as failed",
    )
    parser.add_argument(
        "--replacement-budget",
        type=int,
        default=early_exit.REPLACEMENT_BUDGET,
        help="EC2: instances per job taken out of service because the launcher could not start "
        "its job loop; one more ends the job as failed",
    )
    parser.add_argument(
        "--no-trainer-timeout",
        type=float,
        default=NO_TRAINER_TIMEOUT_S,
        help="EC2, data servers: seconds without any trainer host in the job record before the "
        "job ends as failed",
    )
    parser.add_argument(
        "--backstop-lead",
        type=float,
        default=backstop.MIN_LEAD_S,
        help="EC2, a job with a budget: the least time before its start at which the "
        "budget's scheduled action is still put (AWS refuses start times in the past)",
    )
    parser.add_argument(
        "--backstop-after",
        type=float,
        default=None,
        help="EC2, a job with a budget: seconds after the budget's deadline at which its "
        "scheduled action takes every group to 0 (default: after the launchers' own end of the "
        "job, --grace plus four heartbeats)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=30.0,
        help="EC2: seconds between a running host's writes of its state to the job record, and "
        "its checks for failed boots (and, on a data server, for live trainers)",
    )
    parser.add_argument(
        "--silent-after",
        type=float,
        default=None,
        help="EC2: seconds without a host's write to the job record after which a live host "
        "takes it out of its group (SetInstanceHealth Unhealthy) and trainers re-form without "
        "it (default: eight heartbeats)",
    )
    parser.add_argument(
        "--hang-floor",
        type=float,
        default=HANG_FLOOR_S,
        help="EC2, trainers: seconds without progress on any of the host's ranks (a step, an "
        "evaluation batch) after which the generation is hung: the ranks' stacks are written "
        "to the run folder and the job record, then it ends; at least --hang-after-steps "
        "median step times (default: %(default)s)",
    )
    parser.add_argument(
        "--hang-after-steps",
        type=float,
        default=HANG_AFTER_STEPS,
        help="EC2, trainers: median step times without progress after which a generation is "
        "hung, when longer than --hang-floor (default: %(default)s)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=10.0,
        help="EC2: seconds before the first retry, doubled for each further failure (max 120)",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=int,
        default=RENDEZVOUS_TIMEOUT_S,
        help="EC2: seconds trainer hosts wait for each other in torchrun's rendezvous",
    )
    parser.add_argument(
        "--poll", type=float, default=5.0, help="EC2: seconds between membership checks"
    )
    parser.add_argument(
        "--job-poll",
        type=float,
        default=30.0,
        help=f"EC2 with ${ENV_JOB_PARAMETER}: seconds between reads of the job pointer while "
        "the role runs (a new job stops it)",
    )
    parser.add_argument(
        "--driver-version-file",
        default=str(host_checks.DRIVER_VERSION_FILE),
        help="EC2 and SageMaker trainers: the NVIDIA driver's version file, checked against the "
        "image's CUDA wheels before the role starts",
    )
    parser.add_argument(
        "--shm-dir",
        default=str(host_checks.SHM_DIR),
        help="the shared-memory file system whose size caps the trainer's data-loader workers",
    )
    parser.add_argument(
        "--failure-file",
        default=SAGEMAKER_FAILURE_FILE,
        help="SageMaker: where a host that cannot run its role writes why (the job's "
        "FailureReason)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan (group, peers, commands) and exit"
    )


def host_unfit(why: str, place: Place, args: argparse.Namespace) -> int:
    """This host cannot run its role for a reason every host of the group shares (the image:
    ``host_checks``): the job fails with ``why``, which the place records where it reads it
    (SageMaker: the failure file, the job's ``FailureReason``). On EC2 ``ec2_start.run_ec2``
    ends the job instead. Returns the exit code."""
    if not args.dry_run:
        place.record_unfit(why, Path(args.failure_file))
    return EXIT_FAILED


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    imds = ImdsClient(args.imds_url, timeout_s=args.imds_timeout)
    resourceconfig = Path(args.resourceconfig)
    try:
        identity = detect_group(
            spec,
            flag=args.group,
            environ=os.environ,
            resourceconfig=resourceconfig,
            imds=imds if asks_imds(args.backend) else None,
        )
    except GroupDetectionError as e:
        log.error("%s", e)
        return cannot_start(f"no instance group: {e}", EXIT_CONFIG, spec, args, imds, None)
    place = choose_place(args.backend, identity, resourceconfig, imds)
    efa_env = trainer_efa_env(spec, identity, place)
    if efa_env is None:
        if not place.runs_generations:
            return EXIT_CONFIG
        why = 'efa = "on" and this host cannot give NCCL EFA'
        return cannot_start(why, EXIT_CONFIG, spec, args, imds, identity)
    checked = host_checks.check_host(
        spec,
        identity.group,
        place,
        environ=os.environ,
        driver_file=Path(args.driver_version_file),
        shm_dir=Path(args.shm_dir),
    )
    if place.runs_generations:  # EC2: it acts on a problem once it knows the job (ec2_start)
        return run_ec2(spec, args, identity, imds, efa_env, checked)
    if checked.problem is not None:
        return host_unfit(checked.problem, place, args)
    efa_env = {**efa_env, **checked.env}  # the trainer's variables
    try:
        found, network_interface = place.find_peers(spec, resourceconfig, args.host_index)
    except (peers.PeerDiscoveryError, OSError, ValueError) as e:
        log.error("peer discovery failed (%s backend): %s", place.name.value, e)
        return peers.EXIT_PEERS
    run_dir = args.run_dir or place.run_dir(spec)
    outcome_dir = Path(run_dir) / "outcome"
    try:
        plan = make_plan(
            spec,
            spec_path=args.spec,
            identity=identity,
            place=place,
            found_peers=found,
            run_dir=run_dir,
            environ=os.environ,
            network_interface=network_interface,
            efa_env=efa_env,
            outcome_dir=str(outcome_dir),
        )
    except ValueError as e:  # e.g. --host-index outside the group
        log.error("%s", e)
        return EXIT_CONFIG
    log_plan(plan)
    if args.dry_run:
        print_plan(plan)
        return 0
    ranks = spec.group(identity.group).ranks_per_instance if plan.role is Role.TRAINER else None
    with Supervisor(grace_s=args.grace, subreaper=True) as sup:
        sup.install_signal_handlers()
        ended = run_role(
            sup, plan.commands, env=os.environ, outcome_dir=outcome_dir, trainer_ranks=ranks
        )
    if sup.stop_signal is not None:
        log.warning("stopped: %s", sup.stop_reason)
        return exit_code_for_signal(sup.stop_signal)
    code = next((c for c in ended.codes if c), 0)
    # torchrun turns every non-zero rank exit into 1: the ranks' files tell the outcome.
    if ended.outcome is not None and (code != 0 or ended.outcome is not Outcome.FINISHED):
        return ended.outcome.exit_code
    return code
