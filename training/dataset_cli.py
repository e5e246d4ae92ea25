"""``hetero dataset``: prepare an ImageFolder as WebDataset shards plus a manifest
(``prep``), and check a prepared dataset against its manifest (``verify``).
See ``docs/datasets.md``, ``training/data/prep.py`` and ``training/data/verify.py``."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dataset_command", required=True, metavar="ACTION")
    p = sub.add_parser(
        "prep",
        help="pack an ImageFolder (local or s3://) into tar shards and a manifest",
        description="Pack an ImageFolder (<class>/<image>, local or s3://) into WebDataset tar "
        "shards plus manifest.json. Every image is decoded as the data servers decode it; one "
        "that does not decode is left out and listed (--strict: the dataset is refused). "
        "Resumable: rerun the same command after an interruption.",
    )
    p.add_argument("--src", required=True, help="the training ImageFolder: a folder or s3://")
    val = p.add_mutually_exclusive_group()
    val.add_argument(
        "--val-src", help="a separate validation ImageFolder with the same class names"
    )
    val.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="hold this share of --src out for validation (the trainer's split for the same "
        "fraction and seed)",
    )
    p.add_argument("--split-seed", type=int, default=0, help="the split's seed (default: 0)")
    order = p.add_mutually_exclusive_group()
    order.add_argument(
        "--shuffle-seed",
        type=int,
        default=0,
        help="seed of the samples' order in the shards, so each shard holds a random sample of "
        "the classes (default: 0)",
    )
    order.add_argument(
        "--no-shuffle",
        dest="shuffle_seed",
        action="store_const",
        const=None,
        help="keep the listing's order (class by class): only for a dataset read whole",
    )
    p.add_argument("--out", required=True, help="where the shards and manifest go: folder or s3://")
    p.add_argument(
        "--shard-mb", type=float, default=256.0, help="most MiB per shard (default: 256)"
    )
    p.add_argument(
        "--read-threads",
        type=int,
        default=32,
        help="source images read concurrently (default: 32)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="ignore an earlier prep's state in --out and prepare from scratch",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse the dataset if any image does not decode (default: leave such images out, "
        "each listed here and in the manifest's excluded)",
    )
    v = sub.add_parser(
        "verify",
        help="check a prepared dataset against its manifest",
        description="Check every shard of a prepared dataset against its manifest: present, "
        "its size, its sha256, where every sample is in it and that every sample's image "
        "decodes (exit 0: all well, 1: problems, 2: the manifest is unreadable or invalid).",
    )
    v.add_argument("path", help="the prepared dataset's folder or manifest.json (local or s3://)")
    v.add_argument(
        "--quick",
        action="store_true",
        help="only check each shard is there with its size (no shard is read)",
    )


def run(args: argparse.Namespace) -> int:
    if args.dataset_command == "prep":
        return run_prep(args)
    return run_verify(args)


def _pin(sha256: str) -> str:
    return f'pin it under [job.dataset]:\n  manifest_sha256 = "{sha256}"'


def run_prep(args: argparse.Namespace) -> int:
    from botocore.exceptions import BotoCoreError, ClientError

    # Deferred: the data package loads torch and torchvision, which `hetero dataset --help` and
    # the other subcommands need not.
    from training.data.names import shown_path
    from training.data.prep import MIB, PrepRequest, prep
    from training.data.prep_inputs import PrepError

    request = PrepRequest(
        src=args.src,
        out=args.out,
        val_src=args.val_src,
        val_fraction=args.val_fraction,
        split_seed=args.split_seed,
        shard_bytes=int(args.shard_mb * MIB),
        read_threads=args.read_threads,
        restart=args.restart,
        shuffle_seed=args.shuffle_seed,
        strict=args.strict,
    )
    try:
        result = prep(request)
    except PrepError as e:
        print(f"hetero dataset prep: {e}", file=sys.stderr)
        return 2
    except (OSError, BotoCoreError, ClientError) as e:
        print(
            f"hetero dataset prep: {e}; the finished shards are kept: rerun the same command "
            "to resume",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {shown_path(result.uri)}")
    if result.kept:
        kept, written = len(result.kept), len(result.written)
        print(f"  kept {kept} finished shards of an earlier run, wrote {written}")
    for name, index in result.manifest.splits.items():
        print(f"  {name}: {len(index)} samples in {len(index.shards)} shards")
    print(f"  classes: {len(result.manifest.classes)}")
    excluded = result.manifest.excluded
    if excluded:
        n = len(excluded)
        print(f"  left out {n} image(s) that cannot be read or decoded (the manifest's excluded):")
        for image in excluded:
            print(f"    {image.path}: {image.reason}")
    print(f"manifest sha256 {result.sha256}")
    print(_pin(result.sha256))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    # Deferred: the data package loads torch and torchvision, which `hetero dataset --help` and
    # the other subcommands need not.
    from training.data.manifest import ManifestError
    from training.data.names import shown_path
    from training.data.verify import MAX_PROBLEMS_SHOWN, verify

    try:
        report = verify(args.path, quick=args.quick)
    except ManifestError as e:
        print(f"hetero dataset verify: {e}", file=sys.stderr)
        return 2
    what = "sizes" if args.quick else "sizes, sha256s, sample offsets and image decodes"
    if report.problems:
        print(f"{shown_path(report.uri)}: {len(report.problems)} problem(s)")
        for problem in report.problems[:MAX_PROBLEMS_SHOWN]:
            print(f"  {problem}")
        more = len(report.problems) - MAX_PROBLEMS_SHOWN
        if more > 0:
            print(f"  ... and {more} more")
        return 1
    print(f"{shown_path(report.uri)}: ok ({what} checked)")
    for name, index in report.manifest.splits.items():
        print(f"  {name}: {len(index)} samples in {len(index.shards)} shards")
    print(f"manifest sha256 {report.sha256}")
    print(_pin(report.sha256))
    return 0
