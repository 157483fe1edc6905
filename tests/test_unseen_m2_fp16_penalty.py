"""A hand-written L2 penalty over float16 weights: ``sum((p ** 2).sum() for p in
model.parameters())``. Every weight is of ordinary size, yet the sum of a large layer's
squares is held in float16 and passes 65504 (torch.finfo(torch.float16).max): the loss is
inf before backward. Sentinel and watch mode trace no op, yet the loss's autograd graph
shows a full sum of a power of watched float16 weights, and the sum is computed again from
the weights' values: NW101 names the weight, its sum, and the fix (the penalty in float32,
or weight_decay in the optimizer). The same penalty in float32 trains clean."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanwatch


class Net(nn.Module):
    def __init__(self, width: int = 512, blocks: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def _run(
    mode: str, *, fixed: bool = False, gain: float = 30.0, blocks: int = 1, form: str = "pow"
) -> tuple[list[nanwatch.Diagnosis], list[float]]:
    torch.manual_seed(0)
    model = Net(blocks=blocks).half()
    with torch.no_grad():
        for b in model.blocks:
            b.weight.mul_(gain)  # uniform(-1.3, 1.3) at gain 30: ordinary weights
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    losses: list[float] = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = torch.randn(8, 512, generator=gen).half()
            y = torch.randint(0, 10, (8,), generator=gen)
            loss = nn.functional.cross_entropy(model(x).float(), y)
            if fixed:
                l2 = sum(p.float().pow(2).sum() for p in model.parameters())
            elif form == "mul":
                l2 = sum((p * p).sum() for p in model.parameters())
            else:
                l2 = sum((p**2).sum() for p in model.parameters())
            loss = loss + 1e-4 * l2
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return [d for t in nw.history for d in t.diagnoses], losses


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_float16_l2_penalty_past_65504_is_named_with_its_weight(mode: str) -> None:
    ds, losses = _run(mode)
    assert math.isinf(losses[0])
    first = [d for d in ds if d.step == 0 and d.severity == "error"]
    assert first and first[0].code == "NW101", [(d.code, d.headline) for d in ds]
    d = first[0]
    assert d.op == "aten.sum"
    text = " ".join(d.evidence)
    assert "the loss code sums (p ** 2) over 4 watched float16 weights" in text
    assert "blocks.0.weight 1.537e+05 (262,144 values)" in text
    assert "blocks.0.weight's alone is past 65504 (torch.finfo(torch.float16).max): inf" in text
    assert "the weights are finite, up to |w| = 1.326" in text
    assert "a GradScaler does not help" in d.explanation
    assert d.fix.startswith("penalty = sum(p.float().pow(2).sum() for p in model.parameters())")
    assert "weight_decay=2 * c" in d.fix
    assert not [x for x in ds if x.code == "NW100" and x.step == 0]


def test_sums_that_fit_one_by_one_but_not_added_up_are_told_so() -> None:
    ds, losses = _run("watch", gain=15.0, blocks=2)  # about 38,000 each, 77,000 in all
    assert math.isinf(losses[0])
    found = [d for d in ds if d.step == 0 and d.code == "NW101"]
    assert found, [(d.code, d.headline) for d in ds]
    text = " ".join(found[0].evidence)
    assert "(p ** 2).sum() of each weight fits float16" in text
    assert "but added up in float16 they reach" in text


def test_a_self_product_penalty_gets_the_same_diagnosis() -> None:
    ds, _ = _run("watch", form="mul")
    found = [d for d in ds if d.step == 0 and d.code == "NW101"]
    assert found, [(d.code, d.headline) for d in ds]
    assert "the loss code sums (p * p) over 4" in " ".join(found[0].evidence)
    assert found[0].fix.startswith("penalty = sum((p.float() * p.float()).sum() for p in")


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_penalty_in_float32_trains_clean(mode: str) -> None:
    ds, losses = _run(mode, fixed=True)
    assert all(math.isfinite(v) for v in losses)
    assert not [d for d in ds if d.severity == "error"], [d.headline for d in ds]
    assert not [d for d in ds if d.code == "NW101"]


def test_a_small_float16_penalty_is_not_diagnosed() -> None:
    ds, losses = _run("watch", gain=1.0)
    assert all(math.isfinite(v) for v in losses)
    assert not [d for d in ds if d.severity == "error"], [d.headline for d in ds]
