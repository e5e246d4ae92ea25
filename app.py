"""CDK app: reads the cluster spec and creates its stacks; nothing else.

Usage: ``npx cdk synth -c spec=cluster.toml [-c destroy_checkpoints=true]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import aws_cdk as cdk

from infra.assembly import create_stacks
from infra.nag import add_nag_checks
from training.spec import SpecError, load_spec


def main() -> int:
    app = cdk.App()
    spec_path = Path(str(app.node.try_get_context("spec") or "cluster.toml"))
    destroy = str(app.node.try_get_context("destroy_checkpoints")).lower() == "true"
    try:
        spec = load_spec(spec_path)
        add_nag_checks(app)
        # SpecError here too: a timm: init the Hugging Face cache or Hub cannot give.
        create_stacks(app, spec=spec, spec_text=spec_path.read_text(), destroy_checkpoints=destroy)
    except SpecError as e:
        # Fail before anything is synthesized: the message names each field and its fix.
        print(f"cdk synth stopped: {e}", file=sys.stderr)
        return 2
    app.synth()
    return 0


if __name__ == "__main__":
    sys.exit(main())
