"""NW202 (Sigmoid followed by BCELoss) warns on evidence, not on the pairing alone: a
healthy run (the pytorch/examples VAE: probabilities near 0.5) gets one info-level note,
not a warning every step; probabilities within a few eps of 1 in their dtype, or below its
smallest normal, get the warning. The thresholds follow torch.finfo of the probabilities'
dtype; a note that grows into a warning is reported as the warning."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules._evidence import fmt
from nanwatch.scenarios import sigmoid_bce

torch.set_num_threads(1)


class Decoder(nn.Module):
    """The pytorch/examples VAE decoder's shape: Linear, ReLU, Linear, nn.Sigmoid."""

    def __init__(self, bias: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.Sigmoid()).to(
            dtype
        )
        with torch.no_grad():
            self.net[2].bias.fill_(bias)
            if bias:  # every output is sigmoid(bias)
                self.net[2].weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def _train(
    model: Decoder,
    steps: int,
    target: float | None = None,
    *,
    push: dict[int, float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, list[str]]:
    """``steps`` steps of F.binary_cross_entropy on the decoder (reconstruction: the target is
    the data itself, or ``target`` everywhere); ``push`` sets the last bias before a step."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with nanwatch.watch(model, on_anomaly="warn", postmortem=False) as nw:
            for i in range(steps):
                if push and i in push:
                    with torch.no_grad():
                        model.net[2].bias.fill_(push[i])
                x = torch.rand(32, 6, dtype=dtype)
                y = (
                    torch.rand(32, 12, dtype=dtype) * 0.8 + 0.1
                    if target is None
                    else torch.full((32, 12), target, dtype=dtype)
                )
                recon = model(x)
                loss = F.binary_cross_entropy(recon, y, reduction="sum") / 32
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    said = [str(w.message) for w in ws if issubclass(w.category, nanwatch.NanwatchWarning)]
    return nw, said


def _nw202(nw: Any) -> list[tuple[int, str]]:
    return [(t.step, d.severity) for t in nw.history for d in t.diagnoses if d.code == "NW202"]


def test_a_healthy_vae_gets_one_note_not_a_warning_every_step() -> None:
    nw, said = _train(Decoder(), 6)
    assert _nw202(nw) == [(0, "info")]
    assert said == []  # an info note raises no NanwatchWarning
    report = nw.report
    assert report.status == "ok"
    (d,) = [d for d in report.diagnoses if d.code == "NW202"]
    assert d.severity == "info"
    assert "stay away from 0 and 1, as they do here" in d.explanation
    assert "F.binary_cross_entropy_with_logits(recon, y" in d.fix


def test_the_note_is_said_again_once_the_report_window_has_dropped_it() -> None:
    # ring_size steps of history: the note stays in every report, said once per window
    model = Decoder()
    torch.manual_seed(0)
    with nanwatch.watch(model, ring_size=4, on_anomaly="record", postmortem=False) as nw:
        for _ in range(10):
            recon = model(torch.rand(8, 6))
            F.binary_cross_entropy(recon, torch.full_like(recon, 0.5)).backward()
            nw.step()
    assert _nw202(nw) == [(8, "info")]  # said at 0, 4 and 8; the ring keeps steps 6..9
    assert [d.code for d in nw.report.diagnoses] == ["NW202"]


def test_probabilities_within_a_few_eps_of_1_warn_with_the_numbers() -> None:
    # sigmoid(15.5) = 1 - 1.8e-7 in float32: within 4 eps (4.77e-7) of 1; target 1, so
    # nothing is clamped and the loss is tiny: NW201 has nothing to say
    nw, said = _train(Decoder(bias=15.5), 2, target=1.0)
    assert _nw202(nw) == [(0, "warning"), (1, "warning")]
    d = next(d for d in nw.history[0].diagnoses if d.code == "NW202")
    assert d.evidence[0].startswith("F.binary_cross_entropy's largest probability is 1 - ")
    assert "within 4 × eps = 4.77e-07 of 1 in float32" in d.evidence[0]
    assert "NW201" not in [x.code for t in nw.history for x in t.diagnoses]
    assert len([m for m in said if "NW202" in m]) == 1  # the warning is announced once


def test_the_same_logits_in_float64_are_far_from_its_eps() -> None:
    # float64's eps is 2.2e-16: 1 - 1.8e-7 is nowhere near it, the two-step log is exact
    nw, said = _train(Decoder(bias=15.5, dtype=torch.float64), 2, target=1.0, dtype=torch.float64)
    assert _nw202(nw) == [(0, "info")]
    assert said == []


def test_probabilities_below_the_smallest_normal_warn() -> None:
    # sigmoid(-87.5) = 1e-38 in float32, a subnormal (finfo.tiny = 1.18e-38); target 0
    nw, _ = _train(Decoder(bias=-87.5), 1, target=0.0)
    (d,) = [d for d in nw.history[0].diagnoses if d.code == "NW202"]
    assert d.severity == "warning"
    tiny = fmt(torch.finfo(torch.float32).tiny)
    assert f"below the smallest normal float32 ({tiny})" in d.evidence[0]


def test_a_note_that_grows_into_a_warning_is_reported_as_the_warning() -> None:
    nw, said = _train(Decoder(), 4, target=1.0, push={2: 15.5})
    assert _nw202(nw) == [(0, "info"), (2, "warning"), (3, "warning")]
    (d,) = [d for d in nw.report.diagnoses if d.code == "NW202"]
    assert (d.severity, d.step) == ("warning", 2)
    assert nw.report.status == "warning"
    assert len([m for m in said if "NW202" in m]) == 1


def test_the_gallery_scenario_warns_once_the_detector_grows_confident() -> None:
    runs: list[Any] = []

    def watch(*a: Any, **k: Any) -> Any:
        nw = nanwatch.watch(*a, on_anomaly="record", postmortem=False, **k)
        runs.append(nw)
        return nw

    sigmoid_bce.train(watch)
    (nw,) = runs
    seen = _nw202(nw)
    assert seen[0] == (0, "info")
    assert any(sev == "warning" for _, sev in seen[1:]), seen
    (d,) = [d for d in nw.report.diagnoses if d.code == "NW202"]
    assert d.severity == "warning"
    assert "of 1 in float32" in d.evidence[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_eps_moves_the_threshold(dtype: torch.dtype) -> None:
    # p = sigmoid(6) = 0.9975: within 4 eps of 1 in float16 (eps 9.8e-4) and bfloat16
    # (eps 7.8e-3), far from it in float32
    model = Decoder(bias=6.0, dtype=dtype)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        recon = model(torch.rand(4, 6, dtype=dtype))
        F.binary_cross_entropy(recon.float(), torch.ones(4, 12)).backward()
        nw.step()
    ds = [d for d in nw.history[0].diagnoses if d.code == "NW202"]
    assert ds, [d.code for d in nw.history[0].diagnoses]
    eps = torch.finfo(dtype).eps
    assert ds[0].severity == "warning", ds[0].evidence
    assert f"4 × eps = {fmt(4 * eps)} of 1 in {str(dtype)[6:]}" in ds[0].evidence[0]
