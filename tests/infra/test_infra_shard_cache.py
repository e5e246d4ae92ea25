"""The dataprep root volume and the shard cache (``infra/shard_cache.py``): the volume grows by
``cache_gb`` only when some type the group lists has no instance store volume that holds it.
Exact sizes in GiB, from specs parsed in the test (no stack synthesized: ``root_volume_gib`` is
what the launch template's block device mapping gets; ``test_infra_cluster.py`` checks that
wiring on a synthesized template). The boot's own choice of volume is tested as a script in
``test_infra_user_data.py``."""

from __future__ import annotations

from typing import Any

import pytest

from infra.instance_group import root_volume_gib
from infra.shard_cache import cache_bytes, instance_store_holds
from training.spec import ClusterSpec, parse_spec


def _spec(dataprep_types: list[str], cache_gb: float | None) -> ClusterSpec:
    dataset: dict[str, Any] = {"source": "shards", "path": "s3://d/imagenet/"}
    if cache_gb is not None:
        dataset["cache_gb"] = cache_gb
    return parse_spec(
        {
            "name": "t",
            "groups": [
                {"name": "trainer", "role": "trainer", "instance_types": ["g5.xlarge"], "count": 1},
                {
                    "name": "dataprep",
                    "role": "dataprep",
                    "instance_types": dataprep_types,
                    "count": 1,
                },
            ],
            "job": {"steps": 10, "dataset": dataset},
        }
    )


@pytest.mark.parametrize(
    ("types", "cache_gb", "dataprep_gib"),
    [
        # c6id.8xlarge: one 1900 GB volume holds 1000 GB, the cache goes there: no growth.
        (["c6id.8xlarge"], 1000, 100),
        # c6id.32xlarge: four 1900 GB volumes; one holds 1900 GB exactly.
        (["c6id.32xlarge"], 1900, 100),
        # c6i.8xlarge has no instance store: when Spot delivers it, the cache is on the root
        # volume, so the template (shared by both types) grows by 1000 GB = 931.3 GiB -> 932.
        (["c6id.8xlarge", "c6i.8xlarge"], 1000, 100 + 932),
        # c6id.4xlarge's one volume (950 GB) is smaller than the cache.
        (["c6id.8xlarge", "c6id.4xlarge"], 1000, 100 + 932),
        # c5d.18xlarge has 2 x 900 GB: 1800 GB in all, but the cache lives on one volume.
        (["c5d.18xlarge"], 1500, 100 + 1397),  # 1500 GB = 1396.98 GiB -> 1397
        # No cache_gb: the default cache follows the free space of whichever volume it is on.
        (["c6i.4xlarge"], None, 100),
        (["c6id.4xlarge", "c6i.4xlarge"], None, 100),
    ],
)
def test_the_dataprep_root_volume_grows_only_where_instance_store_cannot_hold_the_cache(
    types: list[str], cache_gb: float | None, dataprep_gib: int
) -> None:
    spec = _spec(types, cache_gb)
    assert root_volume_gib(spec, spec.group("dataprep")) == dataprep_gib
    assert root_volume_gib(spec, spec.group("trainer")) == 200  # trainers never hold it


def test_the_cache_size_in_bytes_and_what_one_volume_holds() -> None:
    assert cache_bytes(_spec(["c6id.4xlarge"], 0.5)) == 500_000_000
    assert cache_bytes(_spec(["c6id.4xlarge"], None)) is None
    assert instance_store_holds("c6id.4xlarge", 950 * 10**9)
    assert not instance_store_holds("c6id.4xlarge", 950 * 10**9 + 1)
    assert not instance_store_holds("c6i.4xlarge", 1)  # EBS only
    assert not instance_store_holds("x9z.4xlarge", 1)  # not in the catalogue: counts as none
