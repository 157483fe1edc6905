"""Diagnoses for domain failures found by user testing: a number raised to a float16 tensor
power that overflows (rotary embeddings), a cross-entropy whose every target is ignored
while the logits hold a -inf column, a division by an integer count, by a distribution's
scale, in the backward of svd, the gradient of xlogy at 0, the sqrt of negative
predictions, and catch-all and learning-rate fixes that must run when pasted.

Each is checked on a tiny real model under ``nanwatch.watch`` on CPU or on hand-built
records, and every fix that claims to be code is executed."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase, StepTrace
from nanwatch.rules._evidence import classify, rewrite_divisor, statements
from nanwatch.rules.base import Diagnosis
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests import zoo
from tests._diagnoses import counted, text, top

NAN, INF = math.nan, math.inf


def code_lines(fix: str) -> str:
    """The fix without its comment-only lines."""
    return "\n".join(ln for ln in fix.splitlines() if not ln.lstrip().startswith("#"))


# ---------------------------------------------------------------- number ** tensor


def test_a_number_raised_to_a_float16_tensor_power_is_an_overflow_not_a_root() -> None:
    """It was NW112 'sqrt or fractional power at zero or below' with 'aten.pow.Scalar at 0
    is inf': the exponent tensor was read as the base."""
    torch.manual_seed(0)
    m = zoo.Rope().half()
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        m(torch.randn(2, 4, 16, dtype=torch.float16)).float().sum().backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten.pow.Scalar")
    assert "65504" in text(d) and "sqrt" not in d.fix


def pow_scalar(base: float, born: str) -> OpEvent:
    out = counted(1.0, INF, posinf=7, numel=8) if born == "+inf" else counted(NAN, NAN, nan=8)
    return OpEvent(
        "aten.pow.Scalar",
        Phase.FORWARD,
        "rope",
        born,
        out,
        [("exponent", counted(0.0, 0.875, zeros=1, numel=8))],
        scalars={"self": base},
        dtype="float16",
    )


def test_a_scalar_base_is_read_from_the_scalars_not_from_the_exponent_tensor() -> None:
    assert classify(pow_scalar(1e6, "+inf")) == "overflow"
    assert classify(pow_scalar(-2.0, "NaN")) == "root"  # (-2) ** 0.5 is NaN


# ---------------------------------------------------------------- every target ignored


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.out(h)
        logits[..., 0] = float("-inf")  # never emit PAD = 0
        return logits


def test_every_target_ignored_with_a_minus_inf_column_is_a_mean_over_nothing() -> None:
    """It was NW110 'Log of zero': the -inf column was blamed for the 0/0 of the mean."""
    torch.manual_seed(0)
    model, crit = Decoder(), nn.CrossEntropyLoss(ignore_index=0)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            y = torch.randint(1, 5, (6,)) if step < 2 else torch.zeros(6, dtype=torch.long)
            crit(model(torch.randn(6, 8)), y).backward()
            nw.step()
    d = top(nw)
    assert d.code == "NW113" and d.op == "aten.nll_loss_forward"
    assert d.evidence[0] == "all 6 targets equal ignore_index=0"
    assert "(y != 0).sum().clamp_min(1)" in d.fix


# ---------------------------------------------------------------- NW100's inspection code


