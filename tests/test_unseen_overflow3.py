"""NW101/NW103 on failures found by user testing (third round): a float16 product whose
fix must keep the result in float32 (casting it back recreated the inf), an int64 count
cast to float16 (its value and dtype named, kept in float32, never clamped), and NW103 on
healthy float16 logits that the loss takes as a float32 copy (``logits.float()``).

Each runs a tiny real model under ``nanwatch.watch`` on CPU, and the fixes that claim to
be code are executed."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase, TensorStat
from nanwatch.rules.testing import TraceBuilder, diagnose, stat
from tests._diagnoses import code_lines, top

# ---------------------------------------------------------------- a product past the max


class HandLayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))
        self.b = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mu * mu
        return (x - mu) / torch.sqrt(var + 1e-5) * self.g + self.b


def ln_model() -> nn.Module:
    torch.manual_seed(0)
    fc = nn.Linear(8, 16)
    with torch.no_grad():
        fc.bias.fill_(300.0)  # activations of about 300: x * x is about 90,000
    return nn.Sequential(fc, HandLayerNorm(16), nn.Linear(16, 2)).half()


def ln_train(model: nn.Module) -> nanwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            F.cross_entropy(model(torch.randn(4, 8).half()).float(), torch.arange(4) % 2).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def test_an_overflowing_float16_product_is_kept_in_float32_not_cast_back() -> None:
    """The fix said 'call mul on .float() inputs and cast the result back with
    .to(torch.float16)': x*x of 300 is 90,000 > 65504, inf again."""
    d = top(ln_train(ln_model()))
    assert (d.code, d.op, d.path) == ("NW101", "aten.mul.Tensor", "1")
    assert "cast the result back" not in d.fix
    assert "its exact result reaches up to 9." in d.evidence[0]
    assert "e+04, past 65504" in d.fix and "cast back, it is inf again" in d.fix
    assert "var = (x.float() * x.float()).mean(-1, keepdim=True) - mu.float() * mu.float()" in d.fix
    # the pasted fix: module 1 in float32 from its input to its (normalized) output
    model = ln_model()
    exec(code_lines(d.fix), {"torch": torch, "model": model})
    nw = ln_train(model)
    assert all(t.anomaly is None for t in nw.history)
    for m in model.modules():
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()


def _product_in_a_module(out: TensorStat) -> str:
    """The fix for x * x past 65504 in float16 module ``1``, whose output reads ``out``."""
    b = TraceBuilder(0)
    net = b.call("model", "Sequential", root=True)
    b.input(net, stat(-1.0, 1.0), dtype="float16")
    blk = b.call("1", "HandLayerNorm", parent=net)
    b.input(blk, stat(299.0, 301.0), dtype="float16")
    b.forward(blk, out, dtype="float16")
    x = stat(299.0, 301.0, numel=64)
    ev = OpEvent(
        op="aten.mul.Tensor",
        phase=Phase.FORWARD,
        path="1",
        born="+inf",
        output=stat(299.0**2, math.inf, numel=64),
        inputs=[("self", x), ("other", x)],
        source="model.py:34",
        code="h = x * x",
        dtype="float16",
        device="cpu",
    )
    b.op(ev)
    trace = b.build()
    assert trace.anomaly is not None
    trace.anomaly.op = ev
    return diagnose(trace)[0].fix


@pytest.mark.parametrize("counted", [True, False])
def test_an_output_read_uncounted_is_judged_by_its_nan_not_its_missing_counts(
    counted: bool,
) -> None:
    """Read late (the accelerator path), a bad output holds min and max, no counts: its
    NaN count None was taken for 'no NaN', so a product's inf was called the module's
    own output, and the hook casting the outputs back was left out of the fix."""
    nan = _product_in_a_module(stat(math.nan, math.nan, numel=64, counted=counted))
    assert "its outputs back to float16" in nan and "no hook casting" not in nan
    inf = _product_in_a_module(stat(1.0, math.inf, numel=64, counted=counted))
    assert inf.splitlines()[2].startswith("# no hook casting its outputs back: mul's result")


def test_an_overflow_without_the_line_still_says_keep_it_in_float32() -> None:
    from nanwatch.rules.overflow import _fix
    from nanwatch.stats import dtype_limits

    fix = _fix("other", "mul", "float16", dtype_limits("float16"), None, device="'cpu'", result=9e4)
    assert fix.startswith("# in model's forward, call mul on .float() inputs and keep")
    assert "reaches up to 90000, past 65504" in fix and "cast the result back" not in fix
    # a norm's result is bounded: there computing in float32 and casting back is right
    norm = _fix(
        "other", "native_layer_norm", "float16", dtype_limits("float16"), None, device="'cpu'"
    )
    assert "cast the result back" in norm


# ---------------------------------------------------------------- an int64 count


