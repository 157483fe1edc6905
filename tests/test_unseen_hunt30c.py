"""A NaN born in a submodule that watch mode did not measure (a LayerNorm, whose output the
next record bounds), found by replaying the module around it: the anomaly names the
innermost module the replayed op ran in, in its path, its summary and the rules' evidence,
also when that module is a child of the root, whose children's paths do not start with the
root's name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import first_bad, text
from tests.test_unseen_hunt30b import Block


def _blocks() -> nanwatch.Watcher:
    # the first block's LayerNorm scales its output to 1e20, finite; the second block's
    # LayerNorm takes values near 4.5e20, whose float32 variance overflows: NaN. Neither
    # the LayerNorms' nor the blocks' outputs are measured in watch mode
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    with torch.no_grad():
        model[0].fc.weight.mul_(1e12)
        model[0].ln.weight.fill_(1e20)
    with nanwatch.watch(model, mode="watch", on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(4, 32)).sum().backward()
        nw.step()
    return nw


def test_the_unmeasured_layernorm_a_root_replay_found_is_named_not_the_root() -> None:
    nw = _blocks()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.path == "1.ln"
    assert a.path == "1.ln", a.summary
    assert a.summary.startswith(
        "NaN born in the forward of 1.ln (LayerNorm), inside Sequential; first seen in "
        "Sequential (forward, output) [op aten.native_layer_norm.default at "
    ), a.summary
    d = first_bad(nw).diagnoses[0]
    assert d.code == "NW101"
    said = text(d)
    # the root's input is at most 3.1: the values near 4.5e20 are the LayerNorm's input
    assert "(the input of Sequential)" not in said
    assert "aten.native_layer_norm in 1.ln made NaN in float32 from finite inputs up to " in said
    assert "(the input of 1.ln)" in said


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.silu(self.norm(self.inp(x) * 1e20)))


def test_a_value_the_roots_code_passed_on_is_born_in_its_child_not_its_own_code() -> None:
    # the root's code passes silu(norm(...)) to fc: fc's input is the first record that
    # holds the NaN, and the replay of the root traces it to norm's layer_norm
    torch.manual_seed(0)
    model = _Head()
    with nanwatch.watch(model, mode="watch", on_anomaly="record", postmortem=False) as nw:
        model(torch.randn(4, 32)).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and a.op.path == "norm"
    assert (a.path, a.origin) == ("norm", "module"), a.summary
    assert a.summary.startswith(
        "NaN born in the forward of norm, then passed by the code of _Head to fc (input[0]) "
    ), a.summary
    said = text(first_bad(nw).diagnoses[0])
    assert "in _Head made" not in said and "aten.native_layer_norm in norm made NaN" in said
