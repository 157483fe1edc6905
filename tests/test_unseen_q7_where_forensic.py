"""The torch.where trap with a raw Linear output, ``torch.where(h > 0, torch.sqrt(h), 0)``:
half of ``h`` is negative, sqrt makes NaN there in forward, the where keeps it from the loss,
and backward multiplies where's 0 gradient by it: NaN. Watch and sentinel name it NW407 with
the double where; forensic traced the forward sqrt as the anomaly's op (no backward op made
the NaN, each was given it) and said NW112 with a softplus reparameterization, which changes
the function the user guarded on purpose. Forensic now says NW407 and the double where too,
and the double where trains clean in every mode."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

import nanwatch

_SOURCE = """
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        h = self.fc(x)
        {line}
        return y.sum(-1)
"""

TRAPS = {
    "sqrt": (
        "y = torch.where(h > 0, torch.sqrt(h), 0.0)",
        "y = torch.where(h > 0, torch.sqrt(torch.where(h > 0, h, 1.0)), 0.0)",
    ),
}


def _load(tmp_path: Path, name: str, line: str) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(_SOURCE).format(line=line))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


def _train(model: torch.nn.Module, mode: str) -> nanwatch.Watcher:
    torch.manual_seed(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = torch.randn(16, 4)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


_LATE = pytest.mark.gpu_bound_weaker(
    reason="nothing has landed when backward begins: what the sqrt's node saved is freed "
    "before it is read (NW302 in sentinel, NW100 in watch)"
)


@pytest.mark.parametrize("op", sorted(TRAPS))
@pytest.mark.parametrize(
    "mode", [pytest.param("sentinel", marks=_LATE), pytest.param("watch", marks=_LATE), "forensic"]
)
def test_every_mode_says_the_hidden_nan_and_gives_the_double_where(
    tmp_path: Path, mode: str, op: str
) -> None:
    trap, fixed = TRAPS[op]
    torch.manual_seed(0)
    nw = _train(_load(tmp_path, f"trap_{op}_{mode}", trap).Gate(), mode)
    diags = nw.history[0].diagnoses
    assert diags, nw.first_anomaly and nw.first_anomaly.summary
    assert diags[0].code == "NW407", [(d.code, d.title) for d in diags]
    assert diags[0].fix.split("   #")[0] == fixed, diags[0].fix
    # no reparameterization of a value the where already guards
    assert not any("softplus" in d.fix for d in diags), [d.fix for d in diags]


@pytest.mark.parametrize("op", sorted(TRAPS))
@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_the_double_where_trains_clean(tmp_path: Path, mode: str, op: str) -> None:
    torch.manual_seed(0)
    model = _load(tmp_path, f"fixed_{op}_{mode}", TRAPS[op][1]).Gate()
    nw = _train(model, mode)
    assert nw.first_anomaly is None, nw.first_anomaly.summary
    assert nw.report.diagnoses == [], [d.headline for d in nw.report.diagnoses]
    assert all(torch.isfinite(p).all() for p in model.parameters())
