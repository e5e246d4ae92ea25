"""The cluster spec: the shipped files load, and every bad field is refused by name."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import botocore.session
import pytest

from training.common.names import asg_name
from training.spec import (
    CLUSTER_PLACEMENT_DOC,
    Efa,
    Market,
    Parallelism,
    Placement,
    Role,
    SpecError,
    load_spec,
    parse_spec,
)

REPO = Path(__file__).resolve().parents[1]

GOOD: dict[str, Any] = {
    "name": "t",
    "groups": [
        {"name": "trainer", "role": "trainer", "instance_types": ["g5.xlarge"], "count": 2},
        {"name": "dataprep", "role": "dataprep", "instance_types": ["c6i.4xlarge"], "count": 1},
    ],
    "job": {"batch_size": 8, "steps": 10},
}


def spec_with(**changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD)
    doc.update(changes)
    return doc


def problems(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    return info.value.problems


@pytest.mark.parametrize("path", ["cluster.toml", "specs/local-cpu.toml"])
def test_shipped_specs_load(path: str) -> None:
    spec = load_spec(REPO / path)
    assert spec.trainer_group.role is Role.TRAINER
    assert spec.dataprep_groups
    assert spec.usd_per_hour() > 0


def test_defaults_and_derived_values() -> None:
    spec = parse_spec(GOOD)
    tg = spec.trainer_group
    assert tg.market is Market.SPOT and tg.efa is Efa.AUTO
    assert tg.ranks_per_instance == 1  # g5.xlarge has one GPU
    assert spec.world_size == 2
    assert not tg.use_efa  # g5.xlarge has no EFA
    assert spec.job.parallelism.strategy is Parallelism.DDP
    assert spec.job.total_steps == 10


def test_prices_explicit_beat_offline_table() -> None:
    doc = spec_with(job={"prices": {"usd_per_hour": {"g5.xlarge": 0.5}}})
    spec = parse_spec(doc)
    assert spec.job.prices.hourly("g5.xlarge", Market.SPOT) == 0.5
    # c6i.4xlarge: 0.68 On-Demand x 0.35 default Spot ratio.
    assert spec.job.prices.hourly("c6i.4xlarge", Market.SPOT) == pytest.approx(0.238)
    assert spec.usd_per_hour() == pytest.approx(2 * 0.5 + 0.238)


def test_unknown_keys_list_the_valid_ones() -> None:
    doc = spec_with(job={"batchsize": 8})
    (msg,) = problems(doc)
    assert msg.startswith("job.batchsize: unknown key (did you mean 'batch_size'?)")
    assert "valid keys:" in msg and "grad_accum_steps" in msg


def test_unknown_group_key() -> None:
    doc = spec_with()
    doc["groups"][0]["instance_type"] = "g5.xlarge"
    (msg,) = problems(doc)
    assert msg.startswith("groups[0].instance_type: unknown key (did you mean 'instance_types'?)")


def test_cluster_without_trainer_is_refused() -> None:
    doc = spec_with(groups=[GOOD["groups"][1]])
    assert problems(doc) == [
        "groups: no group has role 'trainer'; add one (GPU instances that train)"
    ]


def test_count_zero_is_refused() -> None:
    doc = spec_with()
    doc["groups"][1]["count"] = 0
    (msg,) = problems(doc)
    assert msg == "groups[1].count: must be at least 1, got 0"


def test_unknown_role_names_the_valid_ones() -> None:
    doc = spec_with()
    doc["groups"][1]["role"] = "preprocess"
    (msg,) = problems(doc)
    assert msg == "groups[1].role: 'preprocess' is not valid; use one of 'trainer', 'dataprep'"


def test_burstable_type_is_refused_in_placement_group() -> None:
    doc = spec_with()
    doc["groups"][1]["instance_types"] = ["c6i.4xlarge", "t3.large"]
    (msg,) = problems(doc)
    assert msg.startswith("groups[1].instance_types[1]: 't3.large' is burstable")
    assert "cluster placement group" in msg


def test_efa_on_for_type_without_efa() -> None:
    doc = spec_with()
    doc["groups"][0]["efa"] = "on"
    (msg,) = problems(doc)
    assert msg.startswith("groups[0].efa: 'on' but g5.xlarge has no EFA")


def test_efa_auto_on_a_type_with_efa() -> None:
    doc = spec_with()
    doc["groups"][0]["instance_types"] = ["p4d.24xlarge"]
    spec = parse_spec(doc)
    assert spec.trainer_group.use_efa
    assert spec.trainer_group.ranks_per_instance == 8


# ----------------------------------------------------------------------------- placement


def _group(role: str, types: list[str], count: int, **extra: Any) -> dict[str, Any]:
    name = "trainer" if role == "trainer" else "dataprep"
    return {"name": name, "role": role, "instance_types": types, "count": count, **extra}


@pytest.mark.parametrize(
    ("role", "types", "count", "extra", "cluster"),
    [
        # Trainers of more than one instance: their all-reduce crosses instances.
        ("trainer", ["g5.xlarge"], 2, {}, True),
        # One trainer instance: no traffic between trainer instances to speed up.
        ("trainer", ["g5.xlarge"], 1, {}, False),
        # EFA in use (auto, every type has it): cluster even for one instance ...
        ("trainer", ["p4d.24xlarge"], 1, {}, True),
        ("dataprep", ["c5n.18xlarge"], 2, {}, True),
        # ... but not where EFA is off.
        ("trainer", ["p4d.24xlarge"], 1, {"efa": "off"}, False),
        ("dataprep", ["c5n.18xlarge"], 2, {"efa": "off"}, False),
        # Dataprep without EFA: none, whatever the count.
        ("dataprep", ["c6i.4xlarge"], 1, {}, False),
        ("dataprep", ["c6i.4xlarge", "c7i.4xlarge"], 4, {}, False),
    ],
)
def test_placement_defaults_by_role_count_and_efa(
    role: str, types: list[str], count: int, extra: dict[str, Any], cluster: bool
) -> None:
    doc = spec_with()
    doc["groups"][0 if role == "trainer" else 1] = _group(role, types, count, **extra)
    group = parse_spec(doc).group(role)
    assert group.placement is None  # not in the spec: the rule decides
    assert group.uses_cluster_placement is cluster


def test_explicit_placement_overrides_the_default() -> None:
    doc = spec_with()
    doc["groups"][0]["placement"] = "none"  # a 2-instance trainer: cluster by default
    doc["groups"][1]["placement"] = "cluster"  # dataprep: none by default
    spec = parse_spec(doc)
    assert spec.trainer_group.placement is Placement.NONE
    assert not spec.trainer_group.uses_cluster_placement
    (dataprep,) = spec.dataprep_groups
    assert dataprep.placement is Placement.CLUSTER and dataprep.uses_cluster_placement
    # An EFA group may opt out too.
    doc["groups"][0] = _group("trainer", ["p4d.24xlarge"], 2, placement="none")
    efa = parse_spec(doc).trainer_group
    assert efa.use_efa and not efa.uses_cluster_placement


def test_bad_placement_names_the_field_and_valid_values() -> None:
    doc = spec_with()
    doc["groups"][1]["placement"] = "spread"
    assert problems(doc) == [
        "groups[1].placement: 'spread' is not valid; use one of 'cluster', 'none'"
    ]
    doc["groups"][1]["placement"] = True
    assert problems(doc) == ["groups[1].placement: expected str, got bool True"]
    doc["groups"][1]["placment"] = "none"
    del doc["groups"][1]["placement"]
    (msg,) = problems(doc)
    assert msg.startswith("groups[1].placment: unknown key (did you mean 'placement'?)")


def test_placement_warning_for_several_types_in_a_cluster_placement_group() -> None:
    doc = spec_with()
    doc["groups"][0]["instance_types"] = ["g5.xlarge", "g6.xlarge"]
    doc["groups"][1]["instance_types"] = ["c6i.4xlarge", "c7i.4xlarge"]
    spec = parse_spec(doc)
    assert spec.trainer_group.placement_warning == (
        "group 'trainer' uses a cluster placement group with 2 instance types "
        "(g5.xlarge, g6.xlarge); AWS recommends the same instance type for all instances in a "
        "cluster placement group: more than one type raises the chance of an insufficient "
        "capacity error (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/"
        "placement-strategies.html#placement-groups-cluster)"
    )
    assert CLUSTER_PLACEMENT_DOC in spec.trainer_group.placement_warning
    # Several types without a placement group, or one type with one: nothing to warn about.
    (dataprep,) = spec.dataprep_groups
    assert dataprep.placement_warning is None
    assert parse_spec(spec_with()).trainer_group.placement_warning is None
    doc["groups"][0]["placement"] = "none"
    assert parse_spec(doc).trainer_group.placement_warning is None


def test_window_warning_when_the_reorder_window_leaves_servers_idle() -> None:
    """7 servers x 1 stream x 2 batches a range need a window of 14; the default 8 gives 4
    ranges at once. An elastic group counts at its max_count."""
    doc = spec_with()
    doc["groups"][1]["count"] = 7
    assert parse_spec(doc).window_warning == (
        "job.dataplane.prefetch_batches = 8 lets at most 4 of the data tier's 7 streams "
        "(7 server(s) at its largest x streams_per_server 1) have a range of chunk_batches = 2 "
        "at once, so the others wait idle; set prefetch_batches = 14 (each trainer rank then "
        "holds up to 17 MB of batches) or lower chunk_batches"
    )
    doc["job"] = {"batch_size": 8, "steps": 10, "dataplane": {"prefetch_batches": 14}}
    assert parse_spec(doc).window_warning is None
    assert parse_spec(spec_with()).window_warning is None  # 1 server x 2 <= 8
    doc["groups"][1].update(count=1, min_count=1, max_count=5)
    doc["job"]["dataplane"] = {"streams_per_server": 2, "prefetch_batches": 19}
    assert "set prefetch_batches = 20 " in (parse_spec(doc).window_warning or "")


def test_trainer_types_need_gpus_and_equal_gpu_counts() -> None:
    doc = spec_with()
    doc["groups"][0]["instance_types"] = ["c6i.4xlarge"]
    assert "has no GPU" in problems(doc)[0]
    doc["groups"][0]["instance_types"] = ["g5.xlarge", "g5.12xlarge"]
    assert "same number of GPUs" in problems(doc)[0]


def test_unknown_instance_type_suggests_close_names() -> None:
    doc = spec_with()
    doc["groups"][0]["instance_types"] = ["g5.xlarg"]
    (msg,) = problems(doc)
    assert "unknown instance type 'g5.xlarg'" in msg and "g5.xlarge" in msg


def test_hsdp_degrees_must_multiply_to_world_size() -> None:
    doc = spec_with(job={"parallelism": {"strategy": "hsdp", "shard_degree": 3}})
    (msg,) = problems(doc)
    assert msg.startswith("job.parallelism: shard_degree (3) x replicate_degree")
    assert "make the product 2" in msg
    ok = spec_with(job={"parallelism": {"strategy": "hsdp", "shard_degree": 1}})
    assert parse_spec(ok).job.parallelism.shard_degree == 1


def test_degrees_only_for_hsdp() -> None:
    doc = spec_with(job={"parallelism": {"strategy": "ddp", "shard_degree": 2}})
    assert problems(doc) == [
        "job.parallelism.shard_degree: only applies to strategy 'hsdp' (strategy is ddp)"
    ]


def test_wrong_types_and_many_problems_reported_together() -> None:
    doc = spec_with(job={"batch_size": "64", "lr": -1, "dataset": {"source": "s3"}})
    doc["groups"][0]["market"] = "reserved"
    found = problems(doc)
    assert "groups[0].market: 'reserved' is not valid; use one of 'spot', 'on-demand'" in found
    assert "job.batch_size: expected int, got str '64'" in found
    assert "job.lr: must be positive, got -1.0" in found
    assert "job.dataset.path: source 's3' needs path = 's3://bucket/prefix/'" in found


def test_group_names_unique_and_single_trainer_group() -> None:
    doc = spec_with()
    doc["groups"].append(copy.deepcopy(doc["groups"][0]))
    found = problems(doc)
    assert "groups: group name 'trainer' is used twice; names must be unique" in found
    assert any("2 trainer groups" in p for p in found)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(bad)


def test_cli_check_reports_problems(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[groups]]\nname = "d"\nrole = "dataprep"\ninstance_types=["c6i.4xlarge"]\n')
    out = subprocess.run(
        [sys.executable, "-m", "training.cli", "spec", "check", "--spec", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert "groups[0].count: missing" in out.stderr
    assert "no group has role 'trainer'" in out.stderr
    good = subprocess.run(
        [sys.executable, "-m", "training.cli", "spec", "check", "--spec", "cluster.toml"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert good.returncode == 0, good.stderr
    assert "dataprep" in good.stdout and "USD/h" in good.stdout


def test_cli_check_warns_about_several_types_in_a_cluster_placement_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from training import cli

    monkeypatch.setenv("COLUMNS", "1000")  # one line per row: no wrapping
    # cluster.toml: 1 Spot trainer of g5.xlarge or g6.xlarge, so no cluster placement group
    # anywhere and nothing to warn about (the default a first deploy uses: README.md).
    assert cli.main(["spec", "check", "--spec", str(REPO / "cluster.toml")]) == 0
    out = capsys.readouterr().out
    assert "placement: trainer none, dataprep none" in out.splitlines()
    assert not [line for line in out.splitlines() if line.startswith("warning:")]
    # Two such trainers: a cluster placement group (by default) with two instance types.
    text = (REPO / "cluster.toml").read_text()
    one = 'instance_types = ["g5.xlarge", "g6.xlarge"]      # required, ordered by preference\n'
    one += "count = 1 "
    assert one in text
    path = tmp_path / "two.toml"
    path.write_text(text.replace(one, one.replace("count = 1 ", "count = 2 "), 1))
    assert cli.main(["spec", "check", "--spec", str(path)]) == 0
    out = capsys.readouterr().out
    assert "placement: trainer cluster, dataprep none" in out.splitlines()
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: group 'trainer' uses a cluster placement group with 2 instance types "
        "(g5.xlarge, g6.xlarge); AWS recommends the same instance type for all instances in a "
        "cluster placement group: more than one type raises the chance of an insufficient "
        "capacity error (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/"
        "placement-strategies.html#placement-groups-cluster); list one instance type in the "
        "group, or set placement = 'none' on it"
    ]


def test_cli_check_states_what_the_network_stack_costs_and_how_to_stop_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from training import cli
    from training.network_cost import INTERFACE_ENDPOINTS, network_usd_per_month

    monkeypatch.setenv("COLUMNS", "1000")
    assert cli.main(["spec", "check", "--spec", str(REPO / "cluster.toml")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("network stack")]
    # 7 endpoints in one AZ at 0.01 USD per endpoint-AZ-hour, 730 h a month.
    assert len(INTERFACE_ENDPOINTS) == 7
    assert network_usd_per_month() == pytest.approx(51.10)
    assert lines == [
        "network stack hetero-vit-network: 7 interface endpoints x 1 AZ x 0.01 USD/h = "
        "0.07 USD/h, 51.10 USD/month while it exists, jobs or none (estimated us-east-1 rate, "
        "noted 2026-11-25, https://aws.amazon.com/privatelink/pricing/; data processed extra); "
        "stop "
        f"it: npx cdk destroy --all -c spec={REPO / 'cluster.toml'}"
    ]


def test_dataplane_churn_settings() -> None:
    doc = spec_with(
        job={
            "batch_size": 8,
            "dataplane": {"streams_per_server": 2, "refresh_s": 1, "wait_for_data_s": 30.5},
        }
    )
    dp = parse_spec(doc).job.dataplane
    assert (dp.streams_per_server, dp.refresh_s, dp.wait_for_data_s) == (2, 1.0, 30.5)
    bad = spec_with(
        job={
            "batch_size": 8,
            "dataplane": {"streams_per_server": 0, "refresh_s": 0, "wait_for_data_s": -1},
        }
    )
    assert problems(bad) == [
        "job.dataplane.refresh_s: must be a positive number of seconds, got 0.0",
        "job.dataplane.wait_for_data_s: must be a positive number of seconds, got -1.0",
        "job.dataplane.streams_per_server: must be at least 1, got 0",
    ]


def test_dataplane_server_memory() -> None:
    assert parse_spec(spec_with()).job.dataplane.server_memory_mb == 0  # derived from the host
    doc = spec_with(job={"batch_size": 8, "dataplane": {"server_memory_mb": 2048}})
    assert parse_spec(doc).job.dataplane.server_memory_mb == 2048
    bad = spec_with(job={"batch_size": 8, "dataplane": {"server_memory_mb": -1}})
    assert problems(bad) == ["job.dataplane.server_memory_mb: must be at least 0, got -1"]
    wrong_type = spec_with(job={"batch_size": 8, "dataplane": {"server_memory_mb": "1 GB"}})
    assert any("server_memory_mb" in p for p in problems(wrong_type))


# SageMaker's heterogeneous-cluster examples name groups with '_'.
SAGEMAKER_STYLE_GROUPS: list[dict[str, Any]] = [
    {"name": "dnn_group", "role": "trainer", "instance_types": ["g5.xlarge"], "count": 2},
    {"name": "data_group", "role": "dataprep", "instance_types": ["c6i.4xlarge"], "count": 1},
]


def _service_rule(service: str, shape: str) -> tuple[re.Pattern[str], int, int]:
    """(pattern, min, max) of a string shape in botocore's model of ``service``."""
    meta = botocore.session.get_session().get_service_model(service).shape_for(shape).metadata
    # The models write supplementary characters as Java's UTF-16 surrogate range; Python's re
    # wants code points.
    pattern = meta["pattern"].replace(r"\uD800\uDC00-\uDBFF\uDFFF", r"\U00010000-\U0010FFFF")
    return re.compile(pattern), meta.get("min", 0), meta["max"]


