"""Domain fixes found by user testing, checked by pasting them: an indexed dict keeps its
index in a finfo dtype; a zero temperature that also scales the loss is fixed at its
source; a float16 overflow of unknown origin is not called a log of 0; a fix written
without the user's line is a pattern in placeholder names; a fix spells math. only where
the user's file imports math (this file does not)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines, text
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _statement(fix: str) -> str:
    """The fix's first code line, its comment dropped."""
    return code_lines(fix).splitlines()[0].split("   #", 1)[0].strip()


# ------------------------------ 1: fisher[n] / fisher[n].max(): the dtype of fisher[n]


class _DictNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        stats = {"a": h * 0, "b": h}
        for k in list(stats):
            stats[k] = stats[k] / stats[k].max()
        return stats["a"] + stats["b"]


def test_a_dict_entry_divided_by_its_zero_max_takes_the_entrys_dtype() -> None:
    m = _DictNorm()
    d = _first(_raises(m, lambda: m(torch.randn(3, 4)).sum().backward(), "forensic"), "NW111")
    fixed = _statement(d.fix)
    assert "torch.finfo(stats[k].dtype).eps" in fixed and "finfo(stats.dtype)" not in fixed
    h = torch.randn(3, 4)
    ns = {"torch": torch, "stats": {"a": h * 0, "b": h}, "k": "a"}
    exec(compile(fixed, "<fix>", "exec"), ns)  # a dict has no .dtype: this raised
    assert torch.isfinite(ns["stats"]["a"]).all()  # type: ignore[index]


# ------------------------------ 2: KD with T = 0: kl(s / T, t / T) * T * T


def test_a_zero_temperature_that_also_scales_the_loss_is_fixed_at_its_source() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    x, t = torch.randn(2, 4), torch.randn(2, 3)

    def run() -> None:
        T = 0.0
        kd = F.kl_div(F.log_softmax(m(x) / T, dim=1), F.softmax(t / T, dim=1), reduction="batchmean") * T * T  # fmt: skip  # noqa: E501
        kd.backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    assert "max(T, 1e-3)" not in code_lines(d.fix)  # a floor here leaves kd = 0 every step
    assert " if T else " not in d.fix  # not the soft-cap switch: kd is no m(x) at T = 0
    fixed = _statement(d.fix)
    assert fixed.startswith("assert T > 0")
    assert "T = 0.0" in d.fix  # where T is made
    assert "multiplies by T" in d.explanation and "config error" in d.explanation
    exec(compile(fixed, "<fix>", "exec"), {"T": 2.0})  # valid Python, quiet for T > 0
    with pytest.raises(AssertionError, match="T must be > 0"):
        exec(compile(fixed, "<fix>", "exec"), {"T": 0.0})
    w = _first(_raises(m, run, "watch"), "NW111")  # the line unknown: the generic text
    assert "where it is made" in w.fix and "* T * T" in w.fix


class _SoftCap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cap = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) / self.cap) * self.cap


def test_a_soft_cap_of_zero_still_means_off() -> None:
    m = _SoftCap()
    d = _first(_raises(m, lambda: m(torch.randn(2, 4)).sum().backward(), "forensic"), "NW111")
    assert "if self.cap else" in d.fix and "assert" not in d.fix


# ------------------------------ 3: a float16 Linear that overflowed under no_grad: no log


def test_a_float16_overflow_cast_to_float32_is_not_called_a_log_of_zero() -> None:
    student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).half()
    with torch.no_grad():  # an EMA copy that blew up: every output is -inf in float16
        teacher[0].weight.fill_(300.0)  # type: ignore[index]
        teacher[0].bias.zero_()  # type: ignore[index]
        teacher[2].weight.fill_(-300.0)  # type: ignore[index]
    crit = nn.MSELoss()
    x, y = torch.rand(8, 4) + 0.5, torch.randn(8, 1)

    try:
        with nanwatch.watch(student, teacher, crit, mode="sentinel") as nw:
            crit(student(x), y).backward()
            with torch.no_grad():
                crit(teacher(x.half()).float(), y)
            nw.step()
    except nanwatch.AnomalyError as e:
        err = e
    else:
        raise AssertionError("no anomaly")
    assert all(d.code != "NW110" for d in err.diagnoses)
    assert all("log(0)" not in d.explanation for d in err.diagnoses)


# ------------------------------ 4: the line unknown: a pattern, not a guessed name


class _Prior(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        with torch.no_grad():
            self.lin.bias.copy_(torch.tensor([150.0, 0, 0, 0, 0, 0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.lin(x), -1)


def test_a_softmax_log_fix_without_a_line_is_a_pattern_with_the_forensic_hint() -> None:
    m = _Prior()

    def run() -> None:
        p = m(torch.randn(3, 4))
        (p * torch.log(p)).sum().backward()

    d = _first(_raises(m, run, "sentinel"), "NW110")
    assert "a pattern, in your names: logits" in d.fix
    assert d.fix.splitlines()[-1] == '# mode="forensic" names your line, and nanwatch rewrites it'


class _StraightThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = 0.99 * F.softmax(self.lin(x), -1) + 0.01 / 4
        idx = torch.multinomial(probs, 1).squeeze(-1)
        return F.one_hot(idx, 4).float() + probs - probs.detach()


def test_a_log_of_a_straight_through_sample_gets_no_made_up_likelihood_name() -> None:
    torch.manual_seed(0)
    m = _StraightThrough()

    def run() -> None:
        act = m(torch.randn(16, 4))
        (act * torch.log(act)).sum().backward()

    for mode in ("watch", "sentinel"):
        d = _first(_raises(m, run, mode), "NW110")
        assert "lik" not in code_lines(d.fix).replace("likelihood", "")
        assert _statement(d.fix) == "logp = torch.log(p.clamp_min(1e-09))"
        assert "a pattern, in your names: p, the log's argument" in d.fix
        assert "torch.special.xlogy(p, p)" in d.fix
        assert 'mode="forensic" names your line' in d.fix


# ------------------------------ 5: log(1 - tanh(u)^2): no math. in a file without math


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_the_tanh_squash_fix_spells_log_2_as_a_number_where_math_is_not_imported() -> None:
    torch.manual_seed(0)
    m = _Policy()
    with torch.no_grad():
        m.lin.bias.fill_(30.0)

    def run() -> None:
        u = m(torch.randn(5, 4))
        a = torch.tanh(u)
        logp = (-0.5 * u.pow(2) - torch.log(1 - a.pow(2))).sum(-1)
        logp.mean().backward()

    d = _first(_raises(m, run, "forensic"), "NW110")
    fixed = _statement(d.fix)
    assert "math." not in fixed and "0.6931471805599453" in fixed
    assert "import math" not in d.fix
    u = m(torch.randn(5, 4)).detach()
    ns = {"torch": torch, "F": F, "u": u, "a": torch.tanh(u)}
    exec(compile(fixed, "<fix>", "exec"), ns)  # no NameError: math
    assert torch.isfinite(ns["logp"]).all()  # type: ignore[arg-type]
    small = torch.randn(5, 2)
    ns = {"torch": torch, "F": F, "u": small, "a": torch.tanh(small)}
    exec(compile(fixed, "<fix>", "exec"), ns)
    want = (-0.5 * small.pow(2) - torch.log(1 - torch.tanh(small).pow(2))).sum(-1)
    assert torch.allclose(ns["logp"], want, atol=1e-4)  # type: ignore[arg-type]
    assert text(d)
