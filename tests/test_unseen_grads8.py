"""Gradient rules on unseen runs: a GradScaler hiding a NaN born in backward is said at
once, not after ten skips; a scaler that recovered at scale 1 is no collapse, and one whose
float16 gradients overflow even unscaled is said so; vanishing gradients after one huge
update name that weight and its lr; a gradient norm that rises in a warm-up and settles is
no explosion.

Each runs a tiny real model under ``nanwatch.watch`` on CPU."""

from __future__ import annotations

import copy
import linecache
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis


def all_diagnoses(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


# ---------------------------------------------------------------- NW305


def test_a_nan_born_under_a_scaler_is_said_at_once_with_the_birth() -> None:
    """sqrt of squared pairwise differences: the diagonal is exactly 0 and its gradient NaN
    every step. NW305 waited for 10 skips (a warning) and pointed at the forward line."""
    torch.manual_seed(0)
    emb = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(emb.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with nanwatch.watch(emb, on_anomaly="record", postmortem=False) as nw:
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = emb(torch.randn(8, 8))
            d = (z.float()[:, None] - z.float()[None]).pow(2).sum(-1).sqrt()
            loss = d.mean()
            scaler.scale(loss).backward()  # the NaN's birth: SqrtBackward0
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    d305 = all_diagnoses(nw, "NW305")[0]
    assert d305.step <= 1 and d305.severity == "error"
    assert any("holds NaN and no inf" in e for e in d305.evidence)
    assert any("SqrtBackward0" in e for e in d305.evidence)
    assert "F.pairwise_distance(x1, x2)" in d305.fix
    assert d305.source is not None
    file, _, line = d305.source.rpartition(":")
    assert "emb(" not in linecache.getline(file, int(line))  # the birth's line, not the forward


def sum_loss_run(target_scale: float, steps: int) -> tuple[Any, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-7)
    crit = nn.MSELoss(reduction="sum")
    scaler = torch.amp.GradScaler("cpu")
    x_all = torch.randn(1024, 16)
    y_all = x_all.sum(1, keepdim=True) * target_scale + 50
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            i = torch.randint(0, 1024, (512,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = crit(model(x_all[i]), y_all[i])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    return nw, scaler


def test_a_scaler_that_recovers_at_scale_one_is_no_collapse() -> None:
    """A summed loss: the scale falls from 65536 to 1, where the gradients fit and steps are
    applied. NW305 said '16 of the last 16 steps were skipped' and 'a NaN ... not an
    overflow' at the step the scaler recovered."""
    nw, scaler = sum_loss_run(10.0, 20)
    assert scaler.get_scale() <= 2.0  # it came down ...
    finite = [t for t in nw.history if t.grad_norm is not None and math.isfinite(t.grad_norm)]
    assert finite  # ... and applied steps there
    assert all_diagnoses(nw, "NW305") == []


def test_float16_gradients_that_overflow_unscaled_are_not_called_a_nan() -> None:
    nw, _ = sum_loss_run(3000.0, 18)
    d = all_diagnoses(nw, "NW305")[0]
    assert d.severity == "error"
    text = " ".join(d.evidence)
    assert "overflow to inf even at scale 1" in text and "float16" in text
    assert "not an overflow" not in d.explanation and "NaN in the forward" not in d.explanation
    assert "reduction='mean'" in d.fix and "torch.bfloat16" in d.fix


# ---------------------------------------------------------------- NW304


class Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Linear(32, 16)
        self.txt = nn.Embedding(100, 16)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        i = F.normalize(self.img(images), dim=-1)
        t = F.normalize(self.txt(tokens).mean(1), dim=-1)
        return self.logit_scale.exp() * i @ t.t()


def test_vanishing_after_one_huge_update_names_the_weight_and_its_lr() -> None:
    """lr 500 on logit_scale throws it to -2000: exp() is 0, every logit 0, every gradient
    0. NW304 blamed ReLUs (there are none) and named nothing."""
    torch.manual_seed(0)
    model = Clip()
    rest = [p for n, p in model.named_parameters() if n != "logit_scale"]
    opt = torch.optim.SGD(
        [{"params": rest, "lr": 0.1}, {"params": [model.logit_scale], "lr": 500.0}]
    )
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(7):
            logits = model(torch.randn(8, 32), torch.randint(0, 100, (8, 5)))
            labels = torch.arange(8)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = all_diagnoses(nw, "NW304")[0]
    assert any("moved logit_scale by about" in e and "lr 500" in e for e in d.evidence)
    assert "ReLU" not in d.explanation and "logit_scale" in d.explanation
    assert d.fix.startswith('opt.param_groups[1]["lr"] = ')


# ---------------------------------------------------------------- NW303


class MoCo(nn.Module):
    def __init__(self, dim: int = 16, k: int = 64) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(
            nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, dim)
        )
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for p in self.encoder_k.parameters():
            p.requires_grad = False
        self.k = k
        self.register_buffer("queue", F.normalize(torch.randn(dim, k), dim=0))
        self.ptr = 0

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            for pq, pk in zip(
                self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True
            ):
                pk.data = pk.data * 0.99 + pq.data * 0.01
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = (q * k).sum(1, keepdim=True)
        l_neg = q @ self.queue.clone()
        return torch.cat([l_pos, l_neg], dim=1) / 0.07, k

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        self.queue[:, self.ptr : self.ptr + keys.shape[0]] = keys.T
        self.ptr = (self.ptr + keys.shape[0]) % self.k


def test_a_gradient_norm_rising_in_a_warm_up_then_settling_is_no_explosion() -> None:
    """MoCo: the norm rises 20× from 0.06 as the queue fills, settles near 1, and one step
    is 4.4: 11× the median of the whole run, 6× the settled level. It was an NW303."""
    torch.manual_seed(0)
    model, crit = MoCo(), nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.03, momentum=0.9, weight_decay=1e-4)
    with nanwatch.watch(model, crit, on_anomaly="record", postmortem=False) as nw:
        for _ in range(24):
            x = torch.randn(16, 32)
            logits, k = model(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))
            loss = crit(logits, torch.zeros(16, dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.enqueue(k)
            nw.step()
    assert math.isfinite(loss.item())
    assert all_diagnoses(nw, "NW303") == []