def test_group_names_may_use_underscores_where_every_aws_name_accepts_them() -> None:
    spec = parse_spec(spec_with(groups=copy.deepcopy(SAGEMAKER_STYLE_GROUPS)))
    assert [g.name for g in spec.groups] == ["dnn_group", "data_group"]
    assert spec.trainer_group.name == "dnn_group"
    # Each name a group flows into, checked against the service's own rule in botocore's model.
    derived = {
        ("sagemaker", "InstanceGroupName"): [g.name for g in spec.groups],
        ("autoscaling", "XmlStringMaxLen255"): [asg_name(spec.name, g.name) for g in spec.groups],
        ("autoscaling", "TagValue"): [g.name for g in spec.groups],
        # The container's log stream on EC2: <group>/<instance id>.
        ("logs", "LogStreamName"): [f"{g.name}/i-0123456789abcdef0" for g in spec.groups],
    }
    for (service, shape), names in derived.items():
        pattern, low, high = _service_rule(service, shape)
        for name in names:
            assert pattern.fullmatch(name) and low <= len(name) <= high, (service, shape, name)


@pytest.mark.parametrize("bad", ["Trainer", "a b", "1group", "_group", "g" * 32, "trainer\n"])
def test_bad_group_names_are_refused_by_field(bad: str) -> None:
    groups = copy.deepcopy(SAGEMAKER_STYLE_GROUPS)
    groups[1]["name"] = bad
    assert problems(spec_with(groups=groups)) == [
        f"groups[1].name: {bad!r} must start with a lowercase letter, then lowercase letters, "
        "digits, '-' or '_', 1-31 characters (e.g. 'trainer', 'dnn_group')"
    ]