class Pair(nn.Module):
    """Returns a tuple, like nn.MultiheadAttention."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x / 0.0 * 0.0, x


def unknown_op(code: str) -> StepTrace:
    ev = OpEvent(
        "aten.histc.default",
        Phase.FORWARD,
        "block",
        "NaN",
        counted(NAN, NAN, nan=2, numel=6),
        [("self", counted(-1.0, 1.0, numel=6))],
        source="model.py:9",
        code=code,
        dtype="float32",
    )
    b = TraceBuilder(0)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-1.0, 1.0))
    blk = b.call("block", "Block", parent=net)
    b.input(blk, source=x)
    b.forward(blk, counted(NAN, NAN, nan=2))
    b.op(ev)
    t = b.build()
    assert t.anomaly is not None
    t.anomaly.op = ev
    return t


@pytest.mark.parametrize(
    "line",
    [
        "a, _ = attn(h)",
        "with torch.no_grad(): out = enc(h)",
        "out = enc(h); n = 1  # count",
        "(a, b) = attn(h)",
        "return attn(h)",
        "if True: a, _ = attn(h)",
    ],
)
def test_the_catch_all_inspection_code_runs_after_any_line(line: str) -> None:
    """It wrote 'out = a, _ = attn(...)' then torch.isfinite of a tuple (TypeError), and
    'out = with torch.no_grad(): ...' (SyntaxError)."""
    d = diagnose(unknown_op(line))[0]
    assert d.code == "NW100"
    pair = Pair()
    ns: dict[str, Any] = {"torch": torch, "attn": pair, "enc": pair, "h": torch.ones(3)}
    user = line.replace("return ", "res = ")
    exec(compile(user, "<user>", "exec"), ns)
    exec(compile(d.fix, "<fix>", "exec"), ns)
    assert int(ns["bad"].sum()) == 3


def test_the_forensic_rerun_names_only_a_watched_criterion() -> None:
    """It said nanwatch.watch(model, criterion, ...) to a user who watched no criterion."""
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        x, t = torch.randn(4, 3), torch.zeros(4, 1)
        target = -torch.randn(4, 1) / t.sqrt()  # no graph: nothing traced it
        ((m(x) - target) ** 2).mean().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW100"
    # the subtraction saves no operand; the one local holding inf is named (target), not
    # a forensic rerun that could trace nothing (target has no graph)
    assert d.title == "Non-finite tensor computed without gradients, read by the loss"
    assert "operand of sub (target)" in " | ".join(d.evidence)
    assert "criterion" not in d.fix
    compile(d.fix, "<fix>", "exec")


# ---------------------------------------------------------------- an integer count


def per_sentence(tok: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return (tok.sum(1) / lengths).mean()


def per_token(tok: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return tok.sum() / mask.sum()


def tagger_step(mode: str, lengths: torch.Tensor, loss_fn: Any = per_sentence) -> Diagnosis:
    torch.manual_seed(0)
    m, crit = nn.Linear(4, 3), nn.CrossEntropyLoss(reduction="none")
    with nanwatch.watch(m, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        x, y = torch.randn(3, 5, 4), torch.randint(0, 3, (3, 5))
        mask = torch.arange(5)[None] < lengths[:, None]
        tok = crit(m(x).transpose(1, 2), y) * mask
        loss_fn(tok, mask, lengths).backward()
        nw.step()
    return top(nw)


def test_a_division_by_an_integer_count_of_zero_gets_a_fix_that_runs() -> None:
    """The fix was eps = torch.finfo(d.dtype).eps: a TypeError for int64."""
    lengths = torch.tensor([5, 0, 3])
    d = tagger_step("forensic", lengths)
    assert d.code == "NW111" and d.op == "aten.div.Tensor"
    assert d.evidence[0] == (
        "denominator is an integer tensor (a count) holding 0: min 0, max 5 (3 values)"
    )
    first = d.fix.splitlines()[0]
    assert first.startswith("return (tok.sum(1) / lengths.clamp_min(1)).mean()")
    ns: dict[str, Any] = {"tok": torch.ones(3, 5), "lengths": lengths}
    exec(first.replace("return ", "loss = ", 1), ns)
    assert torch.isfinite(ns["loss"])


def test_an_integer_denominator_read_from_the_graph_is_clamped_to_one() -> None:
    """Watch mode reads the count autograd saved for the division (min 0)."""
    d = tagger_step("watch", torch.tensor([0, 0, 0]), per_token)
    assert d.code == "NW111"
    assert "denominator is an integer tensor (a count) holding 0" in d.evidence[0]
    assert "finfo" not in d.fix
    ns: dict[str, Any] = {"torch": torch, "x": torch.ones(3), "d": torch.tensor([5, 0, 3])}
    exec(d.fix.splitlines()[0].split("#")[0], ns)
    assert torch.isfinite(ns["y"]).all()


def test_rewrite_divisor_reads_past_a_compound_header() -> None:
    fixed = rewrite_divisor("else: loss = (t / n).mean()  # avg", lambda e: f"{e}.clamp_min(1)")
    assert fixed == "loss = (t / n.clamp_min(1)).mean()"
    assert statements("with torch.no_grad(): y = f(x[:, 0]); z = 1") == ["y = f(x[:, 0])", "z = 1"]


# ---------------------------------------------------------------- a distribution's scale


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu, self.log_std = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(x), F.softplus(self.log_std(x))


def test_a_division_inside_a_distribution_names_its_scale() -> None:
    """It got the template 'x / d.clamp_min(eps)', names that are not the user's."""
    torch.manual_seed(0)
    pol = Policy()
    with torch.no_grad():
        pol.log_std.bias.fill_(-120.0)  # softplus(-120) is 0 in float32
    with nanwatch.watch(pol, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        mu, std = pol(torch.randn(8, 4))
        dist = torch.distributions.Normal(mu, std, validate_args=False)
        (-dist.log_prob(torch.randn(8, 2)).sum()).backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW111"
    assert "inside torch.distributions" in text(d)
    assert d.explanation.startswith("The distribution's scale is exactly 0")
    ns: dict[str, Any] = {
        "torch": torch,
        "F": F,
        "raw": torch.full((8, 2), -120.0),
        "log_std": torch.full((8, 2), -120.0),
        "mu": torch.zeros(8, 2),
    }
    exec(d.fix, ns)
    assert torch.isfinite(ns["dist"].log_prob(torch.randn(8, 2))).all()


# ---------------------------------------------------------------- svd's backward


class Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        C = h.T @ h / h.shape[0]
        U, _, _ = torch.linalg.svd(C)
        return h @ U


def test_svd_backward_at_repeated_singular_values_is_named_with_a_jitter_that_works() -> None:
    """It was 'the std of a feature that did not vary' with x / d.clamp_min(eps)."""
    torch.manual_seed(0)
    model = Spectral()
    with torch.no_grad():
        model.proj.weight.zero_()
        model.proj.bias.fill_(1.0)  # every row of h equal: three singular values of 0
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(16, 8)).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW111" and d.title == "Backward of svd at repeated singular values"
    assert "LinalgSvdBackward0 divides by the differences of the singular values" in text(d)
    first = d.fix.splitlines()[0]
    assert first.startswith("U, _, _ = torch.linalg.svd(C + 1e-4 * torch.randn_like(C))")
    w = torch.zeros(4, 8, requires_grad=True)
    h = F.linear(torch.randn(16, 8), w, torch.ones(4))
    ns: dict[str, Any] = {"torch": torch, "C": h.T @ h / 16}
    exec(first, ns)
    (h @ ns["U"]).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
    assert "torch.linalg.svdvals(C)" in d.fix


