"""Unseen models, autograd: an in-place write to a module's buffer that autograd saved
(a MoCo queue, an NPID memory bank) named as that buffer (NW403), and a gradient born in
the backward of a non-loss module (ArcFace's sqrt at cos = 1) whose fix is nanwatch's own
replay, not detect_anomaly (which names a later node)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.localize import parse_inplace_error


# ---------------------------------------------------------------- NW403: buffers
class Queue(nn.Module):
    """MoCo-style: logits against a queue of negatives held in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 4)
        self.register_buffer("queue", F.normalize(torch.randn(4, 10), dim=0))

    @torch.no_grad()
    def enqueue(self, k: torch.Tensor) -> None:
        self.queue[:, : k.shape[0]] = k.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.enc(x), dim=1)
        return q @ self.queue


class Bank(nn.Module):
    """NPID-style: a memory bank buffer, read through a view (bank.t()), written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 4)
        self.register_buffer("bank", F.normalize(torch.randn(12, 4), dim=1))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        f = F.normalize(self.enc(x), dim=1)
        logits = f @ self.bank.t()
        with torch.no_grad():
            self.bank.index_copy_(0, idx, f.detach())
        return logits


def _queue_steps(nw: nanwatch.Watcher, m: Queue, *, early: bool) -> None:
    with nw:
        for _ in range(2):
            x = torch.randn(3, 6)
            logits = m(x)
            loss = F.cross_entropy(logits, torch.zeros(3, dtype=torch.long))
            if early:
                m.enqueue(torch.randn(3, 4))  # too early: backward needs the old queue
            loss.backward()
            if not early:
                m.enqueue(torch.randn(3, 4))
            nw.step()


def test_a_queue_buffer_written_before_backward_is_named() -> None:
    torch.manual_seed(0)
    m = Queue()
    nw = nanwatch.watch(m, postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _queue_steps(nw, m, early=True)
    d = next(d for d in nw.report.diagnoses if d.code == "NW403")
    assert d.path == "Queue"
    text = " | ".join(d.evidence)
    assert "Queue.queue (a buffer of Queue, [4, 10]) is at version 1" in text
    assert "written in place after autograd saved it" in text
    assert "functional code made it" not in text
    assert "loss.backward()" in d.fix and "Queue.queue" in d.fix
    assert "self.queue.clone()" in d.fix
    assert "gate" not in d.fix and "gate" not in d.explanation
    assert "Queue.queue, saved by autograd, was modified in place" in nw.report.headline


def test_the_healthy_queue_update_after_backward_stays_silent() -> None:
    torch.manual_seed(0)
    m = Queue()
    nw = nanwatch.watch(m, postmortem=False)
    _queue_steps(nw, m, early=False)
    assert nw.report.diagnoses == [] and nw.first_anomaly is None


def test_a_memory_bank_read_through_a_view_is_named() -> None:
    torch.manual_seed(0)
    m = Bank()
    nw = nanwatch.watch(m, postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), nw:
        idx = torch.randperm(12)[:3]
        loss = F.cross_entropy(m(torch.randn(3, 6), idx), idx)
        loss.backward()
    d = next(d for d in nw.report.diagnoses if d.code == "NW403")
    text = " | ".join(d.evidence)
    assert "Bank.bank (a buffer of Bank, [12, 4])" in text
    assert "autograd saved a [4, 12] view of it" in text
    assert "self.bank.clone()" in d.fix


def test_a_parameter_updated_before_a_second_backward_is_named() -> None:
    torch.manual_seed(0)
    m = nn.Linear(6, 4, bias=False)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 6, requires_grad=True)
    nw = nanwatch.watch(m, postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), nw:
        out = torch.tanh(m(x))
        out.sum().backward(retain_graph=True)
        opt.step()  # updates m.weight in place: the second backward needs the old one
        out.pow(2).sum().backward()
    d = next(d for d in nw.report.diagnoses if d.code == "NW403")
    text = " | ".join(d.evidence)
    assert "Linear.weight (a parameter of Linear, [4, 6])" in text
    assert "optimizer.step()" in d.fix


def test_the_generic_in_place_fix_uses_no_invented_names() -> None:
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.Sigmoid()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.act(x)
            y.mul_(2)  # sigmoid saved its output
            return y

    m = Gated()
    nw = nanwatch.watch(m, postmortem=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"), nw:
        m(torch.randn(2, 3, requires_grad=True)).sum().backward()
    d = next(d for d in nw.report.diagnoses if d.code == "NW403")
    assert d.path == "act"
    # the user's own line, made out of place: no name nanwatch made up
    assert "gate" not in d.fix and d.fix.startswith("y = y.mul(2)   # ")
    assert "act (Sigmoid) made it with sigmoid" in " | ".join(d.evidence)


def test_an_error_for_a_tensor_no_node_made_is_parsed() -> None:
    msg = (
        "one of the variables needed for gradient computation has been modified by an "
        "inplace operation: [torch.FloatTensor [8, 64]] is at version 3; expected version 2 "
        "instead."
    )
    facts = parse_inplace_error(msg)
    assert facts is not None
    assert (facts["shape"], facts["grad_fn"], facts["version"]) == ((8, 64), None, 3)


# ---------------------------------------------------------------- NW100: backward birth
class ArcHead(nn.Module):
    """ArcFace margin: sine = sqrt(1 - cos^2) has an infinite derivative at cos = 1."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d))
        self.cos_m, self.sin_m = math.cos(0.5), math.sin(0.5)

    def forward(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - cosine.pow(2)).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        one_hot = F.one_hot(label, cosine.size(1)).float()
        return 30.0 * (one_hot * phi + (1.0 - one_hot) * cosine)


def test_a_backward_nan_in_a_head_recommends_nanwatchs_replay_and_it_names_the_sqrt() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))
    head, criterion = ArcHead(8, 4), nn.CrossEntropyLoss()
    ex = torch.randn(4, 10)
    with torch.no_grad():
        head.weight.copy_(backbone(ex))  # imprinted centres: cos = 1 exactly
    x = torch.cat([ex, torch.randn(4, 10)])
    y = torch.cat([torch.arange(4), torch.randint(0, 4, (4,))])
    nw = nanwatch.watch(backbone, head, criterion, postmortem=False)
    with pytest.raises(nanwatch.AnomalyError) as err, nw:
        criterion(head(backbone(x), y), y).backward()
    # watch mode replays the head's own backward (it was NW100 with nw.replay's template,
    # which then named the sqrt): the sqrt's backward and its line are named at once
    d = err.value.diagnosis
    assert d is not None and d.code == "NW112" and d.path == "ArcHead"
    assert "detect_anomaly" not in d.fix
    lines = Path(__file__).read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if "sine = torch.sqrt(" in t)
    assert d.source is not None and d.source.endswith(f"test_unseen_autograd2.py:{line}")
