"""Domain fixes found by user testing, checked by pasting them: a where's fractional power is
rewritten, not the Python number of its condition; an empty replay batch keeps the main
loss; a divided softmax becomes a log_softmax of its own argument; the second derivative
of a norm gets the double-where norm in watch mode too; a focal loss's named exponent is
kept."""

from __future__ import annotations

import ast
import re

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _pasted(fix: str) -> str:
    """The fix without its comment-only lines, indentation kept."""
    return "\n".join(ln for ln in fix.splitlines() if not ln.strip().startswith("#"))


def _statement(fix: str) -> str:
    """The fix's first code line (what replaces the user's line), comment dropped."""
    line = code_lines(fix).splitlines()[0]
    return line.split("   #", 1)[0].strip()


# ------------------------------ 1: where(x > d ** 3, x ** (1 / 3), ...): clamp x, not d


class _Lab(nn.Module):
    def __init__(self, body: str | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xyz = self.lin(x)
        d = 6 / 29
        if self.body is not None:  # the fix, pasted
            scope = {"torch": torch, "xyz": xyz, "d": d}
            exec(self.body, scope)
            return scope["f"]  # type: ignore[no-any-return]
        f = torch.where(xyz > d**3, xyz ** (1 / 3), xyz / (3 * d * d) + 4 / 29)
        return f


def _lab_run(m: _Lab) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    m(x).sum().backward()


def test_a_where_cube_root_clamps_the_tensor_power_not_the_number_of_its_condition() -> None:
    torch.manual_seed(0)
    m = _Lab()
    d = _first(_raises(m, lambda: _lab_run(m), "forensic"), "NW112")
    line = _statement(d.fix)
    assert "xyz.clamp_min(" in line and "** (1 / 3)" in line
    assert not re.search(r"(?<![\w.])d\.clamp_min", line) and "xyz > d**3" in line
    ast.parse(line)
    fixed = _Lab(line)
    fixed.load_state_dict(m.state_dict())
    _lab_run(fixed)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in fixed.parameters())


def _lab_f(xyz: torch.Tensor) -> torch.Tensor:
    d = 6 / 29
    return torch.where(xyz > d**3, xyz ** (1 / 3), xyz / (3 * d * d) + 4 / 29)


def test_watch_mode_keeps_the_exponent_exact_and_invents_no_condition() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    x = torch.randn(8, 4)

    def run() -> None:
        _lab_f(m(x)).sum().backward()  # loss code: its line is not known in watch mode

    d = _first(_raises(m, run, "watch"), "NW112")
    assert "** (1 / 3)" in d.fix
    assert "0.3333" not in code_lines(d.fix)
    assert "torch.where(x > 0" not in d.fix


# ------------------------------ 2: an empty replay batch: the main loss is kept


def test_an_empty_replay_batch_keeps_the_other_terms_of_the_loss() -> None:
    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    criterion = nn.CrossEntropyLoss()
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    bx, by = torch.empty(0, 6), torch.empty(0, dtype=torch.long)

    def step() -> None:
        loss = criterion(net(x), y)
        loss = loss + criterion(net(bx), by)
        loss.backward()

    try:
        with nanwatch.watch(net, criterion, mode="watch"):
            step()
        raise AssertionError("no anomaly")
    except nanwatch.AnomalyError as e:
        d = _first(e, "NW113")
    code = _pasted(d.fix)
    assert "loss = loss + criterion(net(bx), by)" in code
    assert "ignore_index" not in d.fix and "F.cross_entropy" not in d.fix
    assert "by.numel()" in code
    assert "no sample" in d.explanation
    scope = {"net": net, "criterion": criterion, "bx": bx, "by": by}
    scope["loss"] = criterion(net(x), y)
    exec(code, scope)
    assert torch.isfinite(scope["loss"])  # type: ignore[arg-type]


# ------------------------------ 4: log(p_old / p_new) of softmaxes: log_softmax of their args


