"""Domain fixes found by user testing: a rewritten line keeps its one-line compound header
(``else:``) and a count raised to a power is floored at 1 before the power; a log of data
with exact zeros gets code (a floor at the data's resolution, log1p for a count); a log
that made the loss in watch mode is rewritten on the loss's line, and a hand-made mixture
of probabilities is named."""

from __future__ import annotations

import ast

import torch
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def _code(fix: str) -> str:
    """The first line of a fix, without its trailing comment."""
    return fix.splitlines()[0].split("   #", 1)[0]


# ------------------------------ 1: else: score = ... / length ** alpha (length 0)


def test_a_fix_of_an_else_line_keeps_its_else_and_floors_the_count_before_the_power() -> None:
    lin = nn.Linear(3, 5)
    alpha, healthy = 0.6, False
    hyp_mask = torch.ones(4, 5)
    hyp_mask[1] = 0  # an empty hypothesis: length 0

    def run() -> None:
        logp = torch.log_softmax(lin(torch.randn(4, 3)), -1)
        not_eos = hyp_mask
        length = not_eos.sum(1)
        if healthy: score = (logp * not_eos).sum(1) / ((5 + length) / 6) ** alpha  # noqa: E701  # fmt: skip
        else: score = (logp * not_eos).sum(1) / length ** alpha  # noqa: E701  # fmt: skip
        score.sum().backward()

    d = _first(_raises(lin, run, "forensic"), "NW111")
    line = _code(d.fix)
    assert line.startswith("else: score = "), d.fix
    assert "length.clamp_min(1) ** alpha" in line
    ast.parse(f"if healthy:\n    pass\n{line}")  # pasted over the line: still its else branch
    # applied: the empty hypothesis scores 0 / 1 = 0, not NaN
    names = {"torch": torch, "logp": torch.full((4, 5), -1.0), "not_eos": hyp_mask}
    names.update(length=hyp_mask.sum(1), alpha=alpha)
    score = eval(line.split("=", 1)[1], names)
    assert torch.isfinite(score).all()


# ------------------------------ 2: log of data with zeros: a floor, or log1p of a count


def test_a_log_of_continuous_data_with_zeros_is_floored_at_its_resolution() -> None:
    lin = nn.Linear(4, 6)
    mel = torch.rand(3, 6) * 70
    mel[1, 2:] = 0.0  # silence
    mel[0, 0] = 72.75

    def run() -> None:
        target = torch.log(mel)
        torch.nn.functional.l1_loss(lin(torch.randn(3, 4)), target).backward()

    d = _first(_raises(lin, run, "forensic"), "NW110")
    line = _code(d.fix)
    assert line == "target = torch.log(mel.clamp_min(1e-5))", d.fix
    assert "log(1e-5) = -11.51" in d.fix and "resolution" in d.explanation
    assert torch.isfinite(eval(line.split("=", 1)[1], {"torch": torch, "mel": mel})).all()


def test_a_log_of_a_count_with_zeros_is_log1p_and_names_the_inverse() -> None:
    lin = nn.Linear(4, 6)
    dur = torch.randint(1, 5, (3, 6))
    dur[1, 3] = 0  # a zero-length phone

    def run() -> None:
        log_dur = torch.log(dur.float())
        torch.nn.functional.mse_loss(lin(torch.randn(3, 4)), log_dur).backward()

    d = _first(_raises(lin, run, "forensic"), "NW110")
    line = _code(d.fix)
    assert line == "log_dur = torch.log1p(dur.float())", d.fix
    assert "dur counts" in d.fix and "expm1" in d.fix
    assert torch.isfinite(eval(line.split("=", 1)[1], {"torch": torch, "dur": dur})).all()


# ------------------------------ 3: watch mode: -log(probs) of a mixture with an exact 0


class _Mixture(nn.Module):
    """p * softmax over a vocabulary, with extra columns only a copy could fill."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 5)
        self.gate = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.gate(x))
        vocab = torch.softmax(self.out(x), -1)
        return torch.cat([p * vocab, torch.zeros(x.shape[0], 2)], -1)


def test_a_log_that_made_the_loss_in_watch_mode_is_rewritten_on_the_loss_line() -> None:
    m = _Mixture()
    tgt = torch.tensor([0, 6, 2])  # 6: a column nothing gave probability

    def run() -> None:
        probs = m(torch.randn(3, 4)).gather(1, tgt[:, None]).squeeze(1)
        loss = -torch.log(probs).mean()
        loss.backward()

    d = _first(_raises(m, run), "NW110")
    line = _code(d.fix)
    assert line == "loss = -torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny)).mean()"
    assert any("the loss was made at" in e for e in d.evidence)
    assert "mixture" in d.explanation and "no softmax or sigmoid is seen" not in d.explanation
    ast.parse(code_lines(d.fix))
    probs = torch.tensor([0.1, 0.0, 0.2])
    assert torch.isfinite(eval(line.split("=", 1)[1], {"torch": torch, "probs": probs}))
