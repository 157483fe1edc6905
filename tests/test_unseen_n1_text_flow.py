"""The rules' reading of the user's line must agree with the data flow: the op that made
an operand (``made_from``, ``other_made_from``) is read in a replay under ``no_grad`` and
in forensic mode too, and a line's text that another op on it would fit is not trusted
over it. Each scenario here was misread from the text alone: ``(torch.exp(z) - 1).sum()``
called an exp that underflowed; a hand-written BCE of an nn.Sigmoid's output given a clamp;
``log(q)`` of a ReLU beside ``log(sigmoid(z))`` on one line given a logsigmoid fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.ops import OpChecker
from nanwatch.records import OpEvent, Phase, TensorStat
from tests._diagnoses import code_lines, text, top


def _run(model: nn.Module, x: torch.Tensor, mode: str) -> Any:
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        model(x).float().mean().backward()
        nw.step()
    return nw


class _Expm1Norm(nn.Module):
    """Weights exp(z) - 1, normalized by their sum, of a z so small that exp(z) is 1.0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x) * 1e-9
        w = torch.exp(z) - 1
        return w / (torch.exp(z) - 1).sum(-1, keepdim=True)


@pytest.mark.parametrize("mode", ["forensic", "watch", "sentinel"])
def test_exp_minus_one_in_a_denominator_is_cancellation_not_underflow(mode: str) -> None:
    torch.manual_seed(0)
    model = _Expm1Norm()
    d = top(_run(model, torch.randn(8, 4), mode))
    assert (d.code, d.op, d.path) == ("NW111", "aten.div.Tensor", "_Expm1Norm")
    assert d.title == "Division by zero (0/0): exp(x) - 1 cancelled to 0"
    assert "underflow" not in d.title and "logsumexp" not in d.fix
    said = "\n".join(d.evidence)
    assert "(sum <- sub <- exp: torch.exp(z) - 1)" in said
    assert "the exp did not underflow" in said
    fixed = code_lines(d.fix)
    assert fixed.startswith("return w / torch.expm1(z).sum(-1, keepdim=True)")
    # the pasted line divides by a denominator that is not 0 for the same tiny z
    z = model.lin(torch.randn(8, 4)).detach() * 1e-9
    w = torch.expm1(z)
    out = eval(fixed.split("return ", 1)[1].split("  #")[0], {"torch": torch, "w": w, "z": z})
    assert torch.isfinite(out).all()


def test_exp_minus_one_in_loss_code_is_read_from_its_line_in_forensic_mode() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    with nanwatch.watch(lin, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        z = lin(torch.randn(2, 3)) * 1e-9
        loss = (z.sum(-1) / (1 - torch.exp(z)).sum(-1)).sum()
        loss.backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW111" and "exp(x) - 1 cancelled to 0" in d.title
    assert "(sum <- rsub <- exp: 1 - torch.exp(z))" in "\n".join(d.evidence)
    assert code_lines(d.fix).startswith("loss = (z.sum(-1) / -torch.expm1(z).sum(-1)).sum()")


class _Sinkhorn(nn.Module):
    """A kernel exp(-C / eps) that does underflow: the text and the data flow agree."""

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        k = torch.exp(-c / 0.001)
        return torch.ones(c.shape[0]) / (k @ torch.ones(c.shape[1]))


@pytest.mark.parametrize("mode", ["forensic", "watch"])
def test_an_exp_that_did_underflow_is_still_called_so(mode: str) -> None:
    model = _Sinkhorn()
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        model(torch.rand(5, 7) + 1.0)
        nw.step()
    d = top(nw)
    assert d.code == "NW111" and d.title.endswith("exp() underflowed to 0")


class _SigmoidNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.act = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)).squeeze(-1)


