"""What each role runs: torchrun for a 2-node trainer group, the data server command."""

from __future__ import annotations

import pytest

from training.processes.roles import (
    data_server_command,
    trainer_command,
)
from training.spec import ClusterSpec


def option(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_two_node_trainer_torchrun(spec: ClusterSpec) -> None:
    hosts = ("10.0.0.9", "10.0.0.200")
    cmd = trainer_command(
        spec,
        spec_path="cluster.toml",
        run_dir="runs/x",
        trainer_hosts=hosts,
        node_rank=1,
        data_servers=["10.0.0.30:50051", "10.0.0.31:50051"],
        python="python3",
    )
    argv = cmd.argv
    assert argv[:3] == ("python3", "-m", "torch.distributed.run")
    assert option(argv, "--nnodes") == "2"
    assert option(argv, "--node-rank") == "1"
    assert option(argv, "--nproc-per-node") == "4"  # g5.12xlarge: 4 GPUs
    assert option(argv, "--master-addr") == "10.0.0.9"  # rendezvous on the first trainer host
    assert option(argv, "--master-port") == "29500"
    assert "--standalone" not in argv
    # The trainer module and its own flags come after torchrun's.
    tail = argv[argv.index("-m", 3) :]
    assert tail == (
        "-m",
        "training.trainer",
        "--spec",
        "cluster.toml",
        "--run-dir",
        "runs/x",
        "--data-servers",
        "10.0.0.30:50051,10.0.0.31:50051",
    )


def test_single_node_is_standalone_and_without_servers_uses_local_loader(
    spec: ClusterSpec,
) -> None:
    argv = trainer_command(
        spec,
        spec_path="s.toml",
        run_dir="r",
        trainer_hosts=("127.0.0.1",),
        node_rank=0,
        nproc_per_node=1,
    ).argv
    assert "--standalone" in argv and option(argv, "--nproc-per-node") == "1"
    assert "--data-servers" not in argv and "--node-rank" not in argv


@pytest.mark.parametrize("rank", [-1, 2])
def test_node_rank_outside_the_group_is_refused(spec: ClusterSpec, rank: int) -> None:
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        trainer_command(spec, spec_path="s", run_dir="r", trainer_hosts=("a", "b"), node_rank=rank)


def test_data_server_command() -> None:
    argv = data_server_command(spec_path="c.toml", port=50052, host="0.0.0.0", python="py").argv
    assert argv == (
        "py", "-m", "training.cli", "serve", "--spec", "c.toml", "--port", "50052", "--host",
        "0.0.0.0",
    )  # fmt: skip
    told = data_server_command(spec_path="c.toml", port=1, outcome_dir="/run/o", python="py")
    assert told.argv[-2:] == ("--outcome-dir", "/run/o")
