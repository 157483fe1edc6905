"""A NaN born in a module's own backward, on every path: the CPU path, the accelerator path
(``-p tests._accelerator_path``) and the GPU-bound one (``-p tests._gpu_bound``), where what
backward made is read only at the step's end, after ``optimizer.step()`` wrote the NaN
gradient into the weights, so the module cannot be replayed with the weights it ran with.
The op and the user's line must be named all the same: a sqrt at 0 of a squared distance,
an acos at 1 of a clamped cosine, a log at 0 hidden by ``torch.where``. What is kept for
that must cost no recomputation in forward and must not outlive the step."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanwatch
from nanwatch.records import Phase


class _Proto(nn.Module):
    """Logits as minus the distance to prototypes, one prototype equal to a sample's code."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.protos = nn.Parameter(torch.randn(3, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.enc(x)
        diff = z[:, None, :] - self.protos[None]
        d = torch.sqrt((diff**2).sum(-1))
        return -d


class _Angle(nn.Module):
    """Logits as minus the angle to class centres, one centre along a sample's code."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.centres = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos = F.normalize(self.enc(x), dim=-1) @ F.normalize(self.centres, dim=-1).T
        theta = torch.acos(cos.clamp(-1.0, 1.0))
        return -4.0 * theta


class _LogCounts(nn.Module):
    """log of count features (exact zeros) under torch.where, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        z = counts * self.gain
        feats = torch.where(z > 0, torch.log(z), 0)
        return self.head(feats)


def _proto() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model = _Proto()
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    with torch.no_grad():  # prototypes initialised from encoded samples: distance 0
        model.protos.copy_(model.enc(x)[:3])
    return model, lambda: F.cross_entropy(model(x), y)


def _angle() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model = _Angle()
    x, y = torch.randn(16, 6), torch.randint(0, 4, (16,))
    with torch.no_grad():  # centres initialised from the samples' codes: cosine 1
        model.centres.copy_(model.enc(x)[:4])
    return model, lambda: F.cross_entropy(model(x), y)


def _counts() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model = _LogCounts()
    x, y = torch.poisson(torch.full((32, 8), 0.7)), torch.randn(32, 1)
    return model, lambda: F.mse_loss(model(x), y)


def _line_of(text: str) -> str:
    """``file:line`` of the statement ``text`` in this file."""
    lines = Path(__file__).read_text().splitlines()
    return f"{__file__}:{next(i for i, s in enumerate(lines, 1) if s.strip() == text)}"


_CASES = {
    "sqrt-at-0": (_proto, "NW112", "aten.sqrt", "d = torch.sqrt((diff**2).sum(-1))"),
    "acos-at-1": (_angle, "NW114", "aten.acos", "theta = torch.acos(cos.clamp(-1.0, 1.0))"),
    "log-under-where": (
        _counts,
        "NW110",
        "aten.log",
        "feats = torch.where(z > 0, torch.log(z), 0)",
    ),
}


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
@pytest.mark.parametrize("case", list(_CASES))
def test_a_nan_born_in_a_modules_own_backward_names_the_op_and_line(case: str, mode: str) -> None:
    make, code, op, statement = _CASES[case]
    torch.manual_seed(0)
    model, loss_of = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        loss_of().backward()
        opt.step()
        opt.zero_grad()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.step == 0
    assert a.op is not None, a.summary
    assert (a.op.op, a.op.phase) == (op, Phase.BACKWARD)
    assert (a.op.source, a.op.code) == (_line_of(statement), statement)
    d = nw.history[0].diagnoses[0]
    assert (d.code, d.op, d.phase) == (code, op, "backward")
    assert any(statement in e for e in d.evidence), d.evidence


class _Checkpointed(nn.Module):
    """A sqrt whose saved result a non-reentrant checkpoint recomputes in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.runs = 0

    def _root(self, h: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return torch.sqrt(h * h + 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._root, self.enc(x), use_reentrant=False)  # type: ignore[no-any-return]


def test_a_checkpointed_nodes_saved_values_are_not_recomputed_to_be_kept() -> None:
    """Reading what a checkpointed node saved runs the checkpoint's recomputation: nanwatch
    keeps nothing of such a node, so the region runs once in forward and once in backward,
    as without it."""
    torch.manual_seed(0)
    model = _Checkpointed()
    with nanwatch.watch(model, mode="watch", on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(8, 4)).sum().backward()
        nw.step()
    assert model.runs == 2
    assert nw.first_anomaly is None


class _Held(nn.Module):
    """A sqrt whose result only autograd holds: tells whether anything else kept it."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.result: weakref.ref[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.sqrt(self.enc(x) ** 2 + 1.0)
        self.result = weakref.ref(r)
        return r * 2.0


def test_what_is_kept_of_a_step_is_let_go_at_its_end() -> None:
    torch.manual_seed(0)
    model = _Held()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode="watch", on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        nw.step()
        gc.collect()
        assert model.result is not None and model.result() is None
