"""What the anomaly's headline, summary and location lines say, found by user testing: an
input a no_grad sampling loop computed between two calls of the model (1 / sqrt(0) of a
schedule's last value) is not bad data, while a loaded batch still is; a -inf the anomaly's
own tensor holds (a float16 matmul's overflow) is not said to have grown out of itself."""

from __future__ import annotations

import io

import torch
from rich.console import Console
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind
from nanwatch.report import anomaly_headline


class _Den(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _sample(scale: float) -> nanwatch.Anomaly | None:
    """A training step, then a DDPM-style loop under no_grad in the next step:
    ``x = 1 / alpha.sqrt() * (x - eps)`` at each sampling step."""
    torch.manual_seed(0)
    model = _Den()
    alphas = torch.tensor([0.9, 0.5, scale])  # the last value 0: 1 / sqrt(0) = inf
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(torch.randn(4, 1, 6, 6)).pow(2).mean().backward()
        nw.step()
        with torch.no_grad():
            x = torch.randn(4, 1, 6, 6)
            for i in reversed(range(3)):
                eps = model(x)
                x = 1 / alphas[i].sqrt() * (x - eps)
            model(x)
    return nw.first_anomaly


def test_a_no_grad_sampling_loops_division_is_not_called_bad_data() -> None:
    a = _sample(0.0)
    assert a is not None and a.kind is AnomalyKind.INPUT
    head = anomaly_headline(a)
    assert "bad data" not in a.summary and "input data" not in a.summary
    assert "input data" not in head
    assert "computed by your code between two calls of _Den" in a.summary
    assert "computed by your code between two calls of _Den" in head
    assert head.startswith("+inf, -inf in input[0] of _Den")


def test_a_healthy_sampling_loop_has_no_anomaly() -> None:
    assert _sample(0.3) is None


def test_a_loaded_batch_with_a_bad_value_is_still_bad_data() -> None:
    torch.manual_seed(0)
    model = _Den()
    clean, bad = torch.randn(4, 1, 6, 6), torch.randn(4, 1, 6, 6)
    bad[1, 0, 2, 3] = float("nan")  # one pixel of a loaded sample, not a whole sample
    with nanwatch.watch(model, on_anomaly="record") as nw:
        for xb in (clean, bad):  # micro-batches of one step
            model(xb).mean().backward()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.origin == "data"
    assert "bad data, not a layer" in a.summary
    assert "in the input data (input[0] of _Den)" in anomaly_headline(a)


class _Interact(nn.Module):
    """DLRM's pairwise dot products: a float16 bmm that overflows, fed to a child."""

    def __init__(self) -> None:
        super().__init__()
        self.top = nn.Linear(9, 1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        z = torch.bmm(t, t.transpose(1, 2))  # |t| ~ 300 over 64 dims: past 65504
        return self.top(z.flatten(1))


def _render(report: nanwatch.Report) -> str:
    buf = io.StringIO()
    Console(width=100, color_system=None, file=buf).print(report)
    return buf.getvalue()


def test_an_overflows_own_neginf_is_not_said_to_grow_out_of_itself() -> None:
    torch.manual_seed(0)
    model = _Interact().half()
    t = (torch.randn(2, 3, 64) * 300).half()
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(t)
    a = nw.first_anomaly
    assert a is not None and a.neginf_source is not None
    assert a.neginf_source.index == a.record.index  # the -inf was made in that very value
    text = _render(nw.report)
    assert "grew out of" not in text
    assert "grew out of" not in nw.report.to_html()
    assert "first seen in top (input, input[0])" not in text


class _Coupling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.relu(self.net(x))  # a scale that hits 0
        return x * s, torch.log(s).sum(-1)  # log-det: -inf


class _Flow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = _Coupling()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, ld = self.c1(x)
        return z, ld + 0.0


def test_a_neginf_from_an_earlier_tensor_is_named_in_plain_words() -> None:
    torch.manual_seed(0)
    flow = _Flow()
    with nanwatch.watch(flow, on_anomaly="record", postmortem=False) as nw:
        z, ld = flow(torch.randn(16, 2))
        (0.5 * z.pow(2).sum(-1) - ld).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.neginf_source is not None
    assert a.neginf_source.index != a.record.index
    line = "grew out of a -inf that first appeared in the output[1] of c1 (step 0)."
    assert line in " ".join(_render(nw.report).split())
    assert line in nw.report.to_html()
    assert "(forward, output[1])." not in _render(nw.report)
