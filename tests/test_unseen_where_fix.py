"""A NaN in the branch a torch.where discards comes back in backward (NW407): the fix must
be code that, pasted in place of the user's line, trains with finite gradients. For an op
given a finite value outside its domain (sqrt of a negative), cleaning its input with
nan_to_num changes nothing; the "double where" (the op's argument through the same
condition, with a value the op is finite at) does. Each fix is executed here."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

import nanwatch

#: each model's forward: one line, the one the fix rewrites (``{line}``)
_MODELS = {
    # sqrt of a negative in the unselected branch (a "safe" sqrt that is not)
    "sqrt_in_where": "return torch.where(z > 0, torch.sqrt(z), torch.zeros_like(z))",
    # a ratio whose denominator is a sqrt, NaN where the other branch is taken
    "sqrt_denominator": (
        "return torch.where(z.abs() < 1, torch.ones_like(z), z.abs().log() / (z.abs() - 1).sqrt())"
    ),
    # a method-call sqrt of a difference, the value kept in the first branch
    "method_sqrt": "return torch.where(z > 0.5, (z - 0.5).sqrt(), z * 0)",
}

_SOURCE = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        z = self.lin(x)
        {line}
"""


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


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).pow(2).mean().backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
@pytest.mark.parametrize("case", sorted(_MODELS))
def test_the_hidden_nan_fix_trains_with_finite_gradients(
    tmp_path: Path, case: str, mode: str
) -> None:
    torch.manual_seed(0)
    mod = _load(tmp_path, f"where_{case}_{mode}", _MODELS[case])
    model = mod.Model()
    x = torch.randn(32, 4)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        loss = model(x).pow(2).mean()
        loss.backward()
        nw.step()
    assert torch.isfinite(loss)
    diags = [d for t in nw.history for d in t.diagnoses]
    d = next((d for d in diags if d.code == "NW407"), None)
    assert d is not None, [(x.code, x.title) for x in diags]
    first = d.fix.splitlines()[0].split("   #")[0]
    assert first.startswith("return torch.where("), d.fix
    assert "nan_to_num" not in first, d.fix

    fixed = _load(tmp_path, f"fixed_{case}_{mode}", first).Model()
    fixed.load_state_dict(model.state_dict())
    grads = _grads(fixed, x)
    assert grads and all(torch.isfinite(g).all() for g in grads), first
    # the same function: the rows kept are computed as before
    with torch.no_grad():
        assert torch.equal(fixed(x), model(x)), first


def test_a_nan_target_in_a_where_gets_the_difference_through_the_condition() -> None:
    """A NaN that came in with the data (a missing target) in the discarded branch, the
    op's line known: the difference is passed through the condition (nothing in it has a
    restricted domain), and the rewritten line trains with finite gradients."""
    from nanwatch.records import OpEvent, Phase, TensorStat
    from nanwatch.rules.masking import _hidden_nan_fix

    nan = TensorStat(float("nan"), float("nan"), 16, nan=7)
    code = "loss = torch.where(mask, (p - y) ** 2, torch.zeros_like(p)).mean()"
    ev = OpEvent("aten.pow.Tensor_Scalar", Phase.BACKWARD, "(loss)", "NaN", nan,
                 [("self", nan)], code=code)  # fmt: skip
    first = _hidden_nan_fix(ev, {"self"}).splitlines()[0].split("   #")[0]
    assert first == (
        "loss = torch.where(mask, (torch.where(mask, p - y, 1.0)) ** 2, torch.zeros_like(p)).mean()"
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    mask = torch.rand(16, 1) > 0.3
    y[~mask] = float("nan")
    scope = {"torch": torch, "mask": mask, "p": model(x), "y": y}
    exec(first, scope)
    scope["loss"].backward()
    assert all(torch.isfinite(q.grad).all() for q in model.parameters())


def test_a_line_without_torch_where_keeps_the_nan_to_num_rewrite() -> None:
    """A NaN zeroed by a mask product (no torch.where on the line): the NaN input is
    cleaned, as before."""
    from nanwatch.records import OpEvent, Phase, TensorStat
    from nanwatch.rules.masking import _hidden_nan_fix

    nan = TensorStat(float("nan"), float("nan"), 16, nan=7)
    ev = OpEvent("aten.sub.Tensor", Phase.BACKWARD, "(loss)", "NaN", nan,
                 [("other", nan)], code="err = (pred - gt).norm(dim=-1)")  # fmt: skip
    assert _hidden_nan_fix(ev, {"other"}).startswith("err = (pred - torch.nan_to_num(gt))")
