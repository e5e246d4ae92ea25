"""The stacks of one spec, assembled: the network and cluster stacks, with cdk-nag's findings
accepted on them (``app.py`` and the tests build a cluster through ``create_stacks``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from constructs import Construct

from infra import nag
from infra.cluster import REPO_ROOT
from infra.nag import NagAcknowledgment
from infra.stacks import ClusterStack, NetworkStack
from training.spec import ClusterSpec


@dataclass(frozen=True)
class ClusterApp:
    network: NetworkStack
    cluster: ClusterStack
    acknowledgments: list[NagAcknowledgment]
    """The cdk-nag findings accepted on these stacks, each with its reason."""


def create_stacks(
    app: Construct,
    *,
    spec: ClusterSpec,
    spec_text: str,
    build_context: Path = REPO_ROOT,
    destroy_checkpoints: bool = False,
) -> ClusterApp:
    """Build the network and cluster stacks for ``spec`` (named ``<spec.name>-network`` and
    ``<spec.name>-cluster``) and run cdk-nag's AWS Solutions checks on them at synth."""
    network = NetworkStack(app, f"{spec.name}-network", spec=spec)
    cluster = ClusterStack(
        app,
        f"{spec.name}-cluster",
        spec=spec,
        spec_text=spec_text,
        network=network.network,
        build_context=build_context,
        destroy_checkpoints=destroy_checkpoints,
    )
    cluster.add_stack_dependency(network)
    acks = nag.acknowledge_findings(network=network, cluster=cluster)
    return ClusterApp(network=network, cluster=cluster, acknowledgments=acks)