# ---------------------------------------------------------------- xlogy's gradient


def test_the_gradient_of_xlogy_at_zero_is_named_and_its_fix_is_finite() -> None:
    """Its evidence said 'xlogy of a number below 0 is NaN: its input's minimum is 0'."""
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    with torch.no_grad():
        model.bias.copy_(torch.tensor([0.0, 0.0, -200.0, 0.0, 0.0]))  # p[:, 2] is 0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        p = torch.softmax(model(torch.randn(8, 4)), -1)
        ent = -torch.special.xlogy(p, p).sum(-1).mean()
        ent.backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW110" and d.title == "Gradient of xlogy at 0"
    assert "below 0" not in text(d) and "1/x" not in text(d)
    assert "x / y: 0/0 = NaN where x and y are both 0" in d.evidence[0]
    logits = model(torch.randn(8, 4))
    ns: dict[str, Any] = {"torch": torch, "F": F, "logits": logits, "p": logits.softmax(-1)}
    fixes = [ln for ln in code_lines(d.fix).splitlines() if ln.startswith("ent =")]
    assert len(fixes) == 3
    exec(d.fix.splitlines()[0], ns)  # logp = F.log_softmax(logits, dim=-1)
    for ln in fixes:
        exec(ln, ns)
        model.zero_grad()
        ns["ent"].sum().backward(retain_graph=True)
        assert model.bias.grad is not None and torch.isfinite(model.bias.grad).all(), ln