@pytest.mark.parametrize("bad", ["vit_cluster", "vit\n"])
def test_cluster_name_keeps_stack_name_rule(bad: str) -> None:
    # The cluster name becomes CloudFormation stack names: no '_' there.
    assert problems(spec_with(name=bad)) == [
        f"name: {bad!r} must be lowercase letters, digits and '-', 1-31 characters"
    ]


def job_with(**job: Any) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD)
    doc["job"].update(job)
    return doc


FOLDER = {"source": "folder", "path": "/data/train"}


@pytest.mark.parametrize(
    ("job", "problem"),
    [
        ({"augmentation": "imagenet"}, "job.augmentation: 'imagenet' is not a preset; use one of"),
        ({"augmentation": {"scale": [0.5]}}, "job.augmentation.scale: expected [min, max]"),
        ({"augmentation": {"scale": [0.5, 1.5]}}, "job.augmentation.scale: area shares must be"),
        ({"augmentation": {"ratio": [2.0, 1.0]}}, "job.augmentation.ratio: expected [min, max]"),
        ({"augmentation": {"hflip": 1.5}}, "job.augmentation.hflip: must be in [0, 1], got 1.5"),
        ({"augmentation": {"vflip": -0.1}}, "job.augmentation.vflip: must be in [0, 1]"),
        ({"augmentation": {"color_jitter": [0.1, 0.2]}}, "job.augmentation.color_jitter: expe"),
        ({"augmentation": {"auto_augment": "randaug"}}, "job.augmentation.auto_augment: 'rand"),
        ({"augmentation": {"interpolation": "lanczos"}}, "job.augmentation.interpolation: 'la"),
        ({"augmentation": {"re_prob": 2}}, "job.augmentation.re_prob: must be in [0, 1], got 2"),
        ({"augmentation": {"re_mode": "zero"}}, "job.augmentation.re_mode: 'zero' is not valid"),
        ({"augmentation": {"re_count": 0}}, "job.augmentation.re_count: must be at least 1"),
        ({"augmentation": {"preset": "none", "hflip": 0.5}}, "job.augmentation.preset: 'none' o"),
        ({"augmentation": {"hflp": 0.5}}, "job.augmentation.hflp: unknown key (did you mean 'hf"),
        ({"optimizer": "adagrad"}, "job.optimizer: 'adagrad' is not valid; use one of 'adamw', "),
        ({"schedule": "step"}, "job.schedule: 'step' is not valid; use one of 'cosine', 'cons"),
        ({"min_lr": 0.1, "lr": 0.01}, "job.min_lr: must be in [0, lr = 0.01], got 0.1"),
        ({"clip_grad_norm": -1.0}, "job.clip_grad_norm: must be > 0 (or 0: no clipping)"),
        ({"label_smoothing": 0.7}, "job.label_smoothing: must be in [0, 0.5], got 0.7"),
        ({"weight_decay": -0.1}, "job.weight_decay: must be >= 0, got -0.1"),
        ({"momentum": 1.5}, "job.momentum: must be in [0, 1], got 1.5"),
        ({"mixup": {"mixup_alpha": -1.0}}, "job.mixup.mixup_alpha: must be >= 0 (0: off)"),
        ({"mixup": {"prob": 0.5}}, "job.mixup: set mixup_alpha and/or cutmix_alpha above 0"),
        ({"mixup": {"cutmix_alpha": 1.0, "mode": "row"}}, "job.mixup.mode: 'row' is not valid"),
        ({"mixup": {"mixup_alpha": 0.8}, "batch_size": 7}, "job.batch_size: 7 is odd, but tim"),
        ({"ema": {"decay": 1.0}}, "job.ema.decay: must be in [0, 0.999999], got 1"),
        ({"ema": {}}, ""),  # an empty table is no EMA (and no problem)
        ({"ema": {"enabled": True}}, "job.ema.decay: missing; e.g. decay = 0.999"),
        ({"eval": {"every_steps": 10}}, "job.eval: no validation set to evaluate on; set job"),
        ({"accuracy_targets": [0.8, 1.2]}, "job.accuracy_targets[1]: expected a top-1 share in"),
        ({"accuracy_targets": [0.8]}, "job.accuracy_targets: need a validation set; set job"),
        ({"dataset": {"val_fraction": 0.6}}, "job.dataset.val_fraction: must be in [0, 0.5], go"),
        ({"dataset": {"val_path": "/v"}}, "job.dataset.val_path: source 'synthetic' has no fol"),
        (
            {"dataset": {**FOLDER, "val_path": "/v", "val_fraction": 0.1}},
            "job.dataset.val_fraction: set either val_path (a validation folder or prefix) or",
        ),
        (
            {"dataset": {**FOLDER, "val_path": "s3://b/val/"}},
            "job.dataset.val_path: source 'folder' needs val_path = a local folder",
        ),
        (
            {"dataset": {**FOLDER, "val_path": "/data/train/"}},
            "job.dataset.val_path: is the training path; validation must be other images",
        ),
        (
            {"dataset": {"source": "s3", "path": "s3://b/t/", "val_path": "/v"}},
            "job.dataset.val_path: source 's3' needs val_path = 's3://bucket/prefix/'",
        ),
        ({"model": {"init": " "}}, "job.model.init: empty; give a weights file or hub-form"),
        (
            {"model": {"init": "timm:vit_base_patch16_224"}},
            "job.model.init: 'timm:vit_base_patch16_224' is not timm:NAME.TAG: give a timm model "
            "name with its pretrained tag, e.g. timm:vit_base_patch16_224.augreg2_in21k_ft_in1k",
        ),
        ({"model": {"init_ema": False}}, "job.model.init_ema: only applies with init"),
        ({"model": {"mean": [0.5, 0.5]}}, "job.model.mean: expected [R, G, B], each in [0, 1]"),
        ({"model": {"std": [0.5, 0, 0.5]}}, "job.model.std: expected [R, G, B], each in (0, 1]"),
        ({"eval": {"crop_pct": 0}}, "job.eval.crop_pct: must be in (0, 1], got 0"),
        ({"eval": {"at_start": "yes"}}, "job.eval.at_start: expected bool"),
    ],
)
def test_every_recipe_and_validation_value_is_refused_with_its_fix(
    job: dict[str, Any], problem: str
) -> None:
    if not problem:
        assert not parse_spec(job_with(**job)).job.ema.enabled
        return
    found = problems(job_with(**job))
    assert any(p.startswith(problem) for p in found), found