def _bce_by_hand(bias: float) -> tuple[Any, _SigmoidNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _SigmoidNet()
    with torch.no_grad():
        model.lin.weight.mul_(0.01)
        model.lin.bias.fill_(bias)  # every logit near bias: p saturated at 0 or at 1
    x, y = torch.randn(16, 4), (torch.arange(16) % 2).float()
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        p = model(x)
        loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        loss.backward()
        nw.step()
    return nw, model, x, y


@pytest.mark.parametrize(("bias", "end"), [(-200.0, "0"), (40.0, "1")])
def test_a_hand_written_bce_of_an_nn_sigmoid_is_fixed_from_the_logits(
    bias: float, end: str
) -> None:
    nw, model, x, y = _bce_by_hand(bias)
    d = top(nw)
    assert d.code == "NW110"
    assert d.title == (
        f"Log of zero in a hand-written binary cross-entropy: the sigmoid saturated at {end}"
    )
    side = "log(p)" if end == "0" else "log(1 - p)"
    assert f"the op is {side}, and p was made by the nn.Sigmoid (act)" in text(d)
    assert "clamp" not in d.fix
    lines = code_lines(d.fix).splitlines()
    assert lines[0].startswith("model.act = nn.Identity()")
    assert lines[1].startswith("loss = F.binary_cross_entropy_with_logits(p, y)")
    # the pasted fix: the Sigmoid dropped, the loss from the logits is finite and is the
    # hand-written loss where that one is finite
    ns: dict[str, Any] = {"model": model, "nn": nn, "F": F, "torch": torch, "y": y}
    exec(lines[0], ns)
    with torch.no_grad():
        model.lin.bias.fill_(0.5)
        ns["p"] = model(x)
        exec(lines[1].split("  #")[0], ns)
        p = torch.sigmoid(ns["p"])
        want = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    assert torch.isfinite(ns["loss"]) and torch.allclose(ns["loss"], want, atol=1e-6)


class _TwoLogs(nn.Module):
    """log(sigmoid(a)) and log(q) on one line: the log that made -inf is log(q) of a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.relu(self.b(x))
        return torch.log(torch.sigmoid(self.a(x))).sum(-1) + torch.log(q).sum(-1)


@pytest.mark.parametrize("mode", ["forensic", "watch"])
def test_a_log_on_a_line_is_the_one_the_data_flow_shows(mode: str) -> None:
    torch.manual_seed(0)
    model = _TwoLogs()
    with torch.no_grad():
        model.b.bias.fill_(-100.0)
    d = top(_run(model, torch.randn(8, 4), mode))
    assert d.code == "NW110"
    assert "logsigmoid" not in d.fix
    assert "the log's argument is a ReLU output" in text(d)


def test_the_op_checker_knows_what_made_an_operand_without_autograd() -> None:
    with torch.no_grad(), OpChecker() as chk:
        p = torch.sigmoid(torch.full((3,), 100.0))
        torch.log(1 - p)
        z = torch.full((2, 3), 1e-9)
        torch.ones(2) / (torch.exp(z) - 1).sum(-1)
    log, div = chk.events[:2]
    assert log.made_from[:2] == ["rsub", "sigmoid"]
    assert div.scalars["other_made_from"] == "sum<sub<exp<full"


def _event(made_from: list[str]) -> OpEvent:
    """A forward log of values in [0, 1] whose input ``made_from`` made."""
    x = TensorStat(0.0, 1.0, 4)
    return OpEvent(
        "aten.log.default", Phase.FORWARD, None, "-inf", x, [("self", x)], made_from=made_from
    )


def test_the_text_of_an_operand_is_checked_against_its_maker() -> None:
    from nanwatch.rules._evidence import flow_disagrees, written_op

    assert written_op("1 - p") == {"rsub", "sub"}
    assert written_op("torch.sigmoid(z)") == written_op("z.sigmoid()") == {"sigmoid"}
    assert written_op("p") is None and written_op("self.head(x)") is None
    assert flow_disagrees(_event(["squeeze", "sigmoid"]), "1 - p") == "squeeze"
    assert flow_disagrees(_event(["tocopy", "rsub", "sigmoid"]), "1 - p") is None
    assert flow_disagrees(_event(["relu"]), "torch.sigmoid(z)") == "relu"
    assert flow_disagrees(_event([]), "1 - p") is None  # the flow unknown: the text stands
    assert flow_disagrees(_event(["leaf"]), "1 - p") is None
