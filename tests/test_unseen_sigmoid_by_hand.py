"""A sigmoid written by hand, ``1 / (1 + torch.exp(-z))``, on unnormalized features: exp(-z)
overflows where z < -88.7, the forward still gives 0, and the backward's 0 × inf is NaN.
NW101 says it is a sigmoid by hand and rewrites the user's line with ``torch.sigmoid`` (it
gave a clamp of the exp's argument and a story of a log-variance that drifted up); the
fix, run in place of the line, trains finite. An exp of a quantity that grew keeps its
own story."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.rules.overflow import _sigmoid_by_hand


class HandSigmoid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        return 1 / (1 + torch.exp(-z))


class Fixed(HandSigmoid):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        return torch.sigmoid(z)


def _train(model: nn.Module, mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    x = torch.randn(16, 4) * 100  # unnormalized features: |z| in the hundreds
    y = (torch.rand(16, 1) > 0.5).float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


def _model(cls: type[HandSigmoid]) -> HandSigmoid:
    torch.manual_seed(0)
    return cls()


_LATE = pytest.mark.gpu_bound_weaker(
    reason="a GPU always behind the host: the exp's NaN gradient is read after the update "
    "(NW100/NW302), and the backward op is not pinpointed"
)


@pytest.mark.parametrize(
    "mode",
    [pytest.param("watch", marks=_LATE), pytest.param("sentinel", marks=_LATE), "forensic"],
)
def test_a_sigmoid_by_hand_is_rewritten_as_torch_sigmoid(mode: str) -> None:
    nw = _train(_model(HandSigmoid), mode)
    d = nw.report.diagnoses[0]
    # forensic sees the op that hid the inf (x / inf = 0): its own NW100 story, which
    # already named torch.sigmoid; watch and sentinel tell it from the exp's records
    code = "NW100" if mode == "forensic" else "NW101"
    assert (d.code, d.step, d.path) == (code, 0, "HandSigmoid"), d.headline
    if mode != "forensic":
        assert "a sigmoid written by hand" in d.explanation
    assert "log-variance" not in d.explanation and "clamp" not in d.fix
    assert d.fix.splitlines()[0].startswith("return torch.sigmoid(z)   # ")
    # the fix, run in place of the line, trains finite with nothing to say
    again = _train(_model(Fixed), mode)
    assert again.first_anomaly is None and again.report.diagnoses == []
    assert all(torch.isfinite(p).all() for p in again.roots[0].parameters())


class LogVariance(nn.Module):
    """A Gaussian head whose log-variance grew: exp of a quantity with no bound."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(4, 1)
        self.logvar = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = torch.exp(self.logvar(x))
        return self.mu(x) / var


def test_an_exp_of_a_quantity_that_grew_keeps_its_story() -> None:
    torch.manual_seed(0)
    model = LogVariance()
    with torch.no_grad():
        model.logvar.bias.fill_(-200.0)  # var = exp(-200 + ...) underflows, 1 / var is inf
    nw = _train(model, "watch")
    d = nw.report.diagnoses[0]
    assert "sigmoid" not in d.explanation and "sigmoid" not in d.fix


@pytest.mark.parametrize(
    ("line", "fixed"),
    [
        ("p = 1 / (1 + torch.exp(-z))", "p = torch.sigmoid(z)"),
        ("p = 1.0 / (torch.exp(-z) + 1.0)", "p = torch.sigmoid(z)"),
        ("return 1 / (1 + (-(x @ w)).exp())", "return torch.sigmoid(x @ w)"),
        ("w = 1 / (1 + torch.exp(s * d))", "w = torch.sigmoid(-(s * d))"),
        ("w = 1 / (1 + torch.exp(self.t))", "w = torch.sigmoid(-self.t)"),
        ("q = torch.exp(u) / (1 + torch.exp(u))", "q = torch.sigmoid(u)"),
        ("q = torch.reciprocal(1 + torch.exp(-u))", "q = torch.sigmoid(u)"),
        ("y = a * (1 / (1 + torch.exp(-z))) + b", "y = a * (torch.sigmoid(z)) + b"),
    ],
)
def test_the_sigmoid_forms_are_rewritten(line: str, fixed: str) -> None:
    assert _sigmoid_by_hand(line) == fixed


@pytest.mark.parametrize(
    "line",
    [
        "p = 2 / (1 + torch.exp(-z))",  # a scaled sigmoid: not the same function
        "q = torch.exp(u) / (1 + torch.exp(v))",  # two different arguments
        "r = 1 / (2 + torch.exp(-z))",
        "s = torch.log(1 + torch.exp(z))",  # softplus, told apart elsewhere
        "t = 1 / (1 + z)",
    ],
)
def test_look_alikes_are_left_alone(line: str) -> None:
    assert _sigmoid_by_hand(line) is None
