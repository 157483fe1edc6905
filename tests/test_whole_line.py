"""A fix that rewrites one statement of a one-line compound statement keeps the user's
whole line (its ``else:`` header): pasted alone, ``e = ...`` ran whatever the branch.
The rules' engine puts every rule's rewrite back on its line (tests/test_unseen_domain25
covers a domain rule; this one an overflow rule's fix)."""

from __future__ import annotations

import ast

import torch
from torch import nn

import nanwatch


class _M(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
        z = self.lin(x).half() * 1000
        if plain: e = z  # fmt: skip  # noqa: E701, SIM108
        else: e = torch.exp(z)  # fmt: skip  # noqa: E701
        return e / e.sum(-1, keepdim=True)


def test_an_overflow_fix_keeps_the_else_of_the_users_line() -> None:
    torch.manual_seed(0)
    m = _M()
    with nanwatch.watch(m, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        m(torch.randn(2, 4)).float().sum().backward()
        nw.step()
    d = nw.history[-1].diagnoses[0]
    assert d.code == "NW101"
    first = d.fix.splitlines()[0]
    assert first.startswith("else: e = torch.exp(z - z.amax(dim=-1, keepdim=True))"), first
    ast.parse("if plain: e = z\n" + first)  # pastes under its if
