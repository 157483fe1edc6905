"""A sqrt at 0 in a child block's own code, between its submodules, makes a NaN gradient:
the block's backward is replayed to name the op and its line. Read late (the accelerator
path), backward has freed the block's input, which only its nodes held (a checkpointed
block's input, kept by checkpoint for its recomputation, or a plain child's): it is made
again from the module that produced it, or from the root's own inputs, as the CPU path
finds it alive in backward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanwatch
from nanwatch.records import AnomalyKind, StepTrace


class RmsBlock(nn.Module):
    """RMS-style normalization with the eps outside the sqrt: a zero row makes sqrt(0)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        rms = torch.sqrt(h.pow(2).mean(-1, keepdim=True)) + 1e-6
        return x + h / rms


class Net(nn.Module):
    """``wrap`` runs the block (directly or through activation checkpointing); ``scale``
    puts the root's own code between the block and the module that made its input."""

    def __init__(self, wrap: Callable[..., torch.Tensor], *, scale: bool) -> None:
        super().__init__()
        self.wrap, self.scale = wrap, scale
        self.inp = nn.Linear(4, 8, bias=False)
        self.block = RmsBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.scale:
            h = h * 1.5
        return self.head(self.wrap(self.block, h))


def _plain(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return block(h)


def _reentrant(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, h, use_reentrant=True)  # type: ignore[no-any-return]


def _non_reentrant(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, h, use_reentrant=False)  # type: ignore[no-any-return]


def _step(wrap: Callable[..., torch.Tensor], *, scale: bool) -> StepTrace:
    torch.manual_seed(0)
    model = Net(wrap, scale=scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    x[12:] = 0.0  # padding rows: a zero row of h, whose rms is sqrt(0)
    with nanwatch.watch(model, mode="watch", on_anomaly="record", postmortem=False) as nw:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    return nw.history[0]


_GAP = (
    "a NaN gradient is read at the step end, after the update wrote it into the weights: "
    "the block's input, freed by backward, cannot be made again to replay its backward, "
    "and under checkpoint what its nodes saved is recomputed in backward, not kept"
)
_LATE = pytest.mark.gpu_bound_weaker(reason=_GAP)


@pytest.mark.parametrize("scale", [False, True], ids=["child-output", "root-code"])
@pytest.mark.parametrize(
    "wrap",
    [pytest.param(_non_reentrant, marks=_LATE), pytest.param(_reentrant, marks=_LATE), _plain],
    ids=["non-reentrant", "reentrant", "plain"],
)
def test_a_blocks_own_backward_is_named_with_its_line_when_read_late(
    wrap: Callable[..., torch.Tensor], scale: bool
) -> None:
    trace = _step(wrap, scale=scale)
    a = trace.anomaly
    assert a is not None
    assert (a.kind, a.path, a.origin) == (AnomalyKind.BACKWARD, "block", "between-children")
    assert a.op is not None and (a.op.op, a.op.node) == ("aten.sqrt", "SqrtBackward0")
    d = trace.diagnoses[0]
    assert (d.code, d.op) == ("NW112", "aten.sqrt")
    evidence = " | ".join(d.evidence)
    assert "rms = torch.sqrt(h.pow(2).mean(-1, keepdim=True)) + 1e-6" in evidence
    assert "4 exact zeros" in evidence
    assert "torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-12)" in d.fix
