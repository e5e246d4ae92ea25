"""Are two runs' final parameters equal, bit for bit?

A checkpoint is a torch.distributed.checkpoint (DCP) folder ``step-N/`` holding ``model``,
``optim`` and ``train``; ``load_model_tensors`` reads its model entries in this one process (no
process group, no model object needed) and ``compare`` checks every tensor with ``torch.equal``.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODEL_KEY = "model"


@dataclass
class ParamComparison:
    equal: bool
    tensors: int
    """Model tensors compared."""
    differing: list[str] = field(default_factory=list)
    only_in_one: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def load_model_tensors(step_dir: Path) -> dict[str, Any]:
    """Every tensor under the checkpoint's ``model`` entry, by dotted name."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="hetero-params-") as tmp:
        saved = Path(tmp) / "state.pt"
        dcp_to_torch_save(step_dir, saved)
        state = torch.load(saved, map_location="cpu", weights_only=False)
    flat: dict[str, Any] = {}
    _flatten("", state, flat)
    prefix = MODEL_KEY + "."
    return {
        k[len(prefix) :]: v
        for k, v in flat.items()
        if k.startswith(prefix) and isinstance(v, torch.Tensor)
    }


def compare(a: Path, b: Path) -> ParamComparison:
    """Every model tensor of checkpoint folder ``a`` against ``b`` with ``torch.equal``."""
    import torch

    try:
        ta, tb = load_model_tensors(a), load_model_tensors(b)
    except Exception as e:  # a torn or foreign folder: report it, do not crash the report
        return ParamComparison(False, 0, error=f"{type(e).__name__}: {e}")
    names = sorted(ta.keys() & tb.keys())
    differing = [n for n in names if not torch.equal(ta[n], tb[n])]
    only = sorted(ta.keys() ^ tb.keys())
    return ParamComparison(
        equal=bool(names) and not differing and not only,
        tensors=len(names),
        differing=differing,
        only_in_one=only,
        error=None if names else "no model tensors found",
    )
