"""A module and its own child given the same tensor are one consumer in backward; a -inf a
matmul made by overflow is where a float16 overflow was born; of several bad parameter
gradients, the one backward wrote first is named."""

from __future__ import annotations

import math

import torch
from torch import nn

import nanwatch
from nanwatch.localize import is_birth
from nanwatch.records import OpEvent, Phase, TensorStat


class _Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.off = nn.Linear(3, 3)

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return p + 0.1 * self.off(p)


class _Knn(nn.Module):
    """Encodes the points with a child, and takes the sqrt of distances that include the
    point itself (exactly 0): sqrt's backward at 0 makes NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 4)

    def forward(self, pts: torch.Tensor) -> torch.Tensor:
        f = self.enc(pts)
        d2 = ((pts[:, :, None, :] - pts[:, None, :, :]) ** 2).sum(-1)
        dist = d2.topk(2, dim=-1, largest=False).values.sqrt()
        return f.sum(-1) + dist.mean(-1)


def test_child_given_the_same_input_collapses_into_its_parent() -> None:
    torch.manual_seed(0)
    shift, knn = _Shift(), _Knn()
    with nanwatch.watch(shift, knn, on_anomaly="record", postmortem=False) as nw:
        knn(shift(torch.randn(1, 5, 3))).pow(2).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    assert a.kind is nanwatch.AnomalyKind.BACKWARD
    assert a.path == "_Knn"
    # by the sqrt, then NaN: the replay is seeded with the step's gradient at _Knn's output
    assert "+inf gradient born in the backward of _Knn" in a.summary
    assert "also fed" not in a.summary


def _event(op: str, born: str, *, injected: bool = False) -> OpEvent:
    out = TensorStat(-math.inf, 1.0, 4)
    return OpEvent(op, Phase.FORWARD, "m", born, out, injected=injected)


def test_a_minus_inf_only_an_overflow_can_make_is_a_birth() -> None:
    assert is_birth(_event("aten.bmm.default", "-inf"))
    assert is_birth(_event("aten.addmm.default", "-inf"))
    assert not is_birth(_event("aten.masked_fill.Scalar", "-inf", injected=True))
    assert not is_birth(_event("aten.log.default", "-inf"))  # log of a 0/1 mask
    assert is_birth(_event("aten.div.Tensor", "NaN"))


class _Attn(nn.Module):
    """Two float16 products overflow: the first to -inf, the second to +inf; their ratio is
    NaN, passed to a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.o = nn.Linear(2, 2)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        neg = torch.bmm(q, -q.transpose(1, 2))  # -inf: the first overflow
        pos = torch.bmm(q, q.transpose(1, 2))  # +inf
        return self.o(neg / pos)


def test_float16_minus_inf_from_a_matmul_is_the_birth() -> None:
    m = _Attn().half()
    q = torch.full((1, 2, 2), 300.0, dtype=torch.float16)
    with nanwatch.watch(m, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        m(q)
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None
    assert a.op.op == "aten.bmm.default"
    assert a.op.born == "-inf"
    assert a.op.code is not None and "neg = torch.bmm" in a.op.code


def test_gradient_backward_wrote_first_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 8))
    with torch.no_grad():
        for i in (0, 2):
            model[i].weight.fill_(1e-3)
            model[i].bias.fill_(0.0)
    x = torch.full((8, 4), 1e4)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        (model(x).sum() * 1e37).backward()  # a manual loss scale far too large
        nw.step()
    assert model[0].weight.grad is not None and not model[0].weight.grad.isfinite().all()
    a = nw.first_anomaly
    assert a is not None
    # the replay of 2's own backward, seeded with the step's gradient at its output (1e37),
    # overflows the weight gradient's matmul as the step did: born there, and told so
    assert a.kind is nanwatch.AnomalyKind.BACKWARD and a.path == "2"
    assert "gradient of parameter 2.weight" in a.summary
    d = nw.report.diagnoses[0]
    assert d.code == "NW101", [(x.code, x.title) for x in nw.report.diagnoses]
    text = "\n".join(d.evidence)
    assert "the gradient arriving at 2's output is up to |g| = 1e+37" in text, text
    assert "the loss code scaled it" in text and "a manual loss scale far too large" in text
