"""Unseen multi-task models, follow-ups: an op given a non-finite Python number (a
gradient-reversal lambda 1 / (1 - p) at p = 1) did not overflow (NW111, not NW101); NW113's
fix for one task's empty selection divides that term alone; an exp or a log of a loose
parameter (uncertainty weighting's log_vars, sigma) names it and the lr of its own param
group; NW101 after a forgotten zero_grad() fixes the reset, not the lr."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase, TensorStat
from nanwatch.rules._evidence import classify
from tests._diagnoses import code_lines, text, top
from tests.zoo import TwoTasks

# ---------------------------------------------------------------- a non-finite number given


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lambd: float) -> torch.Tensor:
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g.neg() * ctx.lambd, None


class _Dann(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.label_head = nn.Linear(16, 3)
        self.domain_head = nn.Linear(16, 1)
        self.lambd = 0.0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.label_head(f), self.domain_head(_Reverse.apply(f, self.lambd))


def test_a_backward_multiplied_by_an_inf_lambda_is_a_number_given_not_an_overflow() -> None:
    torch.manual_seed(0)
    model = _Dann()
    model.lambd = math.inf  # 1 / (1 - p) at p = 1
    with nanwatch.watch(model, on_anomaly="record", postmortem=False, mode="forensic") as nw:
        y, d = model(torch.randn(16, 8))
        loss = F.cross_entropy(y, torch.randint(0, 3, (16,))) + d.pow(2).mean()
        loss.backward()
        nw.step()
    diag = top(nw)
    assert diag.code == "NW111", text(diag)
    assert "not an overflow" in diag.title
    assert "other=inf (ctx.lambd)" in diag.evidence[0]
    assert "lr" not in diag.fix and "clip_grad_norm_" not in diag.fix
    first = diag.fix.splitlines()[0]
    assert first.startswith("return g.neg() * min(ctx.lambd, 1e3), None")
    assert "1 / (1 - p)" in diag.fix and "p = 1" in diag.explanation
    # pasted into the backward: a finite, reversed gradient
    g = torch.randn(4)
    ns: dict[str, Any] = {"g": g, "ctx": type("C", (), {"lambd": math.inf})()}
    exec(f"def bw():\n    {first.split('  #')[0]}\nout = bw()", ns)
    assert torch.isfinite(ns["out"][0]).all() and torch.equal(ns["out"][0], -g * 1e3)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        h = h * self.scale
        return self.head(h)


def test_a_forward_scaled_by_an_inf_number_names_it_and_bounds_it_on_the_line() -> None:
    torch.manual_seed(0)
    model = _Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            model.scale = 1.0 / (1.0 - step / 2) if step < 2 else math.inf
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    diag = top(nw)
    assert diag.code == "NW111", text(diag)
    assert "self.scale" in diag.evidence[0] and "grew during training" not in text(diag)
    first = diag.fix.splitlines()[0].split("  #")[0].strip()
    assert first == "h = h * min(self.scale, 1e3)"
    ns: dict[str, Any] = {"h": torch.randn(3), "self": model}
    exec(first, ns)
    assert torch.isfinite(ns["h"]).all()


def test_the_classifier_reads_a_non_finite_number_argument_but_keeps_a_minus_inf_mask() -> None:
    x = TensorStat(-0.004, 0.003, 8, nan=0, posinf=0, neginf=0)
    out = TensorStat(-math.inf, math.inf, 8, nan=0, posinf=4, neginf=4)
    grl = OpEvent(
        "aten.mul.Tensor", Phase.BACKWARD, None, "-inf", out, [("self", x)],
        {"other": math.inf}, node="GradReverseBackward", dtype="float32",
    )  # fmt: skip
    assert classify(grl) == "inf-input"
    ones = TensorStat(1.0, 1.0, 8, nan=0, posinf=0, neginf=0)
    mask = OpEvent(
        "aten.mul.Tensor", Phase.FORWARD, "attn", "-inf",
        TensorStat(-math.inf, -math.inf, 8, nan=0, posinf=0, neginf=8), [("self", ones)],
        {"other": -math.inf}, dtype="float32", injected=True,
    )  # fmt: skip
    assert classify(mask) == "injected"  # torch.ones(n, n) * -inf: a causal mask, on purpose


class _Att(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ x.transpose(-1, -2)
        s = s + (1 - mask) * float("-inf")
        return s.softmax(-1) @ x


def test_a_mask_multiplied_by_a_literal_minus_inf_gets_the_finite_minimum() -> None:
    torch.manual_seed(0)
    m = _Att()
    x = torch.randn(2, 3, 4)
    mask = torch.ones(2, 3, 3)
    mask[0, 1] = 0
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(x, mask).sum().backward()
        nw.step()
    diag = top(nw)
    assert diag.code == "NW111", text(diag)
    assert "schedule" not in diag.explanation and "0 × inf is NaN" in diag.explanation
    first = diag.fix.splitlines()[0].split("  #")[0].strip()
    assert first == "s = s + (1 - mask) * torch.finfo(torch.float32).min"
    ns: dict[str, Any] = {"torch": torch, "s": torch.randn(2, 3, 3), "mask": mask}
    exec(first, ns)
    p = ns["s"].softmax(-1)
    assert torch.isfinite(p).all() and p[0, 1].max() < 1.0  # masked, no NaN


# ---------------------------------------------------------------- NW113: one task's term


def test_an_empty_task_selection_fix_divides_only_that_tasks_term() -> None:
    torch.manual_seed(0)
    model = TwoTasks()
    bce = nn.BCEWithLogitsLoss()
    with nanwatch.watch(model, bce, on_anomaly="record", postmortem=False) as nw:
        x, ya = torch.randn(16, 8), torch.randint(0, 4, (16,))
        yb = (torch.rand(16, 1) < 0.5).float()
        m = torch.zeros(16, dtype=torch.bool)  # no sample carries task A's label
        la, lb = model(x)
        loss = bce(lb, yb) + F.cross_entropy(la[m], ya[m])
        loss.backward()
        nw.step()
    diag = top(nw)
    assert diag.code == "NW113", text(diag)
    first = diag.fix.splitlines()[0].split("  #")[0].strip()
    assert first == (
        "loss = bce(lb, yb) + F.cross_entropy(la[m], ya[m], reduction='sum') / "
        "(ya[m] != -100).sum().clamp_min(1)"
    )
    assert "loss = loss /" not in diag.fix
    la, lb = torch.randn(16, 4), torch.randn(16, 1)
    for m in (torch.rand(16) < 0.5, torch.zeros(16, dtype=torch.bool)):
        ns: dict[str, Any] = {"F": F, "bce": bce, "la": la, "lb": lb, "ya": ya, "yb": yb, "m": m}
        exec(first, ns)
        task_a = F.cross_entropy(la[m], ya[m]) if m.any() else torch.tensor(0.0)
        assert torch.allclose(ns["loss"], bce(lb, yb) + task_a)  # task B's term untouched


# ---------------------------------------------------------------- loose parameters


def _uncertainty_run(inside: bool, mode: str = "watch") -> nanwatch.Watcher:
    """Kendall weighting: the solved task's loss is 0, its log-variance runs down by
    Adam's lr (5, its own group) per step, and exp(-log_vars) overflows at step 1."""
    torch.manual_seed(0)
    model = TwoTasks()
    log_vars = nn.Parameter(torch.tensor([-85.0, 0.0]))
    if inside:
        model.log_vars = log_vars
    rest = [p for n, p in model.named_parameters() if n != "log_vars"]
    opt = torch.optim.Adam([{"params": rest}, {"params": [log_vars], "lr": 5.0}], lr=1e-3)
    x, yc = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False, mode=mode) as nw:
        for _ in range(3):
            c, r = model(x)
            losses = torch.stack([(r.detach() * 0).pow(2).mean(), F.cross_entropy(c, yc)])
            loss = (torch.exp(-log_vars) * losses + log_vars).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