def test_ema_needs_ddp() -> None:
    doc = job_with(ema={"decay": 0.999}, parallelism={"strategy": "fsdp"})
    assert problems(doc) == [
        "job.ema: weight EMA keeps a full copy of the model on every rank, which strategy 'fsdp' "
        "exists to avoid; use strategy = 'ddp' or remove [job.ema]"
    ]


@pytest.mark.parametrize(
    ("job", "problem"),
    [
        (
            {"lr": 1e-3, "lr_base": 1e-3},
            "job.lr_base: set either lr (the peak learning rate) or lr_base (the rate at a global "
            "batch of lr_base_size, scaled to the job's), not both",
        ),
        ({"lr_base": 0.0}, "job.lr_base: must be positive, got 0.0"),
        (
            {"lr_base_size": 512},
            "job.lr_base_size: only applies with lr_base; set lr_base or remove it",
        ),
        (
            {"lr_base_scale": "sqrt"},
            "job.lr_base_scale: only applies with lr_base; set lr_base or remove it",
        ),
        (
            {"lr_base": 1e-3, "lr_base_scale": "log"},
            "job.lr_base_scale: 'log' is not valid; use one of 'linear', 'sqrt'",
        ),
        ({"lr_base": 1e-3, "lr_base_size": 0}, "job.lr_base_size: must be at least 1, got 0"),
        (
            # 2 ranks x 8 = 16 samples: sqrt(16 / 256) x 1e-3 = 2.5e-4, under min_lr.
            {"lr_base": 1e-3, "min_lr": 5e-4},
            "job.min_lr: must be at most the peak learning rate, 0.00025 (lr_base 0.001 scaled to "
            "the global batch of 16), got 0.0005; lower min_lr or raise lr_base",
        ),
        (
            {"layer_decay": 0.0},
            "job.layer_decay: must be in (0, 1] (e.g. 0.75; 1: every layer at the full rate), got "
            "0",
        ),
        (
            {"layer_decay": 1.5},
            "job.layer_decay: must be in (0, 1] (e.g. 0.75; 1: every layer at the full rate), got "
            "1.5",
        ),
        ({"max_nonfinite_steps": 0}, "job.max_nonfinite_steps: must be at least 1, got 0"),
        ({"model": {"drop_path_rate": 1.0}}, "job.model.drop_path_rate: must be in [0, 1), got 1"),
        ({"model": {"drop_rate": -0.1}}, "job.model.drop_rate: must be in [0, 1), got -0.1"),
        (
            {"model": {"drop_path_rate": 0.1, "overrides": {"drop_path_rate": 0.2}}},
            "job.model.drop_path_rate: also set as job.model.overrides.drop_path_rate; set it "
            "once: keep job.model.drop_path_rate and remove the override",
        ),
        (
            {"ema": {"decay": 0.999, "warmup_power": 0.75}},
            "job.ema.warmup_power: only applies with warmup = true; set warmup = true or remove it",
        ),
        (
            {"ema": {"decay": 0.999, "warmup": True, "warmup_power": 1.5}},
            "job.ema.warmup_power: must be in (0, 1] (timm: 2/3 for long runs, 3/4 for shorter "
            "ones), got 1.5",
        ),
        (
            {"ema": {"decay": 0.999, "warmup": True, "warmup_gamma": 0}},
            "job.ema.warmup_gamma: must be positive (timm: 1), got 0",
        ),
        ({"ema": {"decay": 0.999, "warmup": 1}}, "job.ema.warmup: expected bool, got int 1"),
    ],
)
def test_every_fine_tuning_value_is_refused_with_its_fix(job: dict[str, Any], problem: str) -> None:
    assert problems(job_with(**job)) == [problem]


