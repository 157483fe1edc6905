"""A mean pooled by hand in float16, ``h.sum(1) / x.shape[1]`` over 4,096 positions: each
activation is under 100, the sum passes 65504 and is inf. NW101 names the sum, says how
many values each result adds, and its fix keeps the model's dtype: ``h.mean(1)`` (torch
adds in float32 and returns float16) or the float32 sum cast back after the division --
not a float32 ``pooled`` that the float16 head after it would refuse (mat1 and mat2 must
have the same dtype). The fixed models train clean."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nanwatch


class SumPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        pooled = h.sum(1) / x.shape[1]
        return self.head(pooled)


class TorchSumPool(SumPool):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        pooled = torch.sum(h, 1) / x.shape[1]
        return self.head(pooled)


class MeanPool(SumPool):  # the first fix nanwatch gives
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        pooled = h.mean(1)
        return self.head(pooled)


class CastBackPool(SumPool):  # the second
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        pooled = (h.float().sum(1) / x.shape[1]).to(torch.float16)
        return self.head(pooled)


def _run(model: nn.Module, mode: str) -> tuple[list[nanwatch.Diagnosis], list[float]]:
    torch.manual_seed(0)
    model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    losses: list[float] = []
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x = (torch.randn(2, 4096, 8, generator=gen) * 20 + 20).half()
            y = torch.randn(2, 1, generator=gen)
            loss = (model(x).float() - y).pow(2).mean()
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return [d for t in nw.history for d in t.diagnoses], losses


def _model(cls: type[SumPool]) -> SumPool:
    torch.manual_seed(0)
    return cls()


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_a_float16_sum_pooled_by_hand_gets_a_mean_that_keeps_the_dtype(mode: str) -> None:
    ds, losses = _run(_model(SumPool), mode)
    assert not math.isfinite(losses[0])
    found = [d for d in ds if d.code == "NW101" and d.step == 0]
    assert found, [d.headline for d in ds]
    d = found[0]
    assert d.op == "aten.sum.dim_IntList"
    text = " ".join(d.evidence)
    assert "adds 4,096 values into each result" in text
    assert "past 65504" in text
    assert "pooled = h.sum(1) / x.shape[1]" in text
    first, second, *_ = d.fix.splitlines()
    assert first == "pooled = h.mean(1)  # was: pooled = h.sum(1) / x.shape[1]"
    assert "torch.mean adds them in float32 and returns float16" in second
    assert "pooled = (h.float().sum(1) / x.shape[1]).to(torch.float16)" in d.fix
    assert "keep pooled in float32" not in d.fix  # the float16 head would refuse it


def test_the_torch_sum_spelling_gets_the_same_fix() -> None:
    ds, _ = _run(_model(TorchSumPool), "watch")
    d = next(d for d in ds if d.code == "NW101" and d.step == 0)
    assert d.fix.splitlines()[0] == (
        "pooled = h.mean(1)  # was: pooled = torch.sum(h, 1) / x.shape[1]"
    )
    assert "pooled = (h.float().sum(1) / x.shape[1]).to(torch.float16)" in d.fix


@pytest.mark.parametrize("cls", [MeanPool, CastBackPool])
@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_either_fix_trains_clean_in_float16(cls: type[SumPool], mode: str) -> None:
    ds, losses = _run(_model(cls), mode)
    assert all(math.isfinite(v) for v in losses)
    assert not [d for d in ds if d.severity == "error"], [d.headline for d in ds]
