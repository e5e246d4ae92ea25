"""``hetero rehearse``: the spec's AWS lifecycle on this machine, with injected faults."""

from __future__ import annotations

import argparse
import gc
import math
import sys
from pathlib import Path

from training.processes.supervisor import become_subreaper
from training.rehearsal import report
from training.rehearsal.containers import (
    IMAGE_REPOSITORY,
    ROLE_TAGS,
    ImageMissing,
    check_images,
    docker_client,
)
from training.rehearsal.faults import (
    INSTANCE_FORM,
    LAUNCH_FORM,
    OUTAGE_FORM,
    FaultKind,
    FaultSyntaxError,
    Scenario,
    check_against_spec,
    load_scenario,
    merge,
    parse_instance_fault,
)
from training.rehearsal.injector import SAVE_WATCH_S
from training.rehearsal.instances import BACKSTOP_AFTER_S
from training.rehearsal.rehearse import (
    DEFAULT_NOTICE_S,
    DEFAULT_TIMEOUT_S,
    RehearsalOptions,
    rehearse,
)
from training.spec import load_spec

EXIT_USAGE = 2

_FAULT_HELP = {
    FaultKind.INTERRUPT: "Spot interruption notice, then termination after --notice-seconds",
    FaultKind.REBALANCE: "rebalance recommendation, then Capacity Rebalancing (replacement "
    "first, then the at-risk instance goes)",
    FaultKind.KILL: "SIGKILL the instance's processes and terminate it (hard loss)",
    FaultKind.CRASH: "SIGKILL the trainer worker on the instance every time it runs from then "
    "on (exhausts the restart budget)",
    FaultKind.KILL_TRAINER: "SIGKILL the trainer worker on the instance once (a crashed rank: "
    "the generation restarts from the newest checkpoint)",
    FaultKind.KILL_IN_SAVE: "from STEP on, watch a trainer instance's checkpoint staging "
    "folder and, as soon as a checkpoint write is in progress there (step-N.partial), SIGKILL "
    f"its processes and terminate it (a hard loss mid-save; skipped when no write starts within "
    f"{SAVE_WATCH_S:g} s)",
    FaultKind.HANG: "SIGSTOP every process of the instance and leave it running (a frozen host: "
    "silent in the job record, a live host takes it out of its group)",
    FaultKind.HANG_TRAINER: "SIGSTOP the trainer workers of the instance once, the launcher "
    "left running (ranks stuck: the launcher's hang watch takes their stacks and ends the "
    "generation)",
    FaultKind.HANG_DATA_SERVER: "SIGSTOP a dataprep instance's data server, its launcher left "
    "running (its health check unanswered: the launcher takes the host out of its group)",
    FaultKind.CAPACITY_GONE: "SIGKILL the instance's processes and terminate it, and its group "
    "finds no capacity until the job ends (no replacement)",
    FaultKind.KILL_DATA_SERVER: "SIGKILL a dataprep instance's data server and terminate it",
    FaultKind.KILL_LAUNCHER: "SIGKILL the instance's processes and leave it running (a launcher "
    "gone for good: silent in the job record, a live host takes it out of its group; with none "
    "left, only the budget's scheduled action stops the instance)",
}
_LAUNCH_FAULT_HELP = {
    FaultKind.BOOT_FAIL: "the instance's boot gives up: no launcher starts, the OS shuts it down "
    "and EC2 terminates it (the launchers that run count it against the replacement budget)",
    FaultKind.EARLY_EXIT: "the instance's launcher exits before its job loop (its metadata has "
    "no tags, so it cannot find its group): SetInstanceHealth Unhealthy, or past the "
    "replacement budget the job ends failed",
}


