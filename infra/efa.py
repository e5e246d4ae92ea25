"""EFA network interfaces for a launch template, laid out the way AWS documents per instance type.

AWS's recommended configuration for EFA instance types, including those with several network
cards (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html):

- the primary interface (network card 0, device index 0) is an ENA interface
  (``InterfaceType: interface``): an EFA-only interface cannot be the primary one;
- when network card 0 supports EFA, an EFA-only interface on network card 0, device index 1;
- on every further network card, an EFA-only interface on device index 0.

For p5/p5e (32 network cards) this is the page's "Use case 1": 32 EFA devices (up to 3,200 Gbps
of EFA bandwidth) and one private IP address per instance, which also avoids the Linux routing
problems of several IP interfaces. p4d/p4de get the same shape over their 4 cards: 4 EFA
devices, one IP address. Every EFA type in ``training.instance_types.CATALOG`` has EFA on
network card 0; types whose card 0 is ENA-only (the same page names P6-B300) would need a
catalogue field before they can be listed.

One launch template holds one layout, so a group whose types differ in network cards (e.g.
p4d.24xlarge and p5.48xlarge) needs one template per layout (``efa_layouts``), each attached to
its types through the mixed-instances policy's per-override launch template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training import instance_types
from training.spec import InstanceGroup

DOC_URL = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html"


@dataclass(frozen=True, order=True)
class EfaLayout:
    """The network-interface layout shared by every instance type with this many EFA cards."""

    network_cards: int
    """Network cards that carry an EFA device (one EFA-only interface each)."""

    def __post_init__(self) -> None:
        if self.network_cards < 1:
            raise ValueError(
                f"an EFA layout needs at least one network card, got {self.network_cards}"
            )

    @property
    def name(self) -> str:
        """A short name usable in construct ids (``Efa4Cards``)."""
        return f"Efa{self.network_cards}Cards"

    def network_interfaces(self, security_group_id: str) -> list[dict[str, Any]]:
        """``LaunchTemplateData.NetworkInterfaces``: the ENA primary, then one EFA-only interface
        per card (device 1 on card 0, device 0 on the others), each in ``security_group_id``
        (with interfaces in the template, EC2 refuses top-level security groups)."""
        primary = _interface(0, 0, "interface", security_group_id)
        efa = [
            _interface(card, 1 if card == 0 else 0, "efa-only", security_group_id)
            for card in range(self.network_cards)
        ]
        return [primary, *efa]


def _interface(card: int, device: int, kind: str, security_group_id: str) -> dict[str, Any]:
    return {
        "NetworkCardIndex": card,
        "DeviceIndex": device,
        "InterfaceType": kind,
        "Groups": [security_group_id],
        "DeleteOnTermination": True,
    }


def layout_for(instance_type: str) -> EfaLayout:
    """The layout for ``instance_type``; ValueError (naming the fix) for a type the catalogue
    does not know or that has no EFA."""
    entry = instance_types.lookup(instance_type)
    if entry is None:
        raise ValueError(
            f"{instance_type} is not in training/instance_types.py CATALOG: add it (with its "
            "EFA network-card count from `aws ec2 describe-instance-types`) or choose a listed type"
        )
    if not entry.supports_efa:
        raise ValueError(
            f"{instance_type} has no EFA: remove it from the group or set the group's efa = 'off'"
        )
    return EfaLayout(entry.efa_network_cards)


def efa_network_interfaces(instance_type: str, security_group_id: str) -> list[dict[str, Any]]:
    """The launch template's network interfaces for ``instance_type`` (see the module docstring;
    AWS's layout: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html)."""
    return layout_for(instance_type).network_interfaces(security_group_id)


def efa_layouts(group: InstanceGroup) -> dict[EfaLayout, list[str]]:
    """The group's instance types by EFA layout, both in the group's order of preference: one
    launch template per key. Empty when the group does not use EFA (``efa = "off"``, or a type
    without EFA under ``auto``)."""
    if not group.use_efa:
        return {}
    layouts: dict[EfaLayout, list[str]] = {}
    for name in group.instance_types:
        layouts.setdefault(layout_for(name), []).append(name)
    return layouts
