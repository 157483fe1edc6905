"""Follow-ups found by user testing: a GradScaler coming down from an oversized init scale
is not a collapse, and one that collapses because backward makes a NaN names where;
NW113's fix for an all-ignored cross-entropy keeps the loss's options; a hand-written
logsumexp over an empty row; number ** tensor overflow names the base; a recurrence whose
output grows call after call; weight standardization over a single element.

Each is checked on a tiny real model under ``nanwatch.watch`` on CPU or on hand-built
records, and every fix that claims to be code is executed."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis
from nanwatch.rules.testing import stat
from tests import zoo
from tests._diagnoses import counted, top

NAN, INF = math.nan, math.inf


def all_diagnoses(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


# ---------------------------------------------------------------- NW305: GradScaler


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def test_a_scaler_settling_from_an_oversized_init_scale_is_not_a_collapse() -> None:
    """init_scale=2**40: the first ~20 steps overflow float16 and are skipped while the
    scale halves down to a working value (2**18 here), then training goes on. It was an
    NW305 warning, 'scale fell from 1.1e+12 to 1.07e+09'."""
    model, crit = mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=5)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(30):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = crit(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    assert scaler.get_scale() == 2.0**18  # it settled
    assert all_diagnoses(nw, "NW305") == []


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((self.enc(a) - self.enc(b)) ** 2).sum(-1))


def siamese_run(mode: str) -> Any:
    """One anchor equals its positive in every batch: sqrt(0)'s gradient is inf, × 0 = NaN,
    at any scale; the scaler skips every step."""
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    scaler = torch.amp.GradScaler("cpu")
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(18):
            a = torch.randn(16, 16)
            b = a + 0.1 * torch.randn(16, 16)
            b[3] = a[3]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(a, b).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    return nw


def test_a_scaler_collapse_from_a_nan_born_in_backward_names_the_op_and_its_fix() -> None:
    """The evidence was only 'non-finite (scaled) gradients' and a debugging recipe; the
    same model without a scaler gets NW112 on the sqrt."""
    nw = siamese_run("forensic")
    ds = all_diagnoses(nw, "NW305")
    assert ds, "no NW305"
    d = ds[-1]
    assert d.severity == "error" and d.path == "Siamese"
    assert any("holds NaN and no inf" in e for e in d.evidence)
    assert any(e.startswith("NW112 sqrt or fractional power at zero") for e in d.evidence)
    assert "F.pairwise_distance(x1, x2)" in d.fix
    # the fix runs and its gradient at identical vectors is finite
    a = torch.randn(4, 8, requires_grad=True)
    b = a.detach().clone()
    ns: dict[str, Any] = {"torch": torch, "F": F, "x": a - b, "x1": a, "x2": b}
    exec(d.fix.splitlines()[0], ns)
    ns["norm"].sum().backward()
    assert a.grad is not None and torch.isfinite(a.grad).all()


@pytest.mark.accelerator_weaker(
    reason="the bad gradient is freed before the read: NaN and inf are not told apart"
)
def test_an_untraced_scaler_collapse_names_the_sqrt_from_the_records() -> None:
    nw = siamese_run("watch")
    d = all_diagnoses(nw, "NW305")[0]
    # a NaN born from finite gradients, twice in a row, is said then, not after 10 skips
    assert d.step <= 2 and (d.severity, d.path) == ("error", "Siamese")
    assert any("NaN gradient born in the backward of code in Siamese" in e for e in d.evidence)
    assert any("made by SqrtBackward0 and holds exact zeros" in e for e in d.evidence)
    assert "F.pairwise_distance(x1, x2)" in d.fix


def test_a_scaler_collapse_from_loss_code_names_the_loss_op_and_its_fix() -> None:
    """An RMSE written in the loop, sqrt(mean(d ** 2)), whose residual is exactly zero:
    without a scaler it is NW112 on the loss code's sqrt; with one, NW305 said only
    'detect_anomaly' because the loss code's backward nodes were not checked in scaled
    steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(12):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            out = model(x)
            d = out - y if step < 3 else (out - y) * 0
            loss = torch.sqrt((d**2).mean())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            nw.step()
    d305 = all_diagnoses(nw, "NW305")[0]
    # zero residuals from step 3: the second NaN-born step says it, not the tenth skip
    assert (d305.step, d305.path) == (4, "(loss)")
    # named by the line that made the sqrt (the statement that assigned loss)
    assert any("[op aten.sqrt in the backward of " in e for e in d305.evidence)
    assert any(e.startswith("NW112 sqrt or fractional power at zero") for e in d305.evidence)
    assert "loss = torch.sqrt((d**2).mean() + 1e-12)" in d305.fix  # that line, with eps