def test_a_fine_tuning_recipe_parses_into_its_fields() -> None:
    job = parse_spec(
        job_with(
            lr_base=5e-4,
            lr_base_size=1024,
            lr_base_scale="linear",
            layer_decay=0.65,
            max_nonfinite_steps=5,
            model={"drop_path_rate": 0.1, "drop_rate": 0.0},
            ema={"decay": 0.9998, "warmup": True, "warmup_power": 0.75},
        )
    ).job
    assert (job.lr_base, job.lr_base_size, job.lr_base_scale) == (5e-4, 1024, "linear")
    # GOOD: 2 trainer ranks x batch 8 = 16 samples per step, linear: 5e-4 x 16 / 1024.
    assert job.peak_lr(2) == 5e-4 * 16 / 1024 and job.global_batch(2) == 16
    assert (job.layer_decay, job.max_nonfinite_steps) == (0.65, 5)
    assert (job.model.drop_path_rate, job.model.drop_rate) == (0.1, 0.0)
    assert (job.ema.warmup, job.ema.warmup_power, job.ema.warmup_gamma) == (True, 0.75, 1.0)
    plain = parse_spec(GOOD).job
    assert (plain.lr_base, plain.layer_decay, plain.max_nonfinite_steps) == (None, None, 3)
    assert (plain.model.drop_path_rate, plain.ema.warmup) == (None, False)
    assert plain.peak_lr(2) == plain.lr == 1e-3


