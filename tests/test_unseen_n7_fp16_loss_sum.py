"""A cross-entropy of float16 logits over a large batch: every per-element loss is small
(about log of the class count), yet the loss is inf -- the kernel holds the sum of the
per-element losses (and, for reduction='mean', their count) in float16, and 16,384 losses
of 5 pass 65504. Past 65504 targets the count is inf too, and inf / inf is NaN. Every mode
says so (NW101): the loss, its input's range, the count, the mean that overflows, the
line, and the fix: float32 input to the loss. The same model with .float() logits trains
clean."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

CLASSES = 256


class Head(nn.Module):
    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.out = nn.Linear(16, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(tokens)))


def _mean_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))
    return loss


def _summed_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    total = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1), reduction="sum")
    return total / target.numel()


def _float_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), target.view(-1))
    return loss


def _run(
    loss_fn: object,
    mode: str,
    *,
    tokens: int = 16384,
    classes: int = CLASSES,
    module_loss: bool = False,
) -> tuple[list[nanwatch.Diagnosis], list[float]]:
    torch.manual_seed(0)
    model = Head(classes).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = torch.randint(0, 64, (tokens // 64, 64), generator=gen)
            y = torch.randint(0, classes, (tokens // 64, 64), generator=gen)
            logits = model(x)
            if module_loss:
                loss = criterion(logits.view(-1, classes), y.view(-1))
            else:
                loss = loss_fn(logits, y)  # type: ignore[operator]
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return [d for t in nw.history for d in t.diagnoses], losses


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_float16_mean_cross_entropy_is_inf_from_its_sum(mode: str) -> None:
    ds, losses = _run(_mean_loss, mode)
    assert math.isinf(losses[0])
    found = [d for d in ds if d.code == "NW101" and d.step == 0]
    assert found, [d.headline for d in ds]
    d = found[0]
    text = " ".join(d.evidence)
    assert "F.cross_entropy got float16 input" in text
    assert "16,384 targets" in text
    assert "the sum of their losses and their count are held in float16" in text
    assert "torch.finfo(torch.float16).max" in text
    assert "any mean above 3.998 sums past 65504" in text  # 65504 / 16384
    assert "loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))" in text
    assert d.source is not None and d.source.endswith(
        f"test_unseen_n7_fp16_loss_sum.py:{_mean_loss.__code__.co_firstlineno + 1}"
    )
    assert d.fix.startswith(
        "loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), target.view(-1))"
    )
    assert "GradScaler does not help" in d.explanation
    if mode == "forensic":
        assert d.op == "aten.nll_loss_forward"
        assert "and at least" in text  # the log-probs the kernel got bound each loss below


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_float16_summed_cross_entropy_is_inf(mode: str) -> None:
    ds, losses = _run(_summed_loss, mode)
    assert math.isinf(losses[0])
    found = [d for d in ds if d.code == "NW101" and d.step == 0]
    assert found, [d.headline for d in ds]
    d = found[0]
    text = " ".join(d.evidence)
    assert "the sum of their losses is held in float16" in text
    assert "reduction='sum': the loss is that sum" in text
    assert "and their count" not in text
    assert d.fix.startswith(
        "total = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), target.view(-1), "
        'reduction="sum")'
    )


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_past_65504_targets_the_count_overflows_too_and_the_loss_is_nan(mode: str) -> None:
    ds, losses = _run(_mean_loss, mode, tokens=70016, classes=8)
    assert math.isnan(losses[0])
    found = [d for d in ds if d.code == "NW101" and d.step == 0]
    assert found, [d.headline for d in ds]
    text = " ".join(found[0].evidence)
    assert "70,016 targets" in text
    assert "the count, 70,016, is past 65504 too: inf / inf = NaN" in text
    assert not [d for d in ds if d.code == "NW100" and d.step == 0]


def test_an_nn_cross_entropy_module_gets_the_same_diagnosis() -> None:
    ds, _ = _run(None, "watch", module_loss=True)
    found = [d for d in ds if d.code == "NW101" and d.step == 0]
    assert found, [d.headline for d in ds]
    d = found[0]
    assert "CrossEntropyLoss got float16 input" in " ".join(d.evidence)
    assert d.fix.startswith("loss = criterion(logits.view(-1, classes).float(), y.view(-1))"), d.fix


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_the_fixed_loss_of_float32_logits_trains_clean(mode: str) -> None:
    ds, losses = _run(_float_loss, mode)
    assert all(math.isfinite(v) for v in losses)
    assert not [d for d in ds if d.severity == "error"], [d.headline for d in ds]
    assert not [d for d in ds if d.code == "NW101"]


def test_a_small_float16_batch_is_not_diagnosed() -> None:
    ds, losses = _run(_mean_loss, "watch", tokens=1024)
    assert all(math.isfinite(v) for v in losses)
    assert not [d for d in ds if d.code == "NW101"], [d.headline for d in ds]