class UnitNorm(torch.autograd.Function):
    """x / |x| with a hand-written backward: (g - y (g·y)) / |x| is 0/0 at a zero row."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        n = x.norm(dim=-1, keepdim=True)
        y = x / n.clamp_min(1e-6)
        ctx.save_for_backward(y, n)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        y, n = ctx.saved_tensors
        return (g - y * (g * y).sum(-1, keepdim=True)) * (n > 0) / n


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(UnitNorm.apply(self.enc(x)))


@pytest.mark.accelerator_weaker(
    reason="the bad gradient is freed before the read: NaN and inf are not told apart"
)
def test_a_scaler_collapse_no_rule_explains_gives_the_backward_recipe() -> None:
    torch.manual_seed(0)
    model, crit = Normed(), nn.CrossEntropyLoss()
    with torch.no_grad():
        model.enc.bias.zero_()  # an all-zero sample gives a zero row: 0/0 in backward
    opt = torch.optim.SGD(model.parameters(), 0.01)
    scaler = torch.amp.GradScaler("cpu")
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(11):
            x = torch.randn(16, 8)
            x[0] = 0.0
            with torch.autocast("cpu", dtype=torch.float16):
                loss = crit(model(x), torch.randint(0, 2, (16,)))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    d = all_diagnoses(nw, "NW305")[0]
    assert d.evidence[3].startswith(
        "NaN gradient born in the backward of code in Normed that used the output of enc: "
        "the first non-finite gradient holds NaN and no inf"
    )
    assert "torch.autograd.detect_anomaly()" in d.fix
    assert "scaler.scale(loss).backward()" in d.fix
    assert 'nanwatch.watch(model, criterion, mode="forensic")' in d.fix


# ---------------------------------------------------------------- NW113: loss options


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x))


def test_the_all_ignored_fix_keeps_label_smoothing_and_divides_by_the_counted_weight() -> None:
    """The fix was F.cross_entropy(logits, y, ignore_index=-100, reduction='sum') / count:
    the criterion's label_smoothing and class weights were dropped."""
    torch.manual_seed(0)
    model = Tagger()
    crit = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 6), label_smoothing=0.1)
    C = 6
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x, y = torch.randint(0, 50, (4, 8)), torch.randint(0, C, (4, 8))
            if step == 2:
                y[:] = -100
            logits = model(x)
            loss = crit(logits.reshape(-1, C), y.reshape(-1))
            loss.backward()
            nw.step()
    d = top(nw)
    assert d.code == "NW113"
    assert d.fix.splitlines()[:3] == [
        "t = y.reshape(-1)",
        "loss = F.cross_entropy(logits.reshape(-1, C), t, weight=crit.weight, "
        "label_smoothing=0.1, ignore_index=-100, reduction='sum')",
        "loss = loss / crit.weight[t[t != -100]].sum().clamp_min(1e-12)   # 0, not NaN, when "
        "no target counts or the batch weighs nothing",
    ]
    # pasted: the criterion's own value on a batch with ignored targets, 0 on an empty one
    code = "\n".join(d.fix.splitlines()[:3])
    logits = torch.randn(4, 8, C)
    y = torch.randint(0, C, (4, 8))
    y[0] = -100
    ns: dict[str, Any] = {"F": F, "crit": crit, "logits": logits, "y": y, "C": C}
    exec(code, ns)
    assert torch.allclose(ns["loss"], crit(logits.reshape(-1, C), y.reshape(-1)))
    ns["y"] = torch.full((4, 8), -100)
    exec(code, ns)
    assert ns["loss"].item() == 0.0