def test_a_full_recipe_parses_into_its_fields() -> None:
    job = parse_spec(
        job_with(
            augmentation={
                "preset": "randaugment",
                "scale": [0.5, 1],
                "hflip": 0,
                "color_jitter": [0.4, 0.4, 0.4],
                "interpolation": "bicubic",
                "re_prob": 0.25,
            },
            optimizer="lamb",
            schedule="cosine",
            min_lr=1e-6,
            clip_grad_norm=1,
            label_smoothing=0.1,
            mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "prob": 0.5},
            ema={"decay": 0.999},
            eval={"every_steps": 50, "crop_pct": 0.9},
            accuracy_targets=[0.9, 0.5],
            dataset={"source": "folder", "path": "/d/train", "val_path": "/d/val"},
            model={"name": "vit_small_patch16_224", "init": "s3://b/model.safetensors"},
        )
    ).job
    aug = job.augmentation
    assert (aug.preset.value, aug.scale, aug.hflip, aug.color_jitter) == (
        "randaugment", (0.5, 1.0), 0.0, (0.4, 0.4, 0.4),
    )  # fmt: skip
    assert aug.describe().startswith("randaugment(scale=(0.5, 1.0), hflip=0.0")
    assert (job.optimizer.value, job.min_lr, job.clip_grad_norm) == ("lamb", 1e-6, 1.0)
    assert (job.mixup.cutmix_alpha, job.mixup.prob, job.ema.decay) == (1.0, 0.5, 0.999)
    assert (job.eval.every_steps, job.eval.crop_pct, job.accuracy_targets) == (50, 0.9, (0.5, 0.9))
    assert job.dataset.val_path == "/d/val" and job.model.init == "s3://b/model.safetensors"


