"""Forensic mode tells the same story as watch mode for an InfoNCE loss written by hand
(``exp(z1 @ z2.t() / tau)``, then the log of a ratio): the exp's argument is a similarity
over a small temperature, not values that exploded. The forensic op event carries what made
its first operand (read from that operand's ``grad_fn``), and the log's line stands in for
the loss graph that forensic mode does not read."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.ops import operand_made_from

torch.set_num_threads(1)


class Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


def _infonce(mode: str, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    m = Enc()
    x = torch.randn(16, 12)
    with nanwatch.watch(m, mode=mode, on_anomaly="record", postmortem=False) as nw:
        with torch.autocast("cpu", dtype=dtype):
            z1, z2 = m(x), m(x + 0.01 * torch.randn_like(x))
            sim = z1 @ z2.t() / 0.01
            e = torch.exp(sim)
            loss = -torch.log(e.diagonal() / e.sum(-1)).mean()
        loss.backward()
        nw.step()
    return nw.report.diagnoses[0]


@pytest.mark.parametrize("mode", ["forensic", "watch"])
def test_bf16_infonce_is_a_similarity_over_a_temperature_not_an_explosion(mode: str) -> None:
    d = _infonce(mode, torch.bfloat16)
    assert d.code == "NW101"
    text = "\n".join(d.evidence)
    assert "values themselves exploded" not in text
    assert "initial weights or the inputs" not in text
    assert "(the graph below the exp: div <- mm): a similarity over a temperature" in text
    assert "the exp bound of float32 and bfloat16 alike: a float32 exp overflows as well" in text
    assert "loss = F.cross_entropy(logits, labels)" in d.fix
    assert "labels = torch.arange(len(logits)" in d.fix  # the positives are the diagonal


def test_forensic_names_the_line_that_takes_the_log() -> None:
    d = _infonce("forensic", torch.bfloat16)
    (line,) = [e for e in d.evidence if e.startswith("the loss takes the log of a ratio")]
    assert line.endswith("loss = -torch.log(e.diagonal() / e.sum(-1)).mean())")


class Blown(nn.Module):
    """Weights large enough that exp of the layer's output overflows float32 at step 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        with torch.no_grad():
            self.lin.weight.fill_(40.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_control_an_exp_of_a_layer_output_still_reads_as_grown_values() -> None:
    # the same log-of-a-ratio loss, but the exp's argument is a Linear's output (addmm), no
    # product over a temperature: forensic mode keeps the story of values grown too large
    torch.manual_seed(0)
    m = Blown()
    with nanwatch.watch(m, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        sim = m(torch.ones(4, 4))
        e = torch.exp(sim)
        loss = -torch.log(e[:, 0] / e.sum(-1)).mean()
        loss.backward()
        nw.step()
    d = nw.report.diagnoses[0]
    assert d.code == "NW101"
    text = "\n".join(d.evidence)
    assert "similarity over a temperature" not in text
    assert "exp's argument reached" in text


def test_operand_made_from_reads_the_operands_graph() -> None:
    z = torch.ones(3, 3, requires_grad=True)
    assert operand_made_from(z @ z.t() / 0.01) == ["div", "mm", "leaf"]
    assert operand_made_from(z) == ["leaf"]
    assert operand_made_from(torch.ones(2)) == []
    with torch.no_grad():
        assert operand_made_from(z * 2) == []