# ---------------------------------------------------------------- a hand-written logsumexp


class MDN(nn.Module):
    """Mixture density network: per-component log-likelihoods of the target."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 32), nn.Tanh())
        self.pi, self.mu, self.log_sigma = nn.Linear(32, 5), nn.Linear(32, 5), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        normal = torch.distributions.Normal(self.mu(h), self.log_sigma(h).exp())
        return F.log_softmax(self.pi(h), -1) + normal.log_prob(y)


def test_a_hand_written_logsumexp_over_an_empty_row_gets_torch_logsumexp_and_a_row_filter() -> None:
    """The second fix was 'lp - m.clamp_min(finfo.min)': pasted, an empty row is still
    log(0) = -inf and the loss +inf."""
    torch.manual_seed(0)
    net = MDN()
    with nanwatch.watch(net, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x = torch.randn(16, 2)
            y = x[:, :1].sin()
            lp = net(x, y)
            active = torch.ones(16, 5, dtype=torch.bool)
            if step == 2:
                active[7] = False  # a sample whose every component was pruned
            lp = lp.masked_fill(~active, float("-inf"))
            m = lp.max(-1, keepdim=True).values
            ll = (m + torch.log(torch.exp(lp - m).sum(-1, keepdim=True))).squeeze(-1)
            loss = -ll.mean()
            loss.backward()
            nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW402", "aten.sub.Tensor")
    assert d.fix.splitlines() == [
        "ll = torch.logsumexp(lp, dim=-1, keepdim=True).squeeze(-1)   # was m + "
        "log(sum(exp(lp - m))): -inf - (-inf) on an empty row",
        "keep = active.any(dim=-1)   # rows with a value left: an empty row's logsumexp is "
        "log(0) = -inf",
        "ll = ll[keep]   # leave the empty rows out of the loss",
    ]
    # pasted in place of the hand-written line: a finite loss and finite gradients
    lp = net(x, y).masked_fill(~active, float("-inf"))
    ns: dict[str, Any] = {"torch": torch, "lp": lp, "active": active}
    exec(d.fix, ns)
    loss = -ns["ll"].mean()
    net.zero_grad()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_the_forensic_rerun_names_a_criterion_only_when_one_was_watched() -> None:
    from nanwatch.records import OpEvent, Phase, StepTrace
    from nanwatch.rules.testing import TraceBuilder, diagnose

    def trace(*, criterion: bool) -> StepTrace:
        neg = counted(-INF, 1.0, neginf=2, numel=6)
        ev = OpEvent(
            "aten.sub.Tensor",
            Phase.FORWARD,
            "block",
            "NaN",
            counted(NAN, NAN, nan=2, numel=6),
            [("self", neg), ("other", neg)],
            source="model.py:9",
            code="y = x - m[idx]",
            dtype="float32",
        )
        b = TraceBuilder(0)
        net = b.call("Net", root=True)
        x = b.input(net, stat(-1.0, 1.0))
        blk = b.call("block", "Block", parent=net)
        b.input(blk, source=x)
        b.forward(blk, counted(NAN, NAN, nan=2))
        b.op(ev)
        if criterion:
            b.call("MSELoss", "MSELoss", root=True, is_loss=True)
        t = b.build()
        assert t.anomaly is not None
        t.anomaly.op = ev
        return t

    alone = diagnose(trace(criterion=False))[0]
    assert alone.fix.splitlines()[:2] == [
        'with nanwatch.watch(model, mode="forensic") as nw:   # names the op that made the inf',
        "    ...   # the same step: forward, loss, backward()",
    ]
    with_loss = diagnose(trace(criterion=True))[0]
    assert with_loss.fix.splitlines()[:2] == [
        'with nanwatch.watch(model, criterion, mode="forensic") as nw:   # names the op that '
        "made the inf",
        "    loss = criterion(model(x), y); loss.backward()",
    ]


# ---------------------------------------------------------------- number ** tensor overflow


def test_a_number_to_a_tensor_power_names_the_base_and_the_power_that_overflowed() -> None:
    """It said 'inputs up to |x| = 0.875': the exponent, not the value that overflowed."""
    torch.manual_seed(0)
    m = zoo.Rope().half()
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(torch.randn(2, 4, 16, dtype=torch.float16)).float().sum().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.pow.Scalar")
    assert d.evidence[0] == (
        "aten.pow.Scalar raised 1e+06 to the powers of its input: 1e+06 ** 0.875 = 1.778e+05 "
        "> 65504 (float16's max)"
    )
    assert d.fix.splitlines() == [
        "theta = 1e6 ** (i / 16).float()   # float32: 1e+06 ** 0.875 = 1.778e+05 does not "
        "fit float16",
        "# and keep what uses theta in float32: cast only bounded results (its cos, sin) to "
        "torch.float16",
    ]
    ns: dict[str, Any] = {"i": torch.arange(0, 16, 2, dtype=torch.float16)}
    exec(d.fix, ns)
    assert ns["theta"].dtype == torch.float32 and torch.isfinite(ns["theta"]).all()


# ---------------------------------------------------------------- a loop that diverges


class Field(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[-30.0, 0.0], [0.0, -1.0]]))
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class EulerODE(nn.Module):
    """Explicit Euler with dt = 0.1 on a stiff field (λ = -30): |1 + dt·λ| = 2 per step."""

    def __init__(self) -> None:
        super().__init__()
        self.f = Field()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            x = x + 0.1 * self.f(x)
        return x


def test_an_explicit_euler_loop_that_diverges_is_named_a_recurrence_not_a_deep_net() -> None:
    """It got deep-net fixes (LayerNorm, xavier_uniform_, clip_grad_norm_ in float32; a
    float32 matmul here), at step 0 before any update: the loop's step is the cause."""
    torch.manual_seed(0)
    model = EulerODE().half()
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x0 = torch.randn(8, 2, dtype=torch.float16)
        (model(x0).float() ** 2).mean().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.path) == ("NW101", "f.lin")
    loop = [e for e in d.evidence if "times in this forward" in e]
    # the numbers follow the random start (torch 2.13 draws max |x| 33.5 -> 34304)
    assert len(loop) == 1
    m = re.fullmatch(
        r"f\.lin was called 12 times in this forward and its output grew call after call, "
        r"from max \|x\| ([\d.]+) to ([\d.]+) \(×2 per call\): a recurrence or an "
        r"integrator that diverges, not a deep stack of layers",
        loop[0],
    )
    assert m is not None, loop[0]
    assert 2.0**9 <= float(m[2]) / float(m[1]) <= 2.0**11  # doubling over the 12 calls
    assert "a smaller dt" in d.fix and "autocast" not in d.fix  # float32 would only delay it


# ---------------------------------------------------------------- a std over one element


class WSConv2d(nn.Conv2d):
    """Weight-standardized convolution: each filter's weights to mean 0, std 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = WSConv2d(1, 8, 1)  # one input channel, 1x1 kernel: a fan-in of 1
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.stem(x)).mean((2, 3)))


def test_a_std_over_a_single_weight_is_not_fixed_with_correction_0_or_drop_last() -> None:
    """correction=0 turned the NaN into all-zero weights (w - mean of one element), and
    drop_last has nothing to do with a reduction over weights."""
    torch.manual_seed(0)
    model, crit = Stem(), nn.CrossEntropyLoss()
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        crit(model(torch.randn(4, 1, 8, 8)), torch.randint(0, 3, (4,))).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW113", "aten.std.correction")
    assert d.evidence[1] == (
        "this batch has 4 samples: the element reduced is not a batch of one (a weight's "
        "fan-in or a feature dimension of size 1)"
    )
    assert "correction=0)" not in d.fix and "drop_last" not in d.fix
    assert "use a plain nn.Conv2d where the reduced dimensions hold 1 element" in d.fix
