"""Defects that a run on an H100 (torch 2.11, CUDA 13) turned up, reproduced on the CPU.

- Under a GradScaler with a huge scale, float16's backward made NaN beside +inf from one
  finite gradient (log_softmax's -inf + inf). The accelerator path reads only min and max,
  where the NaN hides the inf, so NW305 called it "a NaN born from finite gradients, no
  scale makes it" and stopped a healthy run at its second step.
- A device-side assert can surface as CUBLAS_STATUS_EXECUTION_FAILED in the next matmul:
  the advice must still point at the assert.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import ops
from nanwatch.postmortem import classify


class HalfLinear(nn.Linear):
    """A Linear computed in float16 over float32 weights, as autocast runs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.half(), self.weight.half(), self.bias.half())


class HalfCrossEntropy(nn.Module):
    """Cross-entropy computed in float16 (CUDA's float16 log_softmax backward), the loss
    itself in float32."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = x - x.logsumexp(-1, keepdim=True)
        return -z.gather(1, y[:, None]).float().mean()


class HalfDistance(nn.Module):
    """A float16 distance whose backward at distance 0 is 0 * inf = NaN at any scale."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b) ** 2).sum(-1).sqrt().float().mean()


def _scaled_steps(init_scale: float, steps: int, *, distance: bool = False) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(HalfLinear(32, 64), nn.GELU(), HalfLinear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    crit: nn.Module = HalfDistance() if distance else HalfCrossEntropy()
    with nanwatch.watch(model, crit, scaler=scaler, postmortem=False) as nw:
        nw._defer_cpu = True  # the accelerator path: min and max on the device, no counts
        for _ in range(steps):
            x = torch.randn(16, 32)
            out = model(x)
            loss = crit(out, out.detach()) if distance else crit(out, torch.randint(0, 10, (16,)))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    return nw


def test_a_nan_a_huge_scale_makes_in_float16_backward_is_the_scalers_to_cure() -> None:
    # on_anomaly="raise" (the default): a false NW305 error raised AnomalyError at step 1
    nw = _scaled_steps(2.0**40, 6)
    assert [t.scale for t in nw.history] == [2.0 ** (40 - i) for i in range(6)]
    errors = [d.code for t in nw.history for d in t.diagnoses if d.severity == "error"]
    assert errors == []


def test_a_nan_born_from_a_small_gradient_under_a_scaler_is_still_an_early_error() -> None:
    """The other side: the gradient entering the op was far below float16's max, so no
    overflow made the NaN and the scaler cannot cure it (sqrt at 0): NW305 at step 1."""
    raised = None
    try:
        _scaled_steps(1.0, 3, distance=True)
    except nanwatch.AnomalyError as e:
        raised = e
    assert raised is not None
    assert [d.code for d in raised.diagnoses][:1] == ["NW305"]
    assert "no scale makes a NaN" in " ".join(raised.diagnoses[0].evidence)


def test_a_cublas_failure_after_a_device_assert_is_advised_as_one() -> None:
    info = classify(
        RuntimeError(
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, "
            "opa, opb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`"
        )
    )
    assert info["class"] == "cuda-error" and info["device_lost"]
    assert "'Assertion ... failed'" in info["advice"]
    assert "class target outside [0, num_classes)" in info["advice"]


def test_a_node_whose_name_torch_refuses_is_named_by_its_class() -> None:
    class FreedBackward:
        def name(self) -> str:
            raise RuntimeError("Attribute 'name' is invalid for this instance")

    assert ops.name_of(FreedBackward()) == "FreedBackward"
    assert ops.name_of(torch.ones(1, requires_grad=True).exp().grad_fn) == "ExpBackward0"


def test_the_hooks_step_aside_while_a_cuda_graph_captures(monkeypatch: Any) -> None:
    """On an H100 the first forward under torch.cuda.graph began a step, whose flush read
    the last step's statistics: "operation not permitted when stream is capturing", and the
    user's capture failed. Simulated here by saying a capture runs for one step: nothing is
    hooked or read then (a NaN goes unseen, a guard stays quiet), a warning says so once,
    and the eager step after it is watched again."""
    import nanwatch.guards as guards_mod
    import nanwatch.watcher as watcher_mod

    capture = {"on": False}
    monkeypatch.setattr(watcher_mod, "capturing", lambda: capture["on"])
    monkeypatch.setattr(guards_mod, "_capturing", lambda: capture["on"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])

    def step(inputs: torch.Tensor, target: torch.Tensor, *, update: bool = True) -> None:
        criterion(model(inputs), target).backward()
        if update:
            opt.step()
        opt.zero_grad()

    with nanwatch.watch(model, criterion, postmortem=False) as nw:
        step(x, y)
        nw.step()
        capture["on"] = True
        with pytest.warns(RuntimeWarning, match="CUDA graph is being captured"):
            # a NaN would stop an eager step (no update here: a real capture runs no
            # kernel, this one would train on the NaN); a target of 7 of 3 classes reaches
            # torch's own check, not the guard (a GuardError says "target contains 7")
            step(torch.full_like(x, float("nan")), y, update=False)
            with pytest.raises(IndexError, match="Target 7 is out of bounds"):
                step(x, torch.tensor([0, 1, 2, 0, 7]), update=False)
            step(x, y, update=False)  # said once
        capture["on"] = False
        assert len(nw.history) == 1 and nw.trace.records == []  # nothing hooked or read
        with pytest.raises(nanwatch.AnomalyError, match="NaN"):
            step(torch.full_like(x, float("nan")), y)
            nw.step()