def test_an_exp_of_log_vars_in_the_model_is_not_blamed_on_the_models_lr() -> None:
    # the exp's argument was not kept and no weight magnitude past exp's bound was recorded:
    # nothing names log_vars (a parameter matched by element count alone was a wrong claim
    # for a constant table), and the model's lr is not quoted as if it were the cause
    diag = top(_uncertainty_run(inside=True))
    assert diag.code == "NW101", text(diag)
    grew = next(e for e in diag.evidence if "passed 88.72" in e)
    assert "not known" in grew and "0.001" not in grew


def test_an_exp_of_log_vars_outside_the_model_does_not_quote_the_models_lr() -> None:
    diag = top(_uncertainty_run(inside=False))
    grew = next(e for e in diag.evidence if "passed 88.72" in e)
    assert "0.001" not in grew and "not known" in grew


def test_the_line_names_log_vars_and_is_no_hand_written_softmax() -> None:
    diag = top(_uncertainty_run(inside=False, mode="forensic"))
    assert diag.code == "NW101", text(diag)
    grew = next(e for e in diag.evidence if "exploded" in e)
    assert "-log_vars" in grew and "not known" in grew and "0.001" not in grew
    assert "amax" not in diag.fix and "softmax" not in diag.explanation
    assert diag.fix.startswith(
        "loss = (torch.exp((-log_vars).clamp(max=44.3)) * losses + log_vars).sum()"
    )


