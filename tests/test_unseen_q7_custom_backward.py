"""A custom ``torch.autograd.Function`` whose own ``backward()`` makes the first non-finite
gradient from a finite one, its forward finite. Watch and sentinel mode replay the module's
backward and run the Function's backward again under the op checker, so the op and the line
inside ``backward()`` are named, as in forensic mode: an L2 normalization that divides by
the unclamped norm it saved (an all-zero sample: x/0, NW111 with the where on that line);
and a gradient-reversal layer whose coefficient is past float32's range (1e40 is finite in
Python, inf as a float32 factor: not an overflow, not an infinite derivative, NW111 with the
coefficient named and bounded)."""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase, TensorStat
from nanwatch.rules._evidence import classify, nonfinite_scalars

HERE = os.path.basename(__file__)
MODES = ["sentinel", "watch", "forensic"]
_LATE = pytest.mark.gpu_bound_weaker(
    reason="read late, the module's own backward is not replayed: the custom Function is "
    "named, not the op inside its backward()"
)
#: the modes whose op inside the custom backward() is named: sentinel and watch by the
#: replay of the module's own backward, forensic as it runs
REPLAYED = [pytest.param("sentinel", marks=_LATE), pytest.param("watch", marks=_LATE), "forensic"]


def _line(fn: Any, marker: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


# ------------------------------------------------------------ a backward that divides by 0
class L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        n = x.norm(dim=-1, keepdim=True)
        y = x / n.clamp_min(1e-12)
        ctx.save_for_backward(y, n)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        y, n = ctx.saved_tensors
        return (g - y * (g * y).sum(-1, keepdim=True)) / n  # the division


class SafeL2Normalize(L2Normalize):
    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        y, n = ctx.saved_tensors
        return torch.where(n != 0, (g - y * (g * y).sum(-1, keepdim=True)) / torch.where(n != 0, n, 1), 0)  # fmt: skip  # noqa: E501


class Proj(nn.Module):
    def __init__(self, fn: type[torch.autograd.Function] = L2Normalize) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4, bias=False)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(self.fc(x))  # type: ignore[no-any-return]


def _project(mode: str, *, empty: bool, fn: type[torch.autograd.Function] = L2Normalize) -> Any:
    torch.manual_seed(4)
    model = Proj(fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = torch.randn(16, 8)
            if empty:
                x[3] = 0  # an empty sample: all-zero features
            z = model(x)
            loss = -(z @ z.t()).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw, model


@pytest.mark.parametrize("mode", REPLAYED)
def test_the_division_inside_a_custom_backward_is_named_with_its_line(mode: str) -> None:
    nw, _ = _project(mode, empty=True)
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    assert a.op.op.startswith("aten.div"), a.summary
    assert a.op.source is not None and a.op.source.endswith(_line(L2Normalize, "# the division"))
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.title) == ("NW111", "Division by zero"), [
        (x.code, x.title) for x in nw.history[0].diagnoses
    ]
    assert "denominator holds 1 exact zero" in d.evidence[0], d.evidence
    assert d.fix.startswith(
        "return torch.where(n != 0, (g - y * (g * y).sum(-1, keepdim=True)) / "
        "torch.where(n != 0, n, 1), 0)"
    ), d.fix


@pytest.mark.parametrize("mode", MODES)
def test_the_fixed_backward_and_a_batch_without_empty_samples_train_clean(mode: str) -> None:
    for empty, fn in ((True, SafeL2Normalize), (False, L2Normalize)):
        nw, model = _project(mode, empty=empty, fn=fn)
        assert nw.first_anomaly is None, nw.first_anomaly.summary
        assert nw.report.diagnoses == [], [d.headline for d in nw.report.diagnoses]
        assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------ a coefficient past float32
class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lambd: float) -> torch.Tensor:
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g.neg() * ctx.lambd, None  # the reversal


class DANN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.cls = nn.Linear(16, 3)
        self.dom = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.feat(x)
        return self.cls(f), self.dom(GradReverse.apply(f, lambd)).squeeze(-1)


def _dann(mode: str, lambd: float) -> Any:
    torch.manual_seed(5)
    model = DANN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = torch.randn(32, 8)
            y = torch.randint(0, 3, (32,))
            d = torch.randint(0, 2, (32,)).float()
            c, dl = model(x, lambd)
            loss = F.cross_entropy(c, y) + F.binary_cross_entropy_with_logits(dl, d)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw, model


@pytest.mark.parametrize("mode", REPLAYED)
def test_a_reversal_coefficient_past_float32s_range_is_named_not_an_overflow(mode: str) -> None:
    nw, _ = _dann(mode, 1e40)
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.op.startswith("aten.mul"), a and a.summary
    assert a.op.source is not None and a.op.source.endswith(_line(GradReverse, "# the reversal"))
    d = nw.history[0].diagnoses[0]
    assert d.code == "NW111", [(x.code, x.title) for x in nw.history[0].diagnoses]
    assert d.title == "Number past float32's range given to an op (not an overflow)"
    assert "other=1e+40 (ctx.lambd)" in d.evidence[0] and "3.4e+38" in d.evidence[0]
    assert d.fix.startswith("return g.neg() * min(ctx.lambd, 1e3), None   # ctx.lambd was 1e+40")
    assert "clip_grad_norm_" not in d.fix and "sqrt or acos" not in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_a_reversal_coefficient_of_one_trains_clean(mode: str) -> None:
    nw, model = _dann(mode, 1.0)
    assert nw.first_anomaly is None, nw.first_anomaly.summary
    assert nw.report.diagnoses == [], [d.headline for d in nw.report.diagnoses]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _mul(dtype: str, number: float, op: str = "aten.mul.Tensor", key: str = "other") -> OpEvent:
    return OpEvent(
        op, Phase.BACKWARD, None, "+inf", TensorStat(0.0, math.inf, 8, nan=0, posinf=8, neginf=0),
        [("self", TensorStat(0.1, 0.3, 8))], {key: number}, node="GradReverseBackward",
        dtype=dtype,
    )  # fmt: skip


def test_only_a_number_the_ops_dtype_makes_inf_is_taken_for_an_inf() -> None:
    assert nonfinite_scalars(_mul("float32", 1e40)) == [("other", 1e40)]
    assert classify(_mul("float16", -1e39)) == "inf-input"  # float32 numbers in float16 ops
    assert nonfinite_scalars(_mul("float64", 1e40)) == []  # float64 holds it
    assert nonfinite_scalars(_mul("float32", 1e38)) == []  # finite in float32
    assert nonfinite_scalars(_mul("float32", 1e40, "aten.div.Tensor")) == []  # x / 1e40 = 0
    assert nonfinite_scalars(_mul("float32", 1e40, "aten.div.Tensor", "self")) != []
