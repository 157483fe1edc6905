"""A script run by ``nanwatch run`` has no ``nw`` to replay with: the diagnoses tell it the
command's ``--mode forensic`` instead of "mode='forensic' or nw.replay(step_fn)"."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import _frames
from nanwatch.rules.base import cli_words
from tests._diagnoses import top


def _step(nw: nanwatch.Watcher, model: nn.Module) -> None:
    x, t = torch.randn(16, 8), torch.tensor([0, 1, 2, 3] * 4)
    with torch.no_grad():
        snr = torch.tensor([4.0, 1.0, 0.25, 0.0])[t]
        weight = torch.minimum(snr, torch.full_like(snr, 5.0)) / snr  # 0/0 at snr = 0
    loss = (weight * F.mse_loss(model(x), x, reduction="none").mean(1)).mean()
    loss.backward()
    nw.step()


@pytest.mark.parametrize("cli", [False, True])
def test_the_forensic_hint_is_the_commands_under_nanwatch_run(
    monkeypatch: pytest.MonkeyPatch, cli: bool
) -> None:
    if cli:  # as `nanwatch run` registers its launcher's frames
        monkeypatch.setattr(_frames, "_launchers", Counter({__file__: 1}))
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        _step(nw, model)
    d = top(nw)
    assert d.cli is cli
    assert ("nw.replay(step_fn)" in d.fix) is not cli, d.fix
    assert ("nanwatch run --mode forensic" in d.fix) is cli, d.fix


def test_cli_words_keeps_what_is_around_the_hint() -> None:
    assert cli_words("(mode='forensic' or nw.replay(step_fn)) names it") == (
        "(nanwatch run --mode forensic) names it"
    )
    assert cli_words("mode='forensic' (or nw.replay(step_fn)) names") == (
        "nanwatch run --mode forensic names"
    )
    assert cli_words("with nanwatch.watch(model, mode='forensic') as nw:") == (
        "with nanwatch.watch(model, mode='forensic') as nw:"
    )


_SQRT0 = """\
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 4)
x = torch.randn(8, 4)
out = model(x)


def penalty(out):  # a helper's line
    return torch.sqrt((out - out.detach()).pow(2).sum(1)).mean()  # sqrt(0): NaN gradient


terms = [penalty]  # called through a list: watch cannot follow it to the line, forensic can
loss = terms[0](out)
loss.backward()
"""


def test_the_summary_hint_under_nanwatch_run_is_the_command(tmp_path: Path) -> None:
    from nanwatch import cli

    script = tmp_path / "sqrt0.py"
    script.write_text(_SQRT0)
    with pytest.raises(nanwatch.AnomalyError) as info:
        cli.main(["run", "--mode", "watch", "--report-dir", str(tmp_path / "r"), str(script)])
    summary = info.value.anomaly.summary if info.value.anomaly is not None else ""
    assert "nw.replay(step_fn)" not in summary, summary
    assert "nanwatch run --mode forensic names" in summary, summary