class CountWeightedCE(nn.Module):
    def forward(self, logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(t, minlength=logits.shape[-1])
        total = counts.sum().to(logits.dtype)
        w = total / counts.clamp_min(1).to(logits.dtype)
        nll = F.cross_entropy(logits.float(), t, reduction="none")
        return (nll * w[t].float()).mean()


def test_an_int64_count_cast_to_float16_is_named_and_kept_in_float32() -> None:
    """It said 'cast a value of |x| = NaN', blamed 'a tensor computed in float32' and
    clamped the count to 65504 instead of 70000."""
    torch.manual_seed(0)
    model, crit = nn.Linear(4, 3).half(), CountWeightedCE()
    n = 70_000
    with nanwatch.watch(model, crit, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        t = torch.randint(0, 3, (n,))
        crit(model(torch.randn(n, 4).half()), t).backward()
        nw.step()
    d = top(nw)
    assert (d.code, d.op) == ("NW101", "aten._to_copy")
    assert d.evidence[0].startswith("aten._to_copy cast the int64 value 70000 to float16")
    assert "NaN" not in d.evidence[0]
    assert "computed in float32" not in d.explanation and "int64" in d.explanation
    assert "clamp" not in d.fix
    first = d.fix.splitlines()[0]
    assert first.startswith("total = counts.sum().float()  # was: total = counts.sum().to(")
    assert "give the other tensor .float() too" in d.fix
    counts = torch.bincount(t, minlength=3)
    ns: dict[str, Any] = {"counts": counts}
    exec(first.split("  #", 1)[0], ns)
    assert ns["total"].dtype == torch.float32 and ns["total"].item() == n
    w = ns["total"] / counts.clamp_min(1).float()  # dividing in float32, as the fix says
    assert bool(torch.isfinite(w).all())


# ---------------------------------------------------------------- NW103 and .float()


class CLIP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.txt = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.img(x), dim=-1)
        b = F.normalize(self.txt(t), dim=-1)
        with torch.no_grad():
            self.logit_scale.clamp_(0, math.log(100))
        return self.logit_scale.exp() * a @ b.t()


def clip_codes(loss: str) -> set[str]:
    """Float16-autocast CLIP whose logits grow toward float16's exp bound (about 4.5 of
    11.09 after 18 steps, rising)."""
    torch.manual_seed(0)
    m = CLIP()
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        for _ in range(19):
            x = torch.randn(32, 16)
            t, y = x + 0.05 * torch.randn(32, 16), torch.arange(32)
            with torch.autocast("cpu", dtype=torch.float16):
                if loss == "copy":
                    logits = m(x, t)
                    out = F.cross_entropy(logits.float(), y)
                elif loss == "temporary":
                    out = F.cross_entropy(m(x, t).float(), y)
                else:  # a hand-written softmax in float16: no loss function at all
                    logits = m(x, t)
                    out = -logits.softmax(-1)[torch.arange(32), y].log().mean()
            out.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return {d.code for d in nw.report.diagnoses}


def test_a_loss_on_a_float32_copy_of_float16_logits_is_no_nw103() -> None:
    """F.cross_entropy(logits.float(), y), NW103's own fix, was warned about: the copy is
    a new tensor, so the loss was not linked to the logits' record."""
    assert "NW103" not in clip_codes("copy")
    assert "NW103" not in clip_codes("temporary")  # model(x).float(): the output is gone
    assert "NW103" in clip_codes("by hand")  # the exp runs in float16: the warning stands


def logits_step(i: int, top_value: float, **note: Any) -> Any:
    """A float16 model whose logits go to a functional loss; the guard's note as given."""
    b = TraceBuilder(i)
    net = b.call("Net", root=True)
    x = b.input(net, stat(-2.0, 2.0, numel=64), shape=(8, 8), dtype="float16")
    fc = b.call("fc", "Linear", parent=net)
    b.input(fc, source=x, dtype="float16", shape=(8, 8))
    o = b.forward(fc, stat(-1.0, top_value, numel=32), dtype="float16", shape=(8, 4))
    b.forward(net, source=o, dtype="float16", shape=(8, 4))
    fn = b.call("(loss)", "functional", root=True, is_loss=True)
    b.forward(fn, stat(1.0, 1.0, numel=1), shape=())
    b.note("loss_input", "(loss)", input_source=o.index, **note)
    return b.build(loss=1.0)


def test_nw103_knows_the_exp_of_an_upcast_copy_runs_in_float32() -> None:
    def codes(**note: Any) -> list[str]:
        past = [logits_step(i, 2.0 + i, **note) for i in range(8)]
        return [d.code for d in diagnose(logits_step(8, 10.0, **note), past)]

    up = {"input_dtype": "float32", "input_upcast_from": "float16"}
    assert "NW103" not in codes(loss="F.mse_loss", **up)
    assert "NW103" in codes(loss="F.mse_loss", input_dtype="float16")
