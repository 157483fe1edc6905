"""Post-mortems of exceptions raised by code nanwatch does not watch (stop 24: a tiny GPT's
sampling loop): the report says that every watched value was finite, and the summary
prints the user's line that raised."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import nanwatch
from nanwatch.postmortem import ADVICE
from nanwatch.render import report_summary
from nanwatch.report import Report


def _report(report_dir: Path) -> Report:
    (path,) = report_dir.glob("*.json")
    return Report.load(path)


def _summary(report: Report) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(report_summary(report, ["run.json"]))
    return console.export_text()


def _run(report_dir: Path, temperature: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 16, (4, 5))
    with nanwatch.watch(model, report_dir=str(report_dir)) as nw:
        for _ in range(2):
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
        with torch.no_grad():
            logits = model(x[:, -1:])[:, -1]
            torch.multinomial(F.softmax(logits / temperature, -1), 1)  # NaN when it is 0


def test_a_nan_made_after_the_model_is_said_to_be_the_users_code_with_its_line(
    report_dir: Path,
) -> None:
    """Temperature 0 in sampling code after the model: torch.multinomial refuses NaN
    probabilities. Nothing nanwatch watched held it; the old advice sent the user to a
    'Where it went wrong' that was empty, and the summary did not print the line."""
    with pytest.raises(RuntimeError, match="probability tensor"):
        _run(report_dir, 0.0)
    report = _report(report_dir)
    assert report.error is not None and report.error["class"] == "non-finite"
    advice = str(report.error["advice"])
    assert advice != ADVICE["non-finite"]
    assert "Every value nanwatch watched" in advice and "temperature of 0" in advice
    text = _summary(report)
    assert f"{Path(__file__).name}:" in text and "torch.multinomial" in text, text


def test_an_index_error_prints_the_line_that_raised(report_dir: Path) -> None:
    """A position past a RoPE-style cache: the summary printed the advice but not the line
    the report's JSON held."""
    cache = torch.randn(4, 8)
    model = nn.Linear(8, 8)
    with pytest.raises(IndexError), nanwatch.watch(model, report_dir=str(report_dir)):
        pos = torch.tensor([5])
        model(cache[pos])
    text = _summary(_report(report_dir))
    assert f"{Path(__file__).name}:" in text and "cache[pos]" in text, text
