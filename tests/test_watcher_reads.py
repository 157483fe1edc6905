"""The statistics reads of watch mode's module hooks (issue 8): a view of values measured
already in the step, unchanged since, is not read a second time, and its record holds the
same statistics a read would have given."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
import nanwatch.watcher as watcher_mod
from nanwatch.records import Phase


class _FlatHead(nn.Module):
    """A language model's head: logits over (batch, sequence) flattened for the loss."""

    def __init__(self, *, bump: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 32)
        self.bump = bump

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.bump:  # written in place after the Linear's hook measured it
            h.add_(100.0)
        return h.flatten(0, 1)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of elements of each tensor the hooks read (both reading paths)."""
    sizes: list[int] = []
    for name in ("aminmax", "minmax"):
        original = getattr(watcher_mod, name)

        def counted(t: torch.Tensor, *a: Any, _original: Any = original, **k: Any) -> Any:
            sizes.append(t.numel())
            return _original(t, *a, **k)

        monkeypatch.setattr(watcher_mod, name, counted)
    return sizes


def _run(model: nn.Module, sizes: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
    """The step's trace, the root's output and its gradient, and how many tensors of the
    output's size the forward read."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, 8)  # logits of 2**17 values: a second read would cost
    y = torch.randint(0, 32, (64 * 64,))
    grads: dict[str, torch.Tensor] = {}
    with nanwatch.watch(model) as nw:
        out = model(x)
        forward_reads = sizes.count(out.numel())
        out.register_hook(lambda g: grads.setdefault("out", g.detach().clone()))
        F.cross_entropy(out, y).backward()
        trace = nw.step()
    return trace, out.detach(), grads["out"], forward_reads


def _stat(trace: Any, phase: Phase, path: str) -> tuple[float, float, int]:
    rec = next(r for r in trace.records if r.phase is phase and r.path == path)
    assert rec.stat is not None, rec
    return rec.stat.min, rec.stat.max, rec.stat.numel


def test_a_view_of_measured_logits_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = _count_reads(monkeypatch)
    trace, out, g, forward_reads = _run(_FlatHead(), sizes)
    # the Linear's output and the gradient that reaches it are read; the root's output
    # (their flattened view) and its gradient (of which the Linear's is a view) are not
    assert (forward_reads, sizes.count(out.numel())) == (1, 2), sizes
    want = (out.min().item(), out.max().item(), out.numel())
    assert _stat(trace, Phase.FORWARD, "_FlatHead") == pytest.approx(want)
    assert _stat(trace, Phase.FORWARD, "lin") == pytest.approx(want)
    want_g = (g.min().item(), g.max().item(), g.numel())
    assert _stat(trace, Phase.BACKWARD, "_FlatHead") == pytest.approx(want_g)
    assert _stat(trace, Phase.BACKWARD, "lin") == pytest.approx(want_g)


def test_a_view_written_since_its_values_were_read_is_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes = _count_reads(monkeypatch)
    trace, out, _, forward_reads = _run(_FlatHead(bump=True), sizes)
    assert forward_reads == 2, sizes
    lo, hi, _ = _stat(trace, Phase.FORWARD, "_FlatHead")
    assert (lo, hi) == pytest.approx((out.min().item(), out.max().item()))
    assert lo > 50.0  # what the root returned, not what the Linear's hook saw