def test_the_data_config_fields_parse_and_default_to_the_weights() -> None:
    job = parse_spec(GOOD).job
    # Unset: the trainer takes them from job.model.init's weights, else its own defaults.
    assert (job.model.mean, job.model.std, job.eval.crop_pct, job.eval.interpolation) == (
        None, None, None, None,
    )  # fmt: skip
    assert job.model.init_ema and not job.eval.at_start
    job = parse_spec(
        job_with(
            model={"init": "/w/model_best.pth.tar", "init_ema": False, "mean": [0.5, 0.5, 0.5],
                   "std": [0.5, 0.5, 0.5]},
            eval={"at_start": True, "crop_pct": 0.95, "interpolation": "bicubic"},
            dataset={"val_fraction": 0.1},
        )
    ).job  # fmt: skip
    assert (job.model.init_ema, job.model.mean, job.model.std) == (False, (0.5,) * 3, (0.5,) * 3)
    assert (job.eval.at_start, job.eval.crop_pct, job.eval.interpolation) == (
        True, 0.95, "bicubic",
    )  # fmt: skip


def test_budget_caps_parse_and_default_to_none() -> None:
    job = dict(GOOD["job"])
    assert parse_spec(GOOD).job.max_hours is None and parse_spec(GOOD).job.max_usd is None
    spec = parse_spec(spec_with(job={**job, "max_hours": 12, "max_usd": 40.5}))
    assert (spec.job.max_hours, spec.job.max_usd) == (12.0, 40.5)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "max_usd",
            0,
            "job.max_usd: must be a positive number of USD, got 0.0; remove it for no cap",
        ),
        ("max_usd", -3.5, "job.max_usd: must be a positive number of USD, got -3.5"),
        ("max_hours", float("inf"), "job.max_hours: must be a positive number of hours, got inf"),
        ("max_hours", float("nan"), "job.max_hours: must be a positive number of hours, got nan"),
        ("max_usd", "10", "job.max_usd: expected float, got str '10'"),
        ("max_hours", True, "job.max_hours: expected float, got bool True"),
    ],
)
def test_budget_caps_refuse_bad_values(key: str, value: Any, message: str) -> None:
    found = problems(spec_with(job={**dict(GOOD["job"]), key: value}))
    assert [p for p in found if p.startswith(f"job.{key}")] == [
        p for p in found if p.startswith(message)
    ]
    assert any(p.startswith(message) for p in found)


