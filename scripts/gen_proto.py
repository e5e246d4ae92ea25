"""Generate the data plane's Python code from ``proto/``, or check the checked-in code is current.

    python scripts/gen_proto.py            # regenerate training/dataplane/v1/*_pb2*
    python scripts/gen_proto.py --check    # exit 1 naming every stale or missing file

protoc runs with ``-Iproto`` and writes to the repository root, so the folder path under
``proto/`` is the Python package path and the generated imports need no rewriting.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent


def _proto_files(root: Path) -> list[Path]:
    files = sorted((root / "proto").rglob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {root / 'proto'}")
    return files


def _plugin(name: str) -> Path | None:
    """mypy-protobuf's plugins live next to the interpreter in the virtualenv."""
    candidate = Path(sys.executable).parent / name
    found = candidate if candidate.exists() else shutil.which(name)
    return Path(found) if found else None


def generate(root: Path, out_dir: Path) -> list[Path]:
    """Run protoc for every .proto under ``root/proto`` into ``out_dir``; return generated paths
    relative to ``out_dir``."""
    proto_root = root / "proto"
    protos = _proto_files(root)
    include = Path(protoc.__file__).parent / "_proto"  # well-known types shipped with grpcio-tools
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    mypy_plugin, mypy_grpc_plugin = _plugin("protoc-gen-mypy"), _plugin("protoc-gen-mypy_grpc")
    if mypy_plugin is None or mypy_grpc_plugin is None:
        # Without mypy-protobuf the .pyi would differ from the checked-in ones: refuse.
        raise SystemExit(
            "protoc-gen-mypy not found; install the dev extras: pip install -e '.[dev]'"
        )
    args += [
        f"--plugin=protoc-gen-mypy={mypy_plugin}",
        f"--plugin=protoc-gen-mypy_grpc={mypy_grpc_plugin}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
    ]
    args += [str(p.relative_to(proto_root)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file())


def stale_files(root: Path) -> list[str]:
    """Generated files under ``root`` that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        stale = []
        for rel in generate(root, fresh):
            current = root / rel
            if not current.is_file():
                stale.append(f"{rel} (missing)")
            elif not filecmp.cmp(fresh / rel, current, shallow=False):
                stale.append(f"{rel} (differs)")
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.check:
        stale = stale_files(root)
        if stale:
            print(
                "generated code is stale; run `python scripts/gen_proto.py` and commit:\n"
                + "\n".join(f"  {s}" for s in stale),
                file=sys.stderr,
            )
            return 1
        print("generated code is current")
        return 0
    # Generate beside, then copy: only the generated files are touched.
    with tempfile.TemporaryDirectory() as tmp:
        for rel in generate(root, Path(tmp)):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / rel, root / rel)
            print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
