"""Sentinel localizes a gradient born in the code of a module that holds the parameter's
module (a root's acosh of a distance between embeddings) by replaying that holder's own
backward; a gradient born in the loss code names the loss code's risky nodes."""

from __future__ import annotations

import ast
import inspect
import os

import torch
from torch import nn

import nanwatch
from tests._diagnoses import code_lines
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


class _Poincare(nn.Module):
    def __init__(self, guard: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 2)
        self.guard = guard
        with torch.no_grad():
            self.emb.weight.uniform_(-1e-3, 1e-3)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        e = self.emb(pairs)
        u, v = e[..., 0, :], e[..., 1, :]
        sq = ((u - v) ** 2).sum(-1)
        x = 1 + 2 * sq / ((1 - (u**2).sum(-1)) * (1 - (v**2).sum(-1)))
        if self.guard:
            eps = torch.finfo(torch.float32).eps
            return torch.acosh(x.clamp_min(1 + eps))
        return torch.acosh(x)


def _pairs() -> torch.Tensor:
    u = torch.tensor([[0, 1], [2, 3], [4, 4]])  # the last compares a point with itself
    return torch.stack([u[:, :1].expand(-1, 2), u], -1)


def _step(model: nn.Module) -> None:
    d = model(_pairs())
    torch.nn.functional.cross_entropy(-d, torch.zeros(3, dtype=torch.long)).backward()


def test_sentinel_replays_the_roots_own_backward_for_a_child_parameters_gradient() -> None:
    torch.manual_seed(0)
    model = _Poincare()
    err = _raises(model, lambda: _step(model), mode="sentinel")
    d = err.diagnoses[0]
    assert d.code == "NW114", [x.code for x in err.diagnoses]
    msg = str(err)
    assert "aten.acosh" in msg and "emb.weight" in msg
    assert "clamp_min(1 + eps)" in d.fix and "criterion(model(x), y)" not in d.fix
    ast.parse(code_lines(d.fix))
    # the fix, applied, keeps the gradient finite
    guarded = _Poincare(guard=True)
    guarded.load_state_dict(model.state_dict())
    with nanwatch.watch(guarded, mode="sentinel") as nw:
        _step(guarded)
        nw.step()
    assert guarded.emb.weight.grad is not None
    assert torch.isfinite(guarded.emb.weight.grad).all()


class _Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 2)
        with torch.no_grad():
            self.emb.weight.uniform_(-1e-3, 1e-3)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.emb(pairs)


def test_sentinel_names_the_loss_codes_node_given_its_steep_edge() -> None:
    # of the loss code's risky nodes (the division, the acosh), the acosh was given exactly
    # 1 (a point compared with itself), where its derivative is infinite: it is named, by
    # its op and line, from what it saved as backward began
    torch.manual_seed(0)
    model = _Emb()

    def run() -> None:
        e = model(_pairs())
        u, v = e[..., 0, :], e[..., 1, :]
        x = 1 + 2 * ((u - v) ** 2).sum(-1) / ((1 - (u**2).sum(-1)) * (1 - (v**2).sum(-1)))
        d = torch.acosh(x)  # the acosh
        torch.nn.functional.cross_entropy(-d, torch.zeros(3, dtype=torch.long)).backward()

    err = _raises(model, run, mode="sentinel")
    d = err.diagnoses[0]
    assert d.code == "NW114", [x.code for x in err.diagnoses]
    assert d.op == "aten.acosh"
    lines, start = inspect.getsourcelines(run)
    line = start + next(i for i, text in enumerate(lines) if "# the acosh" in text)
    assert d.source is not None and d.source.endswith(f"{os.path.basename(__file__)}:{line}")
    assert "d = torch.acosh(x.clamp_min(1 + eps))" in d.fix
