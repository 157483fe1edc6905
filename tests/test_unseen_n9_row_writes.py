"""Writes after the update that divide a weight row by row: a renormalization
``w /= w.norm(dim=1, keepdim=True)`` of an all-zero row, a codebook mean by a count of 0.
Outside forensic mode no op is traced; the NaN filling whole rows, every other row
finite, names the per-row 0 / 0 and a guarded norm (NW301), where it said "other code
wrote it: an EMA, a load_state_dict ..."."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import code_lines, first_bad, text


class Bag(nn.Module):
    """Token ids -> mean embedding -> MLP; row 7 of the table is all zero (a padding row
    that is never looked up)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 1)
        with torch.no_grad():
            self.emb.weight[7].zero_()

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.emb(i).mean(1))))


def _train(mode: str, renorm: Callable[[nn.Module], None], steps: int = 3) -> Any:
    torch.manual_seed(0)
    model, crit = Bag(), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            i = torch.randint(0, 50, (16, 6))
            i[i == 7] = 8  # the padding row is never looked up: it stays 0
            crit(model(i), torch.randn(16, 1)).backward()
            opt.step()
            opt.zero_grad()
            renorm(model)
            nw.step()
    return nw


def _renorm(model: nn.Module) -> None:
    with torch.no_grad():
        model.emb.weight /= model.emb.weight.norm(dim=1, keepdim=True)


def _nw301(nw: Any) -> nanwatch.Diagnosis:
    t = first_bad(nw)
    return next(d for d in t.diagnoses if d.code == "NW301")


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_renormalized_zero_row_is_named_as_a_row_divided_by_0(mode: str) -> None:
    d = _nw301(_train(mode, _renorm))
    assert d.title == (
        "Non-finite weights: a per-row write outside the optimizer divided a row by 0"
    )
    assert d.parameter == "emb.weight"
    assert (
        "the NaN fill 1 whole row of emb.weight (row 7 of 50) and no other row holds one"
        in "\n".join(d.evidence)
    )
    assert "SGD updated it and left it finite" in d.explanation
    assert "an EMA" not in text(d)  # the old list of other writers
    assert "w /= w.norm(dim=1, keepdim=True).clamp_min(torch.finfo(w.dtype).eps)" in d.fix
    assert 'mode="forensic") names the line' in d.fix


def test_the_fix_pasted_in_place_of_the_renormalization_trains_clean() -> None:
    """The healthy control: the fix's own lines, run where the user renormalizes."""
    d = _nw301(_train("watch", _renorm))
    assert code_lines(d.fix).splitlines()[0] == "w = model.get_parameter('emb.weight')"
    lines = "\n".join(ln for ln in d.fix.splitlines() if not ln.startswith("#"))

    def fixed(model: nn.Module) -> None:
        exec(lines, {"torch": torch, "model": model})

    for mode in ("sentinel", "watch"):
        nw = _train(mode, fixed, steps=4)
        assert [t.diagnoses for t in nw.history if t.diagnoses] == []
        assert all(t.anomaly is None for t in nw.history)


def test_a_codebook_mean_of_an_unused_code_is_the_same_story() -> None:
    """A k-means / VQ codebook kept in a Linear's weight, set after the update to the mean
    of the inputs assigned to each code: code 2 gets none, 0 / 0."""
    torch.manual_seed(0)
    model, crit = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1)), nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = torch.randn(32, 4)
            crit(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                code = model[0](x).argmax(1) % 2  # codes 0 and 1 only
                onehot = nn.functional.one_hot(code, 3).float()
                model[0].weight.copy_(onehot.T @ x / onehot.sum(0)[:, None])
            nw.step()
    d = _nw301(nw)
    assert d.title.endswith("divided a row by 0")
    assert "(row 2 of 3)" in "\n".join(d.evidence)
    assert "Embedding" not in d.explanation


def test_a_nan_beside_finite_values_in_its_row_keeps_the_other_writers_story() -> None:
    """One NaN copied in (a checkpoint's entry): no row is NaN throughout."""

    def poke(model: nn.Module) -> None:
        with torch.no_grad():
            model.emb.weight[3, 5] = float("nan")

    d = _nw301(_train("watch", poke))
    assert d.title == "Non-finite weights written outside an optimizer step"
    assert "row by row" not in d.explanation
