"""Training steps that take the log of a softmax of masked logits, as users write them: a
distillation whose student may not emit some tokens (``masked_fill(mask, -inf)``), a policy
with illegal actions (``torch.where(legal, logits, -inf)``). The softmax is exactly 0 at the
masked positions by construction, not by underflow, so ``F.log_softmax`` alone is -inf there
too and the loss stays inf: the diagnosis says the mask (the loss graph shows it below the
softmax, or the line does) and its fix, the log-probabilities with the masked positions set
to 0, trains clean. A cosine written by hand with two sqrt norms on one line, one of them
of a zero vector (an empty document mean-pooled to 0): its fix keeps each sqrt off 0, not
only the first, since the backward node's statistics do not say which root was given the 0.
A NaN born in the backward of a module's own code is not said to be born in its forward.
A module that returns the softmax of logits it masked (a policy's illegal actions): the loss
graph stops at its output, but the records show the child output the softmax was taken of
spans too little to underflow, so its zeros are the module's own code's (watch mode; sentinel
measures no module output)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.domain import _fill_mask, _mask_below

torch.set_num_threads(1)

MODES = ["watch", "sentinel"]
TITLE = "Log of a masked softmax: -inf at the masked positions"


def _student() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 6))


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(16, 10)
    mask = torch.zeros(16, 6, dtype=torch.bool)
    mask[:, 5] = True  # a token the student may not emit; the teacher gives it mass
    teacher = F.softmax(torch.randn(16, 6), -1)
    return x, mask, teacher


def _train(
    model: nn.Module, step: Callable[[], torch.Tensor], mode: str, steps: int = 2
) -> nanwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            step().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


# --------------------------------------- 1: distillation, masked_fill(mask, -inf) then log


def _distill(model: nn.Module, fixed: bool) -> Callable[[], torch.Tensor]:
    x, mask, teacher = _batch()

    def step() -> torch.Tensor:
        logits = model(x).masked_fill(mask, float("-inf"))
        if fixed:  # the diagnosis's fix, in this code's names
            logp = F.log_softmax(logits, dim=-1).masked_fill(mask, 0.0)
        else:
            logp = torch.log(F.softmax(logits, dim=-1))
        return F.kl_div(logp, teacher, reduction="batchmean")

    return step


@pytest.mark.parametrize("mode", MODES)
def test_the_log_of_a_masked_softmax_names_the_mask_and_its_fix_trains_clean(mode: str) -> None:
    model = _student()
    d = _train(model, _distill(model, fixed=False), mode).report.diagnoses[0]
    assert (d.code, d.op, d.path, d.title) == ("NW110", "aten.log", "(loss)", TITLE)
    said = " ".join(d.evidence)
    assert "(log <- softmax <- masked_fill): exactly 0 at the masked positions" in said
    assert "underflowed" not in said.replace("not a probability that underflowed", "")
    assert "by construction, not by underflow" in d.explanation
    first = d.fix.splitlines()[0].split("  #", 1)[0].strip()
    assert first == "logp = F.log_softmax(logits, dim=-1).masked_fill(mask, 0.0)"

    # what it used to advise, the log from the logits alone, is still inf here
    x, mask, teacher = _batch()
    logits = _student()(x).masked_fill(mask, float("-inf"))
    assert F.kl_div(F.log_softmax(logits, -1), teacher, reduction="batchmean").isinf()

    model = _student()
    nw = _train(model, _distill(model, fixed=True), mode)
    assert not nw.report.diagnoses
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------ 2: a policy's illegal actions, torch.where(legal, logits, -inf), CE to a
# ------------------    target policy (an expert's, or a search's visit counts)


@pytest.mark.parametrize("mode", MODES)
def test_a_where_mask_below_the_softmax_is_said_with_its_own_op(mode: str) -> None:
    model = _student()
    x, mask, target = _batch()
    legal = ~mask

    def step() -> torch.Tensor:
        probs = torch.softmax(torch.where(legal, model(x), float("-inf")), dim=-1)
        return -(target * torch.log(probs)).sum(-1).mean()

    d = _train(model, step, mode).report.diagnoses[0]
    assert (d.code, d.op, d.title) == ("NW110", "aten.log", TITLE)
    assert "(log <- softmax <- torch.where)" in " ".join(d.evidence)
    assert "for torch.where(keep, z, -inf): ~keep" in d.fix.splitlines()[0]


# ---------------------------- 3: forensic names the line: the mask is rewritten into it


def test_forensic_rewrites_the_line_with_the_log_probabilities_masked() -> None:
    model = _student()
    x, mask, teacher = _batch()
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        loss = F.kl_div(torch.log(F.softmax(model(x).masked_fill(mask, float("-inf")), -1)), teacher, reduction="batchmean")  # fmt: skip  # noqa: E501
        loss.backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert (d.code, d.title) == ("NW110", TITLE)
    first = d.fix.splitlines()[0].split("  #", 1)[0].strip()
    assert first == (
        'loss = F.kl_div(F.log_softmax(model(x).masked_fill(mask, float("-inf")), -1)'
        '.masked_fill(mask, 0.0), teacher, reduction="batchmean")'
    )
    model.zero_grad()
    ns: dict[str, Any] = {"F": F, "torch": torch, "model": model, "x": x}
    ns.update(mask=mask, teacher=teacher)
    exec(first, ns)
    ns["loss"].backward()
    assert torch.isfinite(ns["loss"])
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_forensic_takes_the_mask_from_the_traced_fill_on_an_earlier_line() -> None:
    model = _student()
    x, mask, teacher = _batch()
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        z = model(x).masked_fill(mask, float("-inf"))
        loss = F.kl_div(torch.log(F.softmax(z, -1)), teacher, reduction="batchmean")
        loss.backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert (d.code, d.title) == ("NW110", TITLE)
    first = d.fix.splitlines()[0].split("  #", 1)[0].strip()
    assert first == (
        "loss = F.kl_div(F.log_softmax(z, -1).masked_fill(mask, 0.0), teacher, "
        'reduction="batchmean")'
    )
    ns: dict[str, Any] = {"F": F, "z": z.detach(), "mask": mask, "teacher": teacher}
    exec(first, ns)
    assert torch.isfinite(ns["loss"])


# ------------------------------------ 4: what says a mask, and what does not (op evidence)


def test_only_a_fill_right_below_the_softmax_is_a_mask() -> None:
    assert _mask_below(["softmax", "maskedfill", "addmm", "leaf"]) == "masked_fill"
    assert _mask_below(["squeeze", "gather", "softmax", "where"]) == "torch.where"
    assert _mask_below(["watched:softmax"]) is None  # what made its input is not seen
    assert _mask_below(["softmax", "div", "maskedfill"]) is None
    assert _mask_below(["rsub", "sigmoid", "maskedfill"]) is None  # 1 - p: not p's zeros
    assert _fill_mask("z.masked_fill(~keep, -1e9), dim=-1", None) == ("~keep", "masked_fill")
    assert _fill_mask(None, "torch.where(a > 0, z, -torch.inf)") == ("~(a > 0)", "torch.where")
    assert _fill_mask("z / tau, -1", None) is None


def test_a_softmax_that_underflowed_without_a_mask_keeps_its_log_softmax_fix() -> None:
    model = _student()
    with torch.no_grad():
        model[2].weight.mul_(200.0)  # logits far apart: exp of the low ones is exactly 0
    x, _, teacher = _batch()
    nw = _train(
        model,
        lambda: F.kl_div(torch.log(F.softmax(model(x), -1)), teacher, reduction="batchmean"),
        "watch",
    )
    d = nw.report.diagnoses[0]
    assert d.code == "NW110" and d.title != TITLE
    assert d.fix.startswith("logp = F.log_softmax(logits, dim=-1)   #")


# ---------- 5: a cosine by hand whose norms are two sqrts on one line: the zero vector is
# ----------    the second's (an empty document, all padding, mean-pooled to 0)


class _TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.q = nn.Linear(16, 16)

    def pool(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        m = keep.unsqueeze(-1).float()
        return (self.emb(ids) * m).sum(1) / m.sum(1).clamp_min(1.0)

    def forward(self, q: torch.Tensor, d: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        a, b = self.q(self.pool(q, torch.ones_like(keep))), self.pool(d, keep)
        if self.fixed:
            return (a * b).sum(-1) / ((a * a).sum(-1).clamp_min(1e-12).sqrt() * (b * b).sum(-1).clamp_min(1e-12).sqrt() + 1e-8)  # fmt: skip  # noqa: E501
        return (a * b).sum(-1) / ((a * a).sum(-1).sqrt() * (b * b).sum(-1).sqrt() + 1e-8)

    fixed = False


def _retrieval(fixed: bool, mode: str) -> tuple[nn.Module, nanwatch.Watcher]:
    torch.manual_seed(0)
    model = _TwoTower()
    model.fixed = fixed
    q, d = torch.randint(0, 100, (8, 6)), torch.randint(0, 100, (8, 6))
    keep = torch.rand(8, 6) > 0.3
    keep[5] = False  # an empty document: every position is padding
    y = torch.ones(8)
    return model, _train(model, lambda: F.mse_loss(model(q, d, keep), y), mode)


@pytest.mark.parametrize("mode", MODES)
def test_each_sqrt_of_a_hand_written_cosine_is_kept_off_0_and_the_fix_trains_clean(
    mode: str,
) -> None:
    _, nw = _retrieval(False, mode)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op, d.path, d.phase) == ("NW112", "aten.sqrt", "_TwoTower", "backward")
    line, comment = d.fix.splitlines()[0].split("   # ", 1)
    assert line == (
        "return (a * b).sum(-1) / ((a * a).sum(-1).clamp_min(1e-12).sqrt() * (b * b).sum(-1)"
        ".clamp_min(1e-12).sqrt() + 1e-8)"
    )
    assert comment.startswith("keep each sqrt off exact 0")
    model, nw = _retrieval(True, mode)  # the fix, pasted
    assert not nw.report.diagnoses
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_one_sqrt_on_the_line_is_still_the_sqrt() -> None:
    from nanwatch.rules.domain import _rewrite_each_call

    fixed, each = _rewrite_each_call("n = x.pow(3).sum().sqrt()", ["sqrt"], lambda v: f"g({v})")
    assert (fixed, each) == ("n = g(x.pow(3).sum()).sqrt()", "the sqrt")


# ------------- 6: a NaN born in the backward of a module's own code is not called forward


def test_a_backward_birth_between_children_is_said_as_backward() -> None:
    from nanwatch.records import Anomaly, AnomalyKind, Phase, Record
    from nanwatch.rules.generic import _born_where

    rec = Record(0, 0, Phase.BACKWARD, "emb", "output", "float32", "cpu", (8, 6, 16))
    born = _born_where(Anomaly(0, AnomalyKind.BACKWARD, "tower", rec, "between-children", ""))
    assert born == "in the backward of tower's own code, between its submodules"
    fwd = _born_where(Anomaly(0, AnomalyKind.FORWARD, "tower", rec, "between-children", ""))
    assert fwd == "in the forward of tower's own code, between its submodules"


# ------------- 7: the mask inside the module that returns the softmax (a policy's illegal
# -------------    actions): the loss graph stops at the module's output, its records show it


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 5))

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        z = self.net(obs).masked_fill(~legal, float("-inf"))
        if self.fixed:  # the diagnosis's fix: the log-probabilities beside the probabilities
            self.logp = F.log_softmax(z, dim=-1).masked_fill(~legal, 0.0)
        return F.softmax(z, -1)

    fixed = False
    logp = torch.empty(0)


def _a2c(fixed: bool, mode: str) -> tuple[nn.Module, nanwatch.Watcher]:
    torch.manual_seed(0)
    pi = _Policy()
    pi.fixed = fixed
    obs, adv = torch.randn(32, 8), torch.randn(32)
    legal = torch.rand(32, 5) > 0.3
    legal[:, 0] = True
    act = torch.zeros(32, 1, dtype=torch.long)

    def step() -> torch.Tensor:
        p = pi(obs, legal)
        logp = pi.logp if fixed else p.log()
        ent = -(p * logp).sum(-1).mean()
        return -(logp.gather(1, act).squeeze(1) * adv).mean() - 0.01 * ent

    return pi, _train(pi, step, mode)


def test_zeros_a_modules_own_code_put_in_its_softmax_are_not_called_underflow() -> None:
    _, nw = _a2c(False, "watch")
    d = nw.report.diagnoses[0]
    assert (d.code, d.op, d.path) == ("NW110", "aten.log", "(loss)")
    assert d.title == "Log of a softmax that _Policy's own code set to 0"
    said = " ".join(d.evidence)
    assert "net's output (min " in said and "so the zeros are no underflow of it" in said
    assert "a probability that underflowed" not in said
    assert d.fix.splitlines()[1].startswith(
        "logp = F.log_softmax(z, dim=-1).masked_fill(mask, 0.0)   #"
    )
    pi, nw = _a2c(True, "watch")  # the fix, in this code's names
    assert not nw.report.diagnoses
    assert all(torch.isfinite(p).all() for p in pi.parameters())


def test_a_temperature_inside_the_module_still_reads_as_the_modules_code() -> None:
    class Sharp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.softmax(self.lin(x) / 1e-3, -1)  # spread x 1000: exact zeros

    torch.manual_seed(0)
    m = Sharp()
    x = torch.randn(16, 8)

    def entropy() -> torch.Tensor:
        p = m(x)
        return -(p * torch.log(p)).sum(-1).mean()

    nw = _train(m, entropy, "watch", steps=1)
    d = nw.report.diagnoses[0]
    assert d.title == "Log of a softmax that Sharp's own code set to 0"
    assert "# a temperature, no -inf: F.log_softmax(z / tau, dim=-1)" in d.fix
