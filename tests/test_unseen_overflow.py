"""NW101/NW103 on failures found by user testing: an overflow that the batch caused (a
FLT_MAX missing-value marker, a batch that skipped its /255), the learning-rate fix of the
user's own optimizer (its class, its lr, a scheduler that raised it), a softmax written by
hand on two lines, float16 exps that a float32 upcast cannot mend (an argument past
float32's bound, a 0-dim scale), a matmul upcast on the user's own operands, and the early
warning on float16 logits given to F.cross_entropy.

Each is checked on a tiny real model under ``nanwatch.watch`` on CPU or on hand-built
records, and the fixes that claim to be code are executed."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import StepTrace
from nanwatch.rules.overflow import _fix
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from nanwatch.stats import dtype_limits
from tests._diagnoses import first_bad, text, top

FLT_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------- the batch did it


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1)
    )


def test_a_flt_max_marker_in_the_batch_is_blamed_on_the_data_not_on_training() -> None:
    """It said 'the values grew during training' and offered clip_grad_norm_ and AdamW."""
    torch.manual_seed(0)
    model, crit = mlp(), nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(4):
            x, y = torch.randn(16, 6), torch.randn(16, 1)
            if step == 3:
                x[4, 2] = FLT_MAX  # a missing-value marker
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    t = first_bad(nw)
    d = top(nw)
    assert (t.step, d.code) == (3, "NW101")
    line = next(e for e in d.evidence if e.startswith("the batch did it"))
    assert line.startswith(
        "the batch did it: input[0] of Sequential holds max |x| = 3.4e+38, 100% of the "
        "float32 limit (at most "
    )
    assert "grew during training" not in text(d)
    assert "clip_grad_norm_" not in d.fix and "AdamW" not in d.fix
    assert d.fix.startswith("bad = x.abs().flatten(1).amax(dim=1) > ")
    # the fix finds the sample when pasted where the batch is
    x = torch.randn(16, 6)
    x[4, 2] = FLT_MAX
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(d.fix, {"x": x})
    assert out.getvalue().strip() == "[4]"


class VAE(nn.Module):
    def __init__(self, d: int = 64, z: int = 8) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, 128), nn.ReLU())
        self.mu = nn.Linear(128, z)
        self.logvar = nn.Linear(128, z)
        self.dec = nn.Linear(z, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        std = torch.exp(0.5 * self.logvar(h))
        return self.dec(self.mu(h) + std)


def test_a_batch_that_skipped_its_normalization_is_blamed_on_the_data() -> None:
    """One batch 3000 times larger (a forgotten / 255) overflowed exp at step 2: it said the
    values grew during training and clamped the log-variance."""
    torch.manual_seed(0)
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen = []
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x = torch.rand(16, 64)
            if step == 2:
                x = x * 3000
            seen.append(float(x.abs().max()))
            F.mse_loss(model(x), x).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    t = first_bad(nw)
    d = top(nw)
    assert (t.step, d.code, d.op) == (2, "NW101", "aten.exp")
    line = next(e for e in d.evidence if e.startswith("the batch did it"))
    before = max(seen[:2])
    assert line.startswith("the batch did it: input[0] of VAE holds max |x| = ")
    assert f"against at most {before:.4g} over steps 0-1" in line
    assert line.endswith("the values grew with the input, not with training")
    assert "clamp" not in d.fix and "grew during training" not in text(d)
    assert "This step's batch reached max |x| = " in d.explanation


def test_weights_that_exploded_are_not_blamed_on_a_batch() -> None:
    """A batch that jumped 20 times while the weights explode: the activations outgrew the
    input, so training is blamed, with the user's own optimizer and lr."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 10, generator=g) * 5
    y = x @ torch.randn(10, 1, generator=g)
    model, crit = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1)), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(12):
            xb = x * 20 if step == 3 else x  # the step the values overflow
            crit(model(xb), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.history[-1].anomaly is not None:
                break
    d = top(nw)
    assert d.code == "NW101"
    assert not any(e.startswith("the batch did it") for e in d.evidence)
    assert "the values grew during training (SGD lr 0.3)" in text(d)
    # the NW308 warning of step 1 sized the lr from its update: the error keeps it
    assert (
        'for g in opt.param_groups: g["lr"] = 1e-3   # was 0.3 (SGD); not 0.03: the NW308 '
        "warning of step 1 asked for 1e-3 already, the lower of the two"
    ) in d.fix
    assert "AdamW" not in d.fix and "lr / 10" not in d.fix


# ---------------------------------------------------------------- the learning rate


def test_a_scheduler_that_raised_the_lr_is_named_with_its_numbers() -> None:
    """OneCycleLR with max_lr far too high: it replaced the SGD optimizer with AdamW(lr=lr / 10),
    lr undefined."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 10, generator=g) * 5
    y = x @ torch.randn(10, 1, generator=g) + 0.1
    model, crit = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1)), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3.0, total_steps=60)
    lrs = []
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(60):
            lrs.append(opt.param_groups[0]["lr"])
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            nw.step()
            if nw.history[-1].anomaly is not None:
                break
    t = first_bad(nw)
    d = top(nw)
    assert d.code == "NW101"
    last = lrs[t.step - 1]  # the last update before the step that overflowed
    assert d.fix.splitlines()[1] == (
        f"# SGD's lr rose from {lrs[0]:.4g} at step 0 to {last:.4g} at step {t.step - 1}: a "
        "scheduler raised it (a warmup, OneCycleLR),"
    )
    assert "OneCycleLR's max_lr" in d.fix and "AdamW" not in d.fix
    assert f"(SGD lr {last:.4g}, up from {lrs[0]:.4g} at step 0)" in text(d)


# ---------------------------------------------------------------- softmax by hand


class TwoLineSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2) * 40
        e = torch.exp(scores)
        att = e / e.sum(-1, keepdim=True)
        return att @ x


def test_a_softmax_by_hand_on_two_lines_is_a_softmax_not_a_log_variance() -> None:
    """It clamped the scores at 44.3 (flattening the attention) and spoke of log-variances."""
    torch.manual_seed(0)
    m = TwoLineSoftmax()
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(torch.randn(2, 5, 8)).sum().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.exp")
    first = d.fix.splitlines()[0]
    assert first == (
        "e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # was: e = torch.exp(scores)"
    )
    assert "clamp" not in d.fix and "log-variance" not in d.explanation
    assert "softmax or logsumexp written by hand" in d.explanation
    scores = torch.tensor([[900.0, 0.0, -5.0]])
    ns: dict[str, Any] = {"torch": torch, "scores": scores}
    exec(first, ns)
    att = ns["e"] / ns["e"].sum(-1, keepdim=True)
    assert torch.allclose(att, torch.softmax(scores, -1))


# ---------------------------------------------------------------- float16 exps


class HalfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2) * 40.0
        e = scores.exp()
        attn = e / e.sum(-1, keepdim=True)
        return attn @ x


def test_a_float16_softmax_past_float32s_exp_bound_is_not_upcast() -> None:
    """The argument reached hundreds: .float().exp() still overflows; it was the fix."""
    torch.manual_seed(0)
    m = HalfAttention().half()
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(torch.randn(2, 5, 8).half() * 4).float().sum().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.exp")
    assert d.fix.splitlines()[0] == (
        "e = (scores - scores.amax(dim=-1, keepdim=True)).exp()  # was: e = scores.exp()"
    )
    assert ".float().exp()" not in d.fix
    assert any("past float32's exp bound 88.72 too" in e for e in d.evidence)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(1 / 0.07))  # not log(1 / 0.07)
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, fi: torch.Tensor, ft: torch.Tensor) -> torch.Tensor:
        fi = F.normalize(self.proj(fi), dim=-1)
        return self.logit_scale.exp() * fi @ ft.t()


def test_a_float16_zero_dim_scale_is_bounded_not_upcast() -> None:
    """self.logit_scale.float().exp() * fi @ ft.t() stays float16 (type promotion of a
    0-dim tensor): the upcast changed nothing."""
    torch.manual_seed(0)
    m = Scale().half()
    fi, ft = torch.randn(4, 4).half(), F.normalize(torch.randn(4, 4), dim=-1).half()
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(fi, ft).float().sum().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.exp")
    first = d.fix.splitlines()[0]
    assert first == (
        "return self.logit_scale.clamp(max=5.5).exp() * fi @ ft.t()"
        "  # was: return self.logit_scale.exp() * fi @ ft.t()"
    )
    assert "0-dim" in d.fix and ".float().exp()" not in d.fix
    # the bound keeps the product finite in float16
    with torch.no_grad():
        fin = F.normalize(m.proj(fi), dim=-1)
        out = m.logit_scale.clamp(max=5.5).exp() * fin @ ft.t()
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())


# ---------------------------------------------------------------- matmul in loss code


def test_a_float16_gram_in_loss_code_is_upcast_on_the_users_own_operands() -> None:
    """It printed 'out = a.float() @ b.float()', names that do not exist."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 3, padding=1).half()
    with nanwatch.watch(conv, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        f = F.relu(conv(torch.rand(1, 3, 32, 32).half() * 60)).flatten(2)
        g = f @ f.transpose(1, 2)
        g.float().mean().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.path) == ("NW101", "(loss)")
    # no autocast is in use (the conv is .half()): the upcast is the line itself, with no
    # autocast(enabled=False) block around it
    assert d.fix.splitlines()[0] == (
        "g = f.float() @ f.transpose(1, 2).float()  # was: g = f @ f.transpose(1, 2)"
    )
    assert "a.float()" not in d.fix and "attention" not in d.fix and "enabled=False" not in d.fix
    ns: dict[str, Any] = {"torch": torch, "f": f.detach()}
    exec(d.fix.splitlines()[0], ns)
    assert bool(torch.isfinite(ns["g"]).all())


def test_an_op_in_loss_code_is_worded_for_loss_code() -> None:
    lim = dtype_limits("float16")
    fix = _fix("other", "mse_loss", "float16", lim, None, device="'cpu'", loss=True)
    assert fix.startswith("# in the loss code, call mse_loss on .float() inputs")
    assert "model's forward" not in fix


# ---------------------------------------------------------------- NW103 and F.cross_entropy


def logits_step(i: int, top_value: float, *, loss: str | None) -> StepTrace:
    """A float16 model whose logits go to a functional loss (the '(loss)' call); the loss
    guard's note names the record of its input, as the watcher writes it."""
    b = TraceBuilder(i)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-2.0, 2.0, numel=64), shape=(8, 8), dtype="float16")
    fc = b.call("fc", "Linear", parent=net)
    b.input(fc, source=x, dtype="float16", shape=(8, 8))
    o = b.forward(fc, stat(-1.0, top_value, numel=32), dtype="float16", shape=(8, 4))
    b.forward(net, source=o, dtype="float16", shape=(8, 4))
    fn = b.call("(loss)", "functional", root=True, is_loss=True)
    b.forward(fn, stat(1.0, 1.0, numel=1), shape=())
    if loss is not None:
        b.note("loss_input", loss, loss=loss, input_source=o.index, input_dtype="float16")
    return b.build(loss=1.0)


def test_float16_logits_given_to_functional_cross_entropy_are_not_a_warning() -> None:
    """nn.CrossEntropyLoss was silent; F.cross_entropy on the same logits warned."""

    def codes(loss: str | None) -> list[str]:
        past = [logits_step(i, 2.0 + i, loss=loss) for i in range(8)]
        return [d.code for d in diagnose(logits_step(8, 10.0, loss=loss), past)]

    assert "NW103" not in codes("F.cross_entropy")
    assert "NW103" in codes("F.mse_loss")  # not a stable softmax: the warning stands
    assert "NW103" in codes(None)  # nothing known of the consumer
