"""What a fresh interpreter has imported after running some code: for the tests that pin which
modules a process loads (the launcher without torch, the person's commands without the
instance's loop). Fresh, so an import anywhere in the chain counts."""

from __future__ import annotations

import json
import subprocess
import sys


def loaded_modules(*code: str) -> set[str]:
    """The names in ``sys.modules`` of a new interpreter after it ran ``code`` (lines)."""
    probe = "\n".join([*code, "import json, sys", "print(json.dumps(sorted(sys.modules)))"])
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))
