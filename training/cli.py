"""The ``hetero`` console command: one entry point, one subcommand per concern.

Subcommands are imported lazily so ``hetero spec check`` starts without loading torch.
Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from training.spec import SpecError

# name -> (module, one-line help).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "spec": ("training.spec_cli", "validate a cluster spec and show what it describes"),
    "serve": ("training.dataplane.serve_cli", "run a data server (gRPC preprocessing service)"),
    "demo": ("training.dataplane.demo", "local data-plane demo: N data servers, one client"),
    "launch": ("training.launcher.launch", "the container entry point: run this host's role"),
    "local": ("training.local.run", "run the whole heterogeneous topology on this machine"),
    "status": ("training.workstation.status", "show a deployed job: groups, instances, outcome"),
    "job": ("training.workstation.jobstart", "start another job on the deployed cluster"),
    "rehearse": ("training.rehearsal.cli", "rehearse the spec's AWS lifecycle here, with faults"),
    "sagemaker": (
        "training.workstation.sagemaker_submit",
        "submit the spec as a SageMaker heterogeneous job",
    ),
    "preflight": ("training.preflight", "check quotas, AZ, AMIs, Spot score, CDK bootstrap first"),
    "plan": ("training.planner.cli", "rank clusters by expected samples per dollar under Spot"),
    "bench": ("training.planner.bench", "measure this machine's trainer and data server rates"),
    "dataset": ("training.dataset_cli", "prepare an ImageFolder as shards + manifest; verify one"),
    "export": (
        "training.trainer.export_cli",
        "write model.safetensors + a timm config.json from a checkpoint (local or S3)",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    # Build only the chosen subcommand's parser: importing every module would load torch.
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if a in SUBCOMMANDS), None)
    parser = build_parser(chosen)
    args = parser.parse_args(args_list)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except SpecError as e:
        # Every subcommand reads the spec; a bad one is reported the same way by all of them.
        print(e, file=sys.stderr)
        return 2


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero",
        description="Heterogeneous Spot training of Vision Transformers on AWS, as code.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    return parser


if __name__ == "__main__":
    sys.exit(main())