class _Kd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        with torch.no_grad():
            self.lin.weight.mul_(400.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _kd_loss(out: torch.Tensor, old_out: torch.Tensor, T: float) -> torch.Tensor:
    p_old = F.softmax(old_out / T, dim=1)
    p_new = F.softmax(out / T, dim=1)
    kd = (p_old * torch.log(p_old / p_new)).sum(1).mean() * T * T
    return kd


def test_a_divided_softmax_becomes_the_log_softmax_of_its_own_argument() -> None:
    torch.manual_seed(0)
    m = _Kd()
    x = torch.randn(16, 6)
    old_out = (m(x) + 50 * torch.randn(16, 5)).detach()

    def run() -> None:
        _kd_loss(m(x), old_out, 2.0).backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    code = code_lines(d.fix)
    assert "log_p_new = F.log_softmax(out / T, dim=1)" in code
    assert "= x" not in code
    assert "0/0 is NaN" in d.explanation and "x/0 is inf" not in d.explanation
    assert "temperature (eps)" not in d.fix
    # the gradients of the step that raised dropped: read late (a GPU-bound step), the raise
    # came after its backward wrote them
    m.zero_grad(set_to_none=True)
    scope = {"F": F, "torch": torch, "out": m(x), "old_out": old_out, "T": 2.0}
    scope["p_old"] = F.softmax(old_out / 2.0, dim=1)
    exec(code, scope)
    kd = scope["kd"]
    assert isinstance(kd, torch.Tensor) and torch.isfinite(kd)
    kd.backward()
    assert m.lin.weight.grad is not None and m.lin.weight.grad.isfinite().all()


# ------------------------------ 5: force matching at d = 0: the double-where norm in watch mode


class _Rbf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.linspace(0, 2, 4))

    def forward(self, d: torch.Tensor) -> torch.Tensor:
        return torch.exp(-((d[:, None] - self.mu) ** 2))


class _Pot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rbf = _Rbf()
        self.out = nn.Linear(4, 1)

    def forward(self, pos: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        d = (pos[i] - pos[j]).norm(dim=-1)
        return self.out(self.rbf(d)).sum()


def test_force_matching_through_a_norm_at_zero_gets_the_double_where_in_watch_mode() -> None:
    torch.manual_seed(0)
    m = _Pot()
    pos = torch.randn(4, 3, requires_grad=True)
    idx = torch.arange(4)
    i, j = idx.repeat_interleave(4), idx.repeat(4)  # self pairs: d = 0

    def run() -> None:
        e = m(pos, i, j)
        (forces,) = torch.autograd.grad(-e, pos, create_graph=True)
        (forces**2).mean().backward()

    d = _first(_raises(m, run, "watch"), "NW111")
    assert "second derivative of a norm" in d.title
    assert "torch.where(d2 > 0, torch.where(d2 > 0, d2, 1).sqrt(), 0)" in d.fix
    assert "clamp_min(eps)\n" not in d.fix and not re.search(r"^y = x / d\.clamp_min", d.fix)


# ------------------------------ 6: (1 - p_t) ** self.gamma: the named exponent is kept


class _Focal(nn.Module):
    def __init__(self, gamma: float = 0.5, body: str | None = None) -> None:
        super().__init__()
        self.gamma = gamma
        self.body = body

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(logits)
        p_t = p * targets + (1 - p) * (1 - targets)
        if self.body is not None:
            scope = {"torch": torch, "p_t": p_t, "self": self}
            exec(self.body, scope)
            return scope["loss"].mean()  # type: ignore[no-any-return]
        loss = (1 - p_t) ** self.gamma * torch.log(p_t.clamp_min(1e-8))
        return loss.mean()


def test_a_focal_power_with_a_named_exponent_is_rewritten_on_the_users_line() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    with torch.no_grad():
        model.bias.fill_(-20.0)
    x, y = torch.randn(16, 8), torch.zeros(16, 4)
    crit = _Focal()

    def run() -> None:
        crit(model(x), y).backward()

    d = _first(_raises(model, run, "forensic"), "NW112")
    line = _statement(d.fix)
    assert "(1 - p_t).clamp_min(" in line and "** self.gamma" in line
    assert "y = torch.where(x > 0" not in d.fix and "** 0.5" not in line
    model.zero_grad()
    fixed = _Focal(body=line)
    fixed(model(x), y).backward()
    assert model.weight.grad is not None and model.weight.grad.isfinite().all()
