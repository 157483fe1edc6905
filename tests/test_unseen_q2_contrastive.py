"""Metric learning with masks built from the batch's labels (stop 40, q2): a
multi-positive loss takes ``torch.logsumexp`` over the positives a mask leaves, and an
anchor whose class appears once has none: the logsumexp of that row is -inf and the loss,
which subtracts it, is +inf (NW402, the mask's line and the rows to keep, in every mode);
batch-hard mining selects ``D[i][y != y[i]]`` and takes its ``min()``, which raises in a
batch of one class (the post-mortem names the empty selection and the guard)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import nanwatch
from nanwatch.postmortem import ADVICE, empty_reduction_advice
from nanwatch.render import report_summary
from nanwatch.report import Report
from tests._diagnoses import text

torch.set_num_threads(1)

MODES = ["sentinel", "watch", "forensic"]
_PAIRED = [0, 0, 1, 1, 2, 2, 3, 3]
_SINGLE = [0, 0, 1, 1, 2, 2, 3, 4]  # classes 3 and 4 appear once: no positive for them


class Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


class MultiPositiveLoss(nn.Module):
    def __init__(self, t: float = 0.1, keep_empty: bool = True) -> None:
        super().__init__()
        self.t = t
        self.keep_empty = keep_empty

    def forward(self, e: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sim = e @ e.t() / self.t
        same = y[:, None] == y[None]
        pos = same & ~torch.eye(len(y), dtype=torch.bool)
        neg_sim = sim.masked_fill(same, float("-inf"))
        pos_sim = sim.masked_fill(~pos, float("-inf"))
        if self.keep_empty:
            return F.softplus(torch.logsumexp(neg_sim, 1) - torch.logsumexp(pos_sim, 1)).mean()
        keep = pos.any(1)
        return F.softplus((torch.logsumexp(neg_sim, 1) - torch.logsumexp(pos_sim, 1))[keep]).mean()


def _train_module_loss(mode: str, *, fixed: bool = False) -> Any:
    torch.manual_seed(0)
    m, crit = Emb(), MultiPositiveLoss(keep_empty=not fixed)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with nanwatch.watch(m, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x = torch.randn(8, 12)
            y = torch.tensor(_PAIRED if step < 2 else _SINGLE)
            loss = crit(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def _train_loss_code(mode: str, *, fixed: bool = False) -> Any:
    torch.manual_seed(0)
    m = Emb()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x = torch.randn(8, 12)
            y = torch.tensor(_PAIRED if step < 2 else _SINGLE)
            e = m(x)
            sim = e @ e.t() / 0.1
            same = y[:, None] == y[None]
            pos = same & ~torch.eye(8, dtype=torch.bool)
            neg_sim = sim.masked_fill(same, float("-inf"))
            pos_sim = sim.masked_fill(~pos, float("-inf"))
            per_row = F.softplus(torch.logsumexp(neg_sim, 1) - torch.logsumexp(pos_sim, 1))
            loss = per_row[pos.any(1)].mean() if fixed else per_row.mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def _top(nw: Any) -> Any:
    bad = [t for t in nw.history if t.anomaly is not None]
    assert bad and bad[0].step == 2, [t.step for t in bad]
    assert bad[0].diagnoses
    return bad[0].diagnoses[0]


@pytest.mark.parametrize("mode", MODES)
def test_nw402_logsumexp_of_a_row_with_no_positive_in_a_loss_module(mode: str) -> None:
    d = _top(_train_module_loss(mode))
    assert d.code == "NW402", text(d)
    assert d.title == "logsumexp over a row the mask left empty: -inf, then +inf"
    ev = "\n".join(d.evidence)
    assert "torch.logsumexp(pos_sim, 1) is -inf where a row of pos_sim is -inf everywhere" in ev
    assert "2 of its 8 values are -inf" in ev
    assert 'pos_sim = sim.masked_fill(~pos, float("-inf"))' in ev
    assert "aten.sub.Tensor made +inf of it" in ev
    assert "an anchor with no positive in the batch" in d.explanation
    lines = d.fix.splitlines()
    assert lines[0].startswith("keep = pos.any(1)   # the rows of pos_sim where ~pos leaves")
    assert lines[1].startswith(
        "return F.softplus((torch.logsumexp(neg_sim, 1) - torch.logsumexp(pos_sim, 1))[keep])"
        ".mean()"
    )
    assert "no specific rule" not in text(d)


def test_nw402_forensic_loss_code_rewrites_the_loss_line() -> None:
    d = _top(_train_loss_code("forensic"))
    assert d.code == "NW402", text(d)
    lines = d.fix.splitlines()
    assert lines[0].startswith("keep = pos.any(1)")
    assert lines[1].startswith(
        "per_row = F.softplus((torch.logsumexp(neg_sim, 1) - torch.logsumexp(pos_sim, 1))[keep])"
    )


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_nw402_loss_code_untraced_reads_the_logsumexp_from_the_graph(mode: str) -> None:
    d = _top(_train_loss_code(mode))
    assert d.code == "NW402", text(d)
    assert d.title == "logsumexp over a row the mask left empty: -inf, then +inf"
    ev = "\n".join(d.evidence)
    assert "torch.logsumexp(x, 1) of a masked_fill: 2 of its 8 values are -inf" in ev
    assert "the loss is +inf: that -inf, subtracted, is +inf" in ev
    assert d.fix.startswith("keep = keep_mask.any(1)")
    assert "loss = per_row[keep].mean()" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_control_rows_with_no_positive_left_out_train_clean(mode: str) -> None:
    for run in (_train_module_loss, _train_loss_code):
        nw = run(mode, fixed=True)
        assert all(t.anomaly is None for t in nw.history), run.__name__
        assert not nw.report.diagnoses, run.__name__


# ----------------------------------------------- batch-hard mining over an empty selection


def _batch_hard(report_dir: Path, mode: str, *, fixed: bool = False) -> None:
    torch.manual_seed(0)
    m = Emb()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with nanwatch.watch(m, mode=mode, report_dir=str(report_dir)) as nw:
        for step in range(3):
            x = torch.randn(8, 12)
            y = torch.randint(0, 3, (8,)) if step < 2 else torch.zeros(8, dtype=torch.long)
            D = torch.cdist(m(x), m(x))
            losses = []
            for i in range(8):
                if fixed:
                    hardest_neg = D[i].masked_fill(y == y[i], float("inf")).min()
                else:
                    hardest_neg = D[i][y != y[i]].min()
                hardest_pos = D[i].masked_fill(y != y[i], float("-inf")).max()
                losses.append(F.relu(hardest_pos - hardest_neg + 0.2))
            loss = torch.stack(losses).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()


@pytest.mark.parametrize("mode", MODES)
def test_postmortem_names_the_empty_selection_of_a_min(report_dir: Path, mode: str) -> None:
    with pytest.raises(RuntimeError, match=r"min\(\): Expected reduction dim"):
        _batch_hard(report_dir, mode)
    (path,) = report_dir.glob("*.json")
    report = Report.load(path)
    assert report.error is not None and report.error["class"] == "empty-reduction"
    advice = str(report.error["advice"])
    assert advice.startswith(
        "D[i][y != y[i]] is empty (the mask y != y[i] selects no element in this batch), and "
        "min() of no value has none: skip it when nothing is selected, "
        "if (y != y[i]).any(): ..."
    )
    assert "D[i].masked_fill(y == y[i], float('inf')).min() is +inf" in advice
    console = Console(width=300, record=True, file=io.StringIO())
    console.print(report_summary(report, ["run.json"]))
    out = console.export_text()
    assert "RuntimeError (min or max of an empty tensor)" in out
    assert "→ D[i][y != y[i]] is empty" in out and "masked_fill(y == y[i]" in out
    assert "The last modules that ran" not in out


@pytest.mark.parametrize("mode", MODES)
def test_control_batch_hard_masked_instead_of_selected_trains_clean(
    report_dir: Path, mode: str
) -> None:
    _batch_hard(report_dir, mode, fixed=True)
    assert not list(report_dir.glob("*.json"))


def test_empty_reduction_advice_without_a_selection_is_the_general_one() -> None:
    msg = "max(): Expected reduction dim 1 to have non-zero size."
    assert empty_reduction_advice(msg, "m = scores[:, :0].max(1)") == ADVICE["empty-reduction"]
    assert empty_reduction_advice(msg, None) == ADVICE["empty-reduction"]
    # a reduction over a dim: the guard, no masked form (its dim is the user's)
    assert empty_reduction_advice(msg, "v = d[:, keep].max(1).values") == ADVICE["empty-reduction"]
    said = empty_reduction_advice(msg, "v = d[keep].max(1).values")
    assert said.startswith("d[keep] is empty (the mask keep selects no element")
    assert "masked_fill" not in said


# ------------------------------------------ a MoCo queue of zeros, normalized by hand


class MoCo(nn.Module):
    def __init__(self, fixed: bool = False, k: int = 32) -> None:
        super().__init__()
        self.q, self.k = Emb(), Emb()
        self.fixed = fixed
        self.register_buffer("queue", torch.zeros(16, k))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        q = self.q(x1)
        with torch.no_grad():
            k = self.k(x2)
        l_pos = (q * k).sum(1, keepdim=True)
        if self.fixed:
            queue = F.normalize(self.queue, dim=0)
        else:
            queue = self.queue / self.queue.norm(dim=0, keepdim=True)
        logits = torch.cat([l_pos, q @ queue], 1) / 0.07
        p, n = int(self.ptr), x1.size(0)
        self.queue[:, p : p + n] = k.t()  # enqueue this batch's keys
        self.ptr.fill_((p + n) % self.queue.size(1))
        return logits


def _moco(mode: str, *, fixed: bool = False) -> Any:
    torch.manual_seed(0)
    m = MoCo(fixed)
    opt = torch.optim.SGD(m.q.parameters(), lr=0.05)
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            x = torch.randn(8, 12)
            logits = m(x, x + 0.1 * torch.randn_like(x))
            loss = F.cross_entropy(logits, torch.zeros(8, dtype=torch.long))
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_nw111_zero_queue_normalized_by_hand_is_a_normalization_in_every_mode(mode: str) -> None:
    """Forensic mode sees the queue all zeros (watch's replay runs after the enqueue): it
    said 'a variance, scale or count starts at torch.ones' and offered a clamp on a
    re-computed norm; it now tells the normalization story watch mode tells, with F.normalize."""
    bad = [t for t in _moco(mode).history if t.anomaly is not None]
    assert bad and bad[0].step == 0
    d = bad[0].diagnoses[0]
    assert d.code == "NW111", text(d)
    assert d.title == "Division by zero (0/0) normalizing a zero vector"
    assert d.fix.startswith("queue = F.normalize(self.queue, dim=0)")
    assert "starts at torch.ones" not in d.fix
    assert "torch.finfo(self.queue.norm" not in d.fix
    if mode == "forensic":  # all 32 columns were 0 when the division ran
        assert "# self.queue: 0 everywhere means it was created with torch.zeros" in d.fix


@pytest.mark.parametrize("mode", MODES)
def test_control_moco_queue_through_f_normalize_trains_clean(mode: str) -> None:
    nw = _moco(mode, fixed=True)
    assert all(t.anomaly is None for t in nw.history)
    assert not nw.report.diagnoses