class _Sigma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.sigma = nn.Parameter(torch.tensor([1.0, 0.1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def _sigma_run(mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = _Sigma()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False, mode=mode) as nw:
        for _ in range(3):
            L = torch.stack([F.cross_entropy(model(x), y), torch.tensor(0.0)])
            loss = (L / (2 * model.sigma**2) + torch.log(model.sigma)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


def test_a_log_of_a_parameter_pushed_below_zero_is_reparameterized_not_log_softmax() -> None:
    diag = top(_sigma_run("watch"))
    assert diag.code == "NW110", text(diag)
    assert any("parameter sigma" in e and "SGD lr 0.3" in e for e in diag.evidence)
    assert "underflow to exactly 0" not in diag.explanation
    assert "log_softmax" not in diag.fix and "softplus(model.sigma)" in diag.fix


def test_the_sigma_fix_on_the_users_line_runs_and_stays_finite() -> None:
    diag = top(_sigma_run("forensic"))
    assert diag.code == "NW110", text(diag)
    code = code_lines(diag.fix)
    assert "loss = (L / (2 * sigma**2) + torch.log(sigma)).sum()" in code
    model = _Sigma()
    with torch.no_grad():
        model.sigma.fill_(-0.8)  # where the update left it
    ns: dict[str, Any] = {"torch": torch, "model": model, "L": torch.tensor([1.0, 0.0])}
    exec(code, ns)
    assert torch.isfinite(ns["loss"])


# ---------------------------------------------------------------- gradients never reset


def test_an_overflow_after_a_forgotten_zero_grad_fixes_the_reset_not_the_lr() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    watch = nanwatch.watch(
        model, nn.MSELoss(), on_anomaly="record", postmortem=False, ignore=["NW307"]
    )
    with watch as nw:
        for _ in range(300):
            x = torch.randn(64, 8)
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            opt.step()  # zero_grad() forgotten
            nw.step()
            if nw.history[-1].anomaly is not None:
                break
    diag = top(nw)
    assert diag.code == "NW101", text(diag)
    assert diag.fix.splitlines() == [
        diag.fix.splitlines()[0],
        "# a lower lr or gradient clipping only delays the overflow: the gradients are never "
        "reset (NW307)",
    ]
    assert diag.fix.startswith("opt.zero_grad()")  # the user's own optimizer
    assert "never reset (no zero_grad())" in diag.explanation
    assert "learning rate too high" not in diag.explanation
    assert "clip_grad_norm_" not in diag.fix
