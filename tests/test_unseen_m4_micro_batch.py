"""Gradient accumulation: a NaN born inside a module in a later micro-batch of the step
is named with the call of the model it happened in, as bad input data is."""

from __future__ import annotations

import pytest
import torch

import nanwatch


class _Blow(torch.nn.Module):
    """A layer whose own code makes a non-finite value when told to (forward or backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.hit = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.hit == "forward":
            y = y / torch.zeros_like(y)
        elif self.hit == "backward":
            y = torch.sqrt(y - y)  # finite forward; d sqrt at 0 is inf
        return y


def _train(mode: str, hit: str, micro_batches: int = 4) -> nanwatch.Watcher:
    torch.manual_seed(0)
    blow = _Blow()
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), blow, torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for step in range(2):
            for micro in range(micro_batches):
                x, y = torch.randn(4, 8), torch.randn(4, 1)
                blow.hit = hit if (step, micro) == (1, max(micro_batches - 2, 0)) else ""
                loss = torch.nn.functional.mse_loss(model(x), y) / micro_batches
                loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_forward_birth_in_third_micro_batch_names_the_call(mode: str) -> None:
    a = _train(mode, "forward").first_anomaly
    assert a is not None and (a.step, a.kind) == (1, nanwatch.AnomalyKind.FORWARD)
    if mode == "sentinel" and a.path == "Sequential":  # no replay (GPU-bound: nothing landed)
        assert (
            "born in the forward of Sequential (Sequential), in its 3rd call this step" in a.summary
        )
    elif mode == "sentinel":  # found inside the root's output by a replay
        assert (
            "born in the forward of 1 (_Blow), inside Sequential, in its 3rd call this step;"
            in a.summary
        )
    else:
        assert (
            "born in the forward of 1 (_Blow), in the 3rd call of Sequential this step" in a.summary
        )


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_backward_birth_in_third_micro_batch_names_the_call(mode: str) -> None:
    a = _train(mode, "backward").first_anomaly
    assert a is not None and (a.step, a.kind) == (1, nanwatch.AnomalyKind.BACKWARD)
    assert "gradient born in the backward of " in a.summary
    assert ", in the 3rd call of Sequential this step" in a.summary


def test_one_call_a_step_names_no_call() -> None:
    a = _train("watch", "forward", micro_batches=1).first_anomaly
    assert a is not None and a.path == "1"
    assert "this step" not in a.summary


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_healthy_accumulation_reports_nothing(mode: str) -> None:
    nw = _train(mode, "")
    assert nw.first_anomaly is None
