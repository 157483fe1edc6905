"""Domain fixes found by user testing: the power whose exponent is the traced one is
clamped (not the first on the line)."""

from __future__ import annotations

import torch
from torch import nn

from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)

_P = 1.5


# ------------------------------ 1: Tweedie deviance: mu ** (1 - p), not y ** (2 - p)


def _tweedie(mu: torch.Tensor, y: torch.Tensor, p: float = _P) -> torch.Tensor:
    return (y.pow(2 - p) / ((1 - p) * (2 - p)) - y * mu.pow(1 - p) / (1 - p) + mu.pow(2 - p) / (2 - p)).mean()  # fmt: skip  # noqa: E501


def test_the_power_with_the_traced_exponent_is_floored_not_the_first() -> None:
    m = nn.Sequential(nn.Linear(3, 1), nn.ReLU())
    with torch.no_grad():
        m[0].weight.zero_()
        m[0].bias.fill_(-1.0)
    y = torch.tensor([0.0, 2.0, 0.0, 5.0])

    def run() -> None:
        _tweedie(m(torch.rand(4, 3)).squeeze(-1), y).backward()

    d = _first(_raises(m, run, "forensic"), "NW112")
    assert "y * mu.clamp_min(1e-6).pow(1 - p)" in d.fix
    assert "y.clamp_min" not in d.fix and "(y + 1e-6)" not in d.fix
    assert "softplus or exp" in d.fix
    line = d.fix.splitlines()[0].split("   #")[0].strip().removeprefix("return ")
    compile(line, "<fix>", "eval")
    mu = torch.zeros(4, requires_grad=True)
    out = eval(line, {"y": y, "mu": mu, "p": _P})
    assert torch.isfinite(out)


# ------------------------------ 2: log(1 - cumsum(softmax)): not a sigmoid


def _deephit(logits: torch.Tensor, dur: torch.Tensor) -> torch.Tensor:
    pmf = torch.softmax(logits, 1)
    cif = pmf.cumsum(1)
    log_surv = torch.log(1 - cif.gather(1, dur[:, None]).squeeze(1))
    return -log_surv.mean()


def test_one_minus_a_cumsum_is_not_called_a_sigmoid() -> None:
    m = nn.Linear(3, 6)
    with torch.no_grad():
        m.weight.zero_()
        m.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 40.0]))
    dur = torch.tensor([5, 5, 4])

    def run() -> None:
        _deephit(m(torch.rand(3, 3)), dur).backward()

    d = _first(_raises(m, run, "forensic"), "NW110")
    words = d.fix + d.explanation + " ".join(d.evidence)
    assert "sigmoid" not in words and "binary_cross_entropy" not in words
    assert "cumulative sum" in d.explanation and "(cif = pmf.cumsum(1))" in d.explanation
    first = d.fix.splitlines()[0].split("   #")[0].strip()
    assert first.startswith("log_surv = torch.log((1 - cif.gather(1, dur[:, None]).squeeze(1))")
    cif = torch.ones(3, 6)
    ns = {"torch": torch, "cif": cif, "dur": dur}
    exec(first, ns)
    assert torch.isfinite(ns["log_surv"]).all()


# ------------------------------ 5: a loss module's call inside a larger expression, no F


def test_all_ignored_targets_keep_the_rest_of_the_line_and_need_no_f() -> None:
    m, crit, k = nn.Linear(3, 5), nn.CrossEntropyLoss(ignore_index=-100), 4
    lab = torch.full((6,), -100)

    def run() -> None:
        out = m(torch.rand(6, 3))
        loss = crit(out, lab) / k
        loss.backward()

    d = _first(_raises(nn.ModuleList([m, crit]), run, "watch"), "NW113")
    assert "F." not in d.fix.replace("torch.nn.functional.", "")
    lines = [ln.split("   #")[0].strip() for ln in d.fix.splitlines() if not ln.startswith("#")]
    assert lines[-1] == "loss = (ce / (lab != -100).sum().clamp_min(1)) / k"
    ns = {"torch": torch, "out": m(torch.rand(6, 3)), "lab": lab, "k": k}
    exec("\n".join(lines), ns)
    assert torch.isfinite(ns["loss"])
