"""Reports for the rendering tests: built from gallery scenarios (and one simulated CUDA
crash), with the environment and the time pinned, saved under ``tests/golden/`` as JSON.

The JSON files are the golden *inputs*: the renderer is tested against them, so a change
in the rules or the localizer does not move the rendering goldens. Rebuild them (and the
rendered goldens) with::

    NANWATCH_REGEN_GOLDEN=fixtures python -m pytest tests/test_render.py

and only the rendered text with ``NANWATCH_REGEN_GOLDEN=1``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

import nanwatch
from nanwatch import scenarios
from nanwatch.report import Environment, Report

GOLDEN = Path(__file__).parent / "golden"
#: the reports the golden tests render, by file stem
NAMES = ("fp16-seg-overflow", "sqrt-backward", "inplace-saved", "healthy-fp16", "cuda-assert")
CUDA_MESSAGE = (
    "CUDA error: device-side assert triggered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
)


def regen_mode() -> str:
    return os.environ.get("NANWATCH_REGEN_GOLDEN", "")


class Classifier(nn.Module):
    """Token classifier for the simulated CUDA crash."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


def simulated_cuda_crash(report_dir: Path | None = None) -> tuple[nanwatch.Watcher, BaseException]:
    """Three healthy steps, then the forward and loss of a fourth, then the error CUDA raises
    when a class target is out of range (on CPU it is raised by hand, with CUDA's message,
    where ``loss.item()`` would surface it). Guards are off: they would stop the target."""
    torch.manual_seed(0)
    model, criterion = Classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options: dict[str, object] = {
        "on_anomaly": "record",
        "guards": False,
        "postmortem": report_dir is not None,
    }
    if report_dir is not None:
        options["report_dir"] = str(report_dir)
    nw = nanwatch.watch(model, criterion, **options)  # type: ignore[arg-type]
    try:
        with nw:
            for step in range(4):
                ids = torch.randint(0, 50, (8, 12))
                target = torch.randint(0, 5, (8,))
                loss = criterion(model(ids), target)
                if step == 3:  # on a GPU: a target of 255 made the loss kernel assert, and
                    raise RuntimeError(CUDA_MESSAGE)  # loss.item() reports it
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    except RuntimeError as exc:
        return nw, exc
    raise AssertionError("the simulated crash did not raise")


def pin(report: Report) -> Report:
    """Make a report reproducible: fixed time and environment, relative paths."""
    env = report.environment
    report.environment = Environment(
        nanwatch="0.1.0",
        torch="2.13.0",
        cuda=None,
        python="3.11.7",
        platform="Linux-x86_64",
        mode=env.mode,
        devices=env.devices,
        dtypes=env.dtypes,
        amp_dtypes=env.amp_dtypes,
        dtype_limits=env.dtype_limits,
        modules=env.modules,
        scaler=env.scaler,
    )
    report.created = "2025-01-01T12:00:00+00:00"
    if report.error is not None and report.error.get("traceback"):
        cwd = os.getcwd() + os.sep
        report.error["traceback"] = [
            line.replace(cwd, "")
            for line in report.error["traceback"]
            if "site-packages" not in line
        ]
    return report


def build(name: str) -> Report:
    """The report the golden file ``name`` holds, built afresh."""
    if name == "cuda-assert":
        nw, exc = simulated_cuda_crash()
        return pin(Report.from_watcher(nw, exc))
    outcome = scenarios.run(scenarios.get(name))
    assert outcome.watcher is not None
    return pin(Report.from_watcher(outcome.watcher, outcome.error))


def load(name: str) -> Report:
    path = GOLDEN / f"{name}.json"
    if regen_mode() == "fixtures" or not path.exists():
        build(name).save(path)
    return Report.load(path)