# ---------------------------------------------------------------- sqrt of predictions


def test_sqrt_of_negative_predictions_is_not_called_rounding() -> None:
    """A YOLO-style loss on raw predicted widths; it said 'rounding made v slightly
    negative' and suggested clamp_min(0)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        pred, tgt = model(torch.randn(8, 4)), torch.rand(8, 4)
        loss = F.mse_loss(pred[:, 2:].sqrt(), tgt[:, 2:].sqrt())
        loss.backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW112"
    assert "far below 0: not rounding" in d.evidence[0]
    assert "rounding made" not in d.fix
    first = d.fix.splitlines()[0]
    assert first.startswith("loss = F.mse_loss(F.softplus(pred[:, 2:]).sqrt(), tgt[:, 2:].sqrt())")
    ns: dict[str, Any] = {"F": F, "pred": model(torch.randn(8, 4)), "tgt": tgt}
    exec(first.split("  #")[0], ns)
    assert torch.isfinite(ns["loss"])


def test_sqrt_of_a_rounding_error_keeps_the_clamp() -> None:
    ev = OpEvent(
        "aten.sqrt.default",
        Phase.FORWARD,
        "block",
        "NaN",
        counted(NAN, NAN, nan=1, numel=6),
        [("self", counted(-3e-8, 2.0, numel=6))],
        source="model.py:9",
        code="s = torch.sqrt(var)",
        dtype="float32",
    )
    t = unknown_op("y = 1")
    assert t.anomaly is not None
    t.anomaly.op = ev
    d = diagnose(t)[0]
    assert d.code == "NW112" and "rounding made the argument slightly negative" in d.fix
    assert d.fix.startswith("s = torch.sqrt(var.clamp_min(0) + 1e-5)")  # the user's own line


# ---------------------------------------------------------------- NW301: NaN learning rate


def test_the_nan_learning_rate_fix_runs_when_pasted() -> None:
    """It used math.isfinite without importing math."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.param_groups[0]["lr"] = float("nan")  # a hand-written schedule's 0 / 0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        loss = F.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 2, (4,)))
        loss.backward()
        opt.step()
        nw.step()
        model(torch.randn(4, 4)).sum().backward()
        nw.step()
    d = next(t.diagnoses[0] for t in nw.history if t.diagnoses)
    assert d.code == "NW301" and d.title == "Non-finite learning rate"
    good = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(good, 10)
    good.step()
    exec(d.fix, {"opt": good, "scheduler": sched})  # the fix says opt: the name used above


class _CountFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.log1p(x)
        return self.fc(x)


def test_log1p_of_a_count_sentinel_is_fixed_as_counts_not_as_probabilities() -> None:
    """-2 stored for 'missing' in a count column: log1p is NaN there. The fix was the
    log_softmax/logsigmoid list for probabilities."""
    model = _CountFeatures()
    x = torch.rand(16, 4) * 10
    x[3, 1] = -2.0
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(x).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW110" and "log_softmax" not in d.fix
    line = d.fix.splitlines()[0].split("  #")[0].strip()
    assert line == "x = torch.log1p(x.clamp_min(0))"
    ns: dict[str, Any] = {"torch": torch, "x": x.clone()}
    exec(line, ns)
    assert torch.isfinite(ns["x"]).all()