def test_cli_check_shows_an_elastic_groups_min_max_beside_its_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from training import cli

    monkeypatch.setenv("COLUMNS", "1000")  # one line per row: no wrapping
    text = (REPO / "cluster.toml").read_text()
    dataprep = text.index('role = "dataprep"')
    count = text.index("count = ", dataprep)
    end = text.index("\n", count)
    path = tmp_path / "elastic.toml"
    path.write_text(text[:end] + "\nmin_count = 1\nmax_count = 4" + text[end:])
    assert load_spec(path).group("dataprep").elastic
    assert cli.main(["spec", "check", "--spec", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    [row] = [line for line in out if "dataprep" in line and "│" in line]
    cells = [c.strip() for c in row.split("│")]
    assert f"{load_spec(path).group('dataprep').count} (1-4)" in cells
    [trainer] = [line for line in out if "trainer" in line and "│" in line]
    assert "(" not in trainer.split("│")[4]  # a fixed group: its count alone
    # 4 servers x 2 batches a range fill the default window of 8; a fifth would wait.
    assert not [line for line in out if "prefetch_batches" in line]
    path.write_text(text[:end] + "\nmin_count = 1\nmax_count = 5" + text[end:])
    assert cli.main(["spec", "check", "--spec", str(path)]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if "prefetch_batches" in line]
    assert warned == [f"warning: {load_spec(path).window_warning}"]
    assert "set prefetch_batches = 10 " in warned[0]


def test_cli_check_prices_each_group_at_its_most_offline_and_says_what_the_cap_leaves_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from training import cli

    monkeypatch.setenv("COLUMNS", "1000")  # one line per row: no wrapping
    # No AWS: spec check prices from the dated catalogue, never asking (no credentials here).
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    text = (REPO / "cluster.toml").read_text()
    count = text.index("count = ", text.index('role = "dataprep"'))
    end = text.index("\n", count)
    path = tmp_path / "elastic.toml"
    path.write_text(text[:end] + "\nmin_count = 1\nmax_count = 4" + text[end:])
    assert cli.main(["spec", "check", "--spec", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index(
        "prices at their most (what job.max_usd bounds; the catalogue's are us-east-1 On-Demand "
        "list prices of 2026-07-20, Spot = 0.35 x On-Demand; hetero job start records the day's "
        "prices from AWS instead):"
    )
    # cluster.toml: 1 Spot trainer of g5.xlarge (1.006, dearer than g6.xlarge's 0.8048) and
    # the dataprep group at max_count 4 of c7i.4xlarge (0.714, dearer than c6i.4xlarge's 0.68).
    assert out[start + 1 : start + 6] == [
        "  group     at its most      market  USD/h each  USD/h   source, as of",
        "  trainer   1 x g5.xlarge    spot    0.3521      0.3521  catalogue, 2026-07-20",
        "  dataprep  4 x c7i.4xlarge  spot    0.2499      0.9996  catalogue, 2026-07-20",
        "  total at its most: 1.3517 USD/h",
        "not in job.max_usd: EBS root volumes (billed per GB-month while they exist), data "
        "transfer, and the network stack's interface endpoints:",
    ]
    assert out[start + 6].startswith("network stack hetero-vit-network: 7 interface endpoints")
    [dataprep] = [line for line in out if "dataprep" in line and "│" in line]
    assert dataprep.split("│")[-2].strip() == "1.00"  # the table's max USD/h: 4 x 0.2499


def test_cli_check_refuses_local_init_weights_the_trainer_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing file and a file in no format timm reads: exit 2 with the field and the fix,
    before anything is deployed (``training.trainer.model.check_init``)."""
    from training import cli

    text = (REPO / "cluster.toml").read_text()
    assert "\n[job.model]\n" in text
    junk = tmp_path / "weights.safetensors"
    junk.write_bytes(b"not a safetensors file")
    for init in (tmp_path / "missing.safetensors", junk):
        path = tmp_path / "init.toml"
        path.write_text(text.replace("\n[job.model]\n", f'\n[job.model]\ninit = "{init}"\n', 1))
        assert cli.main(["spec", "check", "--spec", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"job.model.init = '{init}'" in err, err
