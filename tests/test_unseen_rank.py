"""Ranking and retrieval losses found by user testing: a view between the op that made a
-inf and the op that used it (the cause is kept), a query with no document hidden by
torch.where (a fully masked row, NW402, watch and forensic), the torch.where trap of a
Beta NLL (0 × -inf in backward), 0 × -inf in loss code read from the autograd graph in
watch mode, and spectral_norm of a weight of zeros (a fix that works when pasted).

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import ops
from tests._diagnoses import code_lines, text, top


def _train(step_fn, *modules: nn.Module, mode: str = "watch", steps: int = 2) -> nanwatch.Watcher:
    with nanwatch.watch(*modules, mode=mode, on_anomaly="record") as nw:
        for step in range(steps):
            step_fn(step)
            nw.step()
    return nw


# ------------------------------------------------- 1: a view keeps the cause of a -inf


def test_a_view_between_the_log_and_its_use_keeps_the_log_as_the_cause() -> None:
    q = torch.tensor([0.5, 0.0, 0.25])
    x = torch.randn(3, 3, requires_grad=True)
    with ops.OpChecker() as chk:
        _ = x - torch.log(q)[None, :]
    sub = next(e for e in chk.events if e.op.startswith("aten.sub"))
    assert sub.cause is not None and sub.cause.op.startswith("aten.log")


class _LogQ(nn.Module):
    def __init__(self, q: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q", q)

    def forward(self, logits: torch.Tensor, it: torch.Tensor) -> torch.Tensor:
        lq = torch.log(self.q[it])
        logits = logits - lq[None, :]
        return F.cross_entropy(logits, torch.arange(logits.shape[0]))


def test_logq_correction_through_a_view_is_a_log_of_zero() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 8)
    q = torch.full((8,), 0.2)
    q[5:] = 0.0  # items never counted
    crit = _LogQ(q)

    def step(_: int) -> None:
        it = torch.arange(8)
        crit(model(torch.randn(8, 4)), it).backward()

    d = top(_train(step, model, crit, steps=1))
    assert d.code == "NW110"
    assert d.op is not None and d.op.startswith("aten.log")
    assert "lq = torch.log(self.q[it])" in text(d)


# ------------------------------------------- 2: a query with no document, hidden by where


class _Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1).masked_fill(~mask, float("-inf"))


def _empty_query(mode: str, empty: bool = True) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = _Scorer()

    def step(i: int) -> None:
        x = torch.randn(4, 6, 8)
        lens = torch.tensor([3, 6, 4, 5])
        if empty and i == 1:
            lens[2] = 0
        mask = torch.arange(6)[None] < lens[:, None]
        s = m(x, mask)
        per_q = -F.log_softmax(s, -1).masked_fill(~mask, 0.0).sum(-1)
        has = mask.any(-1)
        loss = torch.where(has, per_q, torch.zeros_like(per_q)).sum() / has.sum()
        loss.backward()

    return _train(step, m, mode=mode)


def test_an_empty_query_hidden_by_where_is_a_fully_masked_row_in_watch_mode() -> None:
    d = top(_empty_query("watch"))
    assert d.code == "NW402"
    t = text(d)
    assert "from finite inputs" not in t
    assert "backward of the forward op at" not in t  # the backward() line is no forward op's
    assert "torch.finfo(scores.dtype).min" in d.fix


def test_an_empty_query_hidden_by_where_is_named_in_forensic_mode() -> None:
    nw = _empty_query("forensic")
    d = top(nw)
    assert d.code == "NW402"
    assert d.op is not None and "log_softmax" in d.op
    anomaly = next(t.anomaly for t in nw.history if t.anomaly is not None)
    assert "mode='forensic'" not in anomaly.summary
    fixed = code_lines(d.fix).splitlines()[0]
    assert "torch.finfo(torch.float32).min" in fixed and "masked_fill(~mask" in fixed


def test_no_empty_query_is_silent_in_both_modes() -> None:
    for mode in ("watch", "forensic"):
        nw = _empty_query(mode, empty=False)
        assert all(t.anomaly is None for t in nw.history)


# ---------------------------------------------- 3: the torch.where trap of a Beta NLL


def _beta(y_grad: bool) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = nn.Linear(6, 1)

    def step(i: int) -> None:
        a = F.softplus(m(torch.randn(16, 6)).squeeze(-1)) + 1e-3
        y = torch.rand(16) * 0.5
        if i == 1:
            y[:3] = 0.0
        y.requires_grad_(y_grad)
        t1 = torch.where(y > 0, (a - 1) * torch.log(y), torch.zeros_like(y))
        (-t1.mean()).backward()

    return _train(step, m)


def test_where_trap_with_a_log_of_data_is_zero_times_inf_in_backward() -> None:
    d = top(_beta(y_grad=False))
    t = text(d)
    assert d.title.startswith("0 × -inf in backward")
    assert "sqrt or acos" not in t
    assert "torch.where(cond, torch.log(safe), 0.0)" in d.fix
    cond = torch.tensor([True, False])
    x = torch.tensor([0.5, 0.0], requires_grad=True)
    scope = {"torch": torch, "cond": cond, "x": x}
    exec(code_lines(d.fix), scope)  # the pasted fix: finite value and gradient
    scope["out"].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_where_trap_with_a_log_on_the_graph_names_the_log() -> None:
    d = top(_beta(y_grad=True))
    assert d.code == "NW110"
    assert d.op is not None and d.op.startswith("aten.log")


# --------------------------------------------------- 4: 0 × -inf in loss code, watch mode


def test_zero_times_masked_log_softmax_in_loss_code_is_named_in_watch_mode() -> None:
    torch.manual_seed(0)
    m = nn.Linear(8, 1)

    def step(_: int) -> None:
        x = torch.randn(3, 5, 8)
        rel = torch.rand(3, 5)
        mask = torch.arange(5)[None] < torch.tensor([3, 5, 2])[:, None]
        s = m(x).squeeze(-1).masked_fill(~mask, float("-inf"))
        p_true = torch.softmax(rel.masked_fill(~mask, float("-inf")), -1)
        loss = -(p_true * F.log_softmax(s, -1)).sum(-1).mean()
        loss.backward()

    d = top(_train(step, m, steps=1))
    assert "0 × -inf" in d.title
    assert d.op == "aten.mul"
    assert "masked to -inf" in d.explanation
    assert "mode='forensic'" not in d.fix and 'mode="forensic"' not in d.fix


# ----------------------------------------------- 5: spectral_norm of a weight of zeros


class _Disc(nn.Module):
    def __init__(self, zero: bool) -> None:
        super().__init__()
        lin = nn.Linear(8, 8)
        if zero:
            nn.init.zeros_(lin.weight)
        self.l2 = nn.utils.parametrizations.spectral_norm(lin)
        self.out = nn.Linear(8, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(z + self.l2(z))


def test_spectral_norm_of_zeros_gets_a_fix_that_makes_the_weight_finite() -> None:
    torch.manual_seed(0)
    model = _Disc(True)

    def step(_: int) -> None:
        model(torch.randn(4, 8)).mean().backward()

    d = top(_train(step, model, steps=1))
    assert "spectral norm" in d.title
    assert "remove_parametrizations" in d.fix
    fresh = _Disc(True)
    assert not torch.isfinite(fresh.l2.weight).all()
    exec(d.fix, {"torch": torch, "model": fresh})  # pasted as it is
    assert torch.isfinite(fresh.l2.weight).all()
    assert torch.isfinite(fresh(torch.randn(2, 8))).all()


def test_a_backward_node_known_by_name_only_claims_nothing_of_its_inputs() -> None:
    from nanwatch.records import OpEvent, Phase, TensorStat
    from nanwatch.rules import generic

    ev = OpEvent(
        "aten.log_softmax",
        Phase.BACKWARD,
        "(loss)",
        "NaN",
        TensorStat(float("nan"), float("nan"), 4, nan=4),
        [],
        node="LogSoftmaxBackward0",
        source="train.py:25",
        backward_at="train.py:25",
    )
    assert generic._given(ev) == ""
    fix = generic._inspect_fix(ev)
    assert "forward op at train.py:25" not in fix and "nw.replay(step_fn)" in fix
