"""The smallest cluster the rehearsal's and the launcher's moto tests provision: two trainer
instances and one dataprep instance, a few steps."""

from __future__ import annotations

SMALL_SPEC = """
name = "{name}"

[[groups]]
name = "trainer"
role = "trainer"
instance_types = ["g5.xlarge"]
count = 2

[[groups]]
name = "dataprep"
role = "dataprep"
instance_types = ["c6i.4xlarge"]
count = 1

[job]
steps = 4
"""


def small_spec_text(name: str = "tiny") -> str:
    return SMALL_SPEC.format(name=name)
