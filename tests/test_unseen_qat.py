"""Quantization-aware training: torch.ao's module swaps under a watched model, and the
gradient of a conv bias before a BatchNorm whose statistics are frozen."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import nanwatch

tq = pytest.importorskip("torch.ao.quantization")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)
        self.dequant = tq.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = self.pool(self.relu(self.bn(self.conv(x)))).flatten(1)
        return self.dequant(self.fc(x))


def _ours(model: nn.Module) -> list[str]:
    """The module paths that still hold a hook made by nanwatch."""
    out = []
    for name, m in model.named_modules():
        for d in (m._forward_pre_hooks, m._forward_hooks):
            for fn in d.values():
                if getattr(fn, "__module__", "").startswith("nanwatch"):
                    out.append(name)
    return out


def _train(
    prepare_after: bool, mode: str | None, freeze_at: int = 99
) -> tuple[list[float], list[warnings.WarningMessage]]:
    torch.manual_seed(0)
    model = _Net().train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    tq.fuse_modules_qat(model, [["conv", "bn", "relu"]], inplace=True)
    if not prepare_after:
        tq.prepare_qat(model, inplace=True)
    crit = nn.CrossEntropyLoss()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", nanwatch.NanwatchWarning)
        watcher = nanwatch.watch(model, crit, mode=mode or "sentinel", postmortem=False)
        with watcher if mode else contextlib.nullcontext(watcher) as nw:
            if prepare_after:  # swaps conv/bn/relu and fc for QAT modules, copying hooks
                tq.prepare_qat(model, inplace=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            for s in range(8):
                if s == freeze_at:
                    model.apply(tq.disable_observer)
                    model.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if mode:
                    nw.step()
            assert nw.anomalies == []
        assert _ours(model) == []  # the copies torch registered went with the watcher
    found = [w for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    return losses, found


@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_prepare_qat_after_attach_runs_and_leaves_no_hook_copies(mode: str) -> None:
    # torch.ao's swap_module registers the replaced module's forward hooks again on the QAT
    # module without kwargs: nanwatch's hooks were called with too few arguments (TypeError)
    losses, found = _train(prepare_after=True, mode=mode)
    plain, _ = _train(prepare_after=True, mode=None)
    assert losses == plain  # the same training as without nanwatch
    assert found == []


def test_swapped_modules_are_watched_after_the_swap() -> None:
    torch.manual_seed(0)
    model = _Net().train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with nanwatch.watch(model, postmortem=False) as nw:
        tq.prepare_qat(model, inplace=True)
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        nw.step()
        called = {c.path: c.module_type for c in nw.history[-1].calls}
    assert called.get("fc") == "Linear" and type(model.fc).__name__ == "Linear"
    assert "conv" in called and called["conv"] == type(model.conv).__name__


def test_frozen_bn_stats_make_a_conv_bias_gradient_real_not_an_explosion() -> None:
    # before the freeze a conv bias before a training-mode BatchNorm has a gradient of
    # rounding noise (its true gradient is 0); after it, a real one: no NW303 spike
    losses, found = _train(prepare_after=False, mode="watch", freeze_at=5)
    assert [str(w.message) for w in found] == []
    assert losses == _train(prepare_after=False, mode=None, freeze_at=5)[0]