def _usd_list(text: str) -> tuple[float, ...]:
    """``--resume-max-usd``: one or more positive amounts, comma-separated."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected positive amounts of USD, comma-separated (e.g. 0.01,1)"
        )
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Instance faults take {INSTANCE_FORM}: INDEX counts the group's instances from 0 in "
        "launch order (0..count-1 are the group's original instances, count and up its "
        "replacements in the order they launch); STEP is the training step (the highest step "
        "in the sample logs), Ns is N seconds after the start. Every fault flag can be repeated."
    )
    parser.add_argument("--spec", required=True, help="cluster spec (TOML)")
    parser.add_argument("--out", required=True, help="output folder (rehearsal.json, instances/)")
    fault_flags = [(k.value, "GROUP:INDEX@STEP", text) for k, text in _FAULT_HELP.items()]
    fault_flags += [
        (k.value, "GROUP:INDEX", f"{text} ({LAUNCH_FORM})")
        for k, text in _LAUNCH_FAULT_HELP.items()
    ]
    outage = f"S3 unreachable from the instances for SECONDS ({OUTAGE_FORM})"
    for flag, metavar, text in [*fault_flags, ("s3-outage", "STEP:SECONDS", outage)]:
        parser.add_argument(f"--{flag}", action="append", default=[], metavar=metavar, help=text)
    parser.add_argument("--scenario", help="a TOML or JSON file listing faults (see docs)")
    base = parser.add_mutually_exclusive_group()
    base.add_argument(
        "--baseline",
        metavar="DIR",
        help="reuse the uninterrupted rehearsal in DIR (default: run one into OUT/baseline)",
    )
    base.add_argument(
        "--no-baseline", action="store_true", help="do not compare with an uninterrupted run"
    )
    for budget in ("restart", "replacement"):
        parser.add_argument(
            f"--{budget}-budget",
            type=int,
            default=None,
            metavar="N",
            help=f"the launchers' {budget} budget (hetero launch --{budget}-budget; default: the "
            "launcher's own, 3)",
        )
    parser.add_argument(
        "--backstop-after",
        type=float,
        default=None,
        metavar="S",
        help="seconds after a capped job's deadline at which its scheduled action takes every "
        f"group to 0 (hetero launch --backstop-after; default {BACKSTOP_AFTER_S:g}: after a "
        "trainer that starts past the deadline has made its step and saved)",
    )
    parser.add_argument(
        "--resume-stopped",
        type=int,
        default=0,
        metavar="N",
        help="when the job ends stopped (job.max_usd / job.max_hours), continue it with "
        "`hetero job start --resume`, at most N times (default 0: the rehearsal ends there)",
    )
    parser.add_argument(
        "--resume-max-usd",
        type=_usd_list,
        default=(),
        metavar="USD[,USD...]",
        help="the budget of each continued job (`hetero job start --resume --max-usd USD`): "
        "the first value for the first, and so on, the last for every later one (default: the "
        "spec's job.max_usd)",
    )
    parser.add_argument(
        "--image",
        nargs="?",
        const=IMAGE_REPOSITORY,
        default=None,
        metavar="REPOSITORY",
        help="run every instance's launcher in a container of its role's image "
        f"(REPOSITORY:{ROLE_TAGS['trainer']}, REPOSITORY:{ROLE_TAGS['dataprep']}; default "
        f"{IMAGE_REPOSITORY}, what `make images` builds), started by the stack's user data's own "
        "`docker run` line; without it, as processes of this checkout",
    )
    parser.add_argument(
        "--notice-seconds",
        type=float,
        default=None,
        help=f"seconds between a Spot notice and the termination (default {DEFAULT_NOTICE_S:g}: "
        "AWS's two minutes, scaled down)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"bound on the whole rehearsal in seconds (default {DEFAULT_TIMEOUT_S:g})",
    )


def build_scenario(args: argparse.Namespace) -> Scenario:
    """The scenario file's faults plus the flags' (``FaultSyntaxError`` names the bad one)."""
    scenario = load_scenario(args.scenario) if args.scenario else Scenario()
    flags = [
        parse_instance_fault(kind, text)
        for kind in FaultKind
        for text in getattr(args, kind.value.replace("-", "_"))
    ]
    return merge(scenario, flags)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    try:
        scenario = build_scenario(args)
    except FaultSyntaxError as e:
        print(f"hetero rehearse: {e}", file=sys.stderr)
        return EXIT_USAGE
    problems = check_against_spec(scenario.faults, spec)
    if problems:
        print("hetero rehearse: " + "\n  ".join(["faults do not fit the spec:", *problems]),
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    notice = next(
        n for n in (args.notice_seconds, scenario.notice_seconds, DEFAULT_NOTICE_S) if n is not None
    )
    bad = [("--timeout", "more than 0 seconds")] if args.timeout <= 0 else []
    values = {"notice-seconds": notice, "resume-stopped": args.resume_stopped}
    values |= {f"{b}-budget": getattr(args, f"{b}_budget") for b in ("restart", "replacement")}
    values["backstop-after"] = args.backstop_after
    bad += [(f"--{k}", "0 or more") for k, v in values.items() if v is not None and v < 0]
    if bad:
        print(f"hetero rehearse: {bad[0][0]} must be {bad[0][1]}", file=sys.stderr)
        return EXIT_USAGE
    # Orphans of the emulated instances' trees (a killed launcher's children) come to this
    # process, which reaps them, instead of escaping to init.
    become_subreaper()
    options = RehearsalOptions(
        spec_path=Path(args.spec),
        out_dir=Path(args.out),
        scenario=scenario,
        notice_s=notice,
        timeout_s=args.timeout,
        resume_stopped=args.resume_stopped,
        resume_max_usd=args.resume_max_usd,
        image=args.image,
        launcher_args=tuple(
            arg
            for flag, value in values.items()
            if flag.endswith(("-budget", "backstop-after")) and value is not None
            for arg in (f"--{flag}", str(value))
        ),
    )
    if args.image is not None:
        try:
            check_images(docker_client(), args.image)
        except ImageMissing as e:
            print(f"hetero rehearse: {e}", file=sys.stderr)
            return EXIT_USAGE
    _, code = rehearse(
        options,
        baseline_dir=Path(args.baseline) if args.baseline else None,
        run_baseline=not args.no_baseline,
        render=report.render,
    )
    # Its report is out. What is left is the interpreter's exit, whose garbage collections would
    # go through the emulators' objects (moto's backends: some 600,000) again and again: about
    # 10 s of CPU. Frozen (gc.freeze: left out of every later collection), the exit takes 1 s.
    gc.freeze()
    return code
