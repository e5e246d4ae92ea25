"""EFA launch-template layouts (``infra/efa.py``) as pure functions: the exact interface lists
AWS documents for p4d and p5 (ENA primary, EFA-only on card 0 device 1 and on device 0 of every
other card, each in the cluster security group), and one layout per distinct network-card
count in a group that mixes EFA types."""

from __future__ import annotations

from typing import Any

import pytest

from infra.efa import EfaLayout, efa_layouts, efa_network_interfaces, layout_for
from training.spec import Efa, InstanceGroup, Role

SG = "sg-0123456789abcdef0"


def nic(card: int, device: int, kind: str) -> dict[str, Any]:
    return {
        "NetworkCardIndex": card,
        "DeviceIndex": device,
        "InterfaceType": kind,
        "Groups": [SG],
        "DeleteOnTermination": True,
    }


def test_p4d_gets_an_ena_primary_and_one_efa_only_interface_per_card() -> None:
    assert efa_network_interfaces("p4d.24xlarge", SG) == [
        nic(0, 0, "interface"),
        nic(0, 1, "efa-only"),
        nic(1, 0, "efa-only"),
        nic(2, 0, "efa-only"),
        nic(3, 0, "efa-only"),
    ]


def test_p5_gets_32_efa_only_interfaces_as_in_awss_use_case_1() -> None:
    expected = [nic(0, 0, "interface"), nic(0, 1, "efa-only")]
    expected += [nic(card, 0, "efa-only") for card in range(1, 32)]
    interfaces = efa_network_interfaces("p5.48xlarge", SG)
    assert interfaces == expected
    assert len(interfaces) == 33
    # Exactly one interface has an IP address (the ENA primary); every card has one EFA device.
    assert [n for n in interfaces if n["InterfaceType"] != "efa-only"] == [nic(0, 0, "interface")]
    assert sorted(n["NetworkCardIndex"] for n in interfaces[1:]) == list(range(32))


def test_a_single_card_type_gets_the_primary_and_one_efa_only_interface() -> None:
    assert efa_network_interfaces("g5.8xlarge", SG) == [
        nic(0, 0, "interface"),
        nic(0, 1, "efa-only"),
    ]


def test_every_interface_carries_the_given_security_group() -> None:
    for interface in efa_network_interfaces("p5.48xlarge", "sg-other"):
        assert interface["Groups"] == ["sg-other"]


def test_types_without_efa_or_unknown_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^g5\.xlarge has no EFA: remove it from the group"):
        layout_for("g5.xlarge")
    with pytest.raises(ValueError, match=r"^p9\.48xlarge is not in training/instance_types\.py"):
        layout_for("p9.48xlarge")
    with pytest.raises(ValueError, match="at least one network card"):
        EfaLayout(0)


def test_a_mixed_group_gets_one_layout_per_network_card_count_in_preference_order() -> None:
    group = InstanceGroup(
        "trainer",
        Role.TRAINER,
        ("p5.48xlarge", "p4d.24xlarge", "p4de.24xlarge", "p3dn.24xlarge"),
        count=2,
        efa=Efa.ON,
    )
    layouts = efa_layouts(group)
    assert layouts == {
        EfaLayout(32): ["p5.48xlarge"],
        EfaLayout(4): ["p4d.24xlarge", "p4de.24xlarge"],
        EfaLayout(1): ["p3dn.24xlarge"],
    }
    assert list(layouts) == [EfaLayout(32), EfaLayout(4), EfaLayout(1)]
    assert [layout.name for layout in layouts] == ["Efa32Cards", "Efa4Cards", "Efa1Cards"]
    # Each layout is the one its types get on their own.
    for layout, types in layouts.items():
        for name in types:
            assert layout.network_interfaces(SG) == efa_network_interfaces(name, SG)


@pytest.mark.parametrize(
    ("types", "mode"),
    [
        (("p4d.24xlarge", "p5.48xlarge"), Efa.OFF),  # EFA types, EFA turned off
        (("p4d.24xlarge", "g5.xlarge"), Efa.AUTO),  # auto and one type without EFA: no EFA
    ],
)
def test_a_group_without_efa_has_no_layouts(types: tuple[str, ...], mode: Efa) -> None:
    group = InstanceGroup("trainer", Role.TRAINER, types, count=1, efa=mode)
    assert efa_layouts(group) == {}
