"""Post-mortem advice for two autograd errors of a training loop's backward():

- "backward through the graph a second time" raised by a second backward() of the same
  step: the same loss differentiated twice, or a second loss that reaches the graph the
  first one freed, is named with both lines (a tensor carried over from an earlier step,
  with one backward a step, keeps the detach advice: tests/test_postmortem_advice2.py);
- "element 0 of tensors does not require grad": frozen weights, a forward run under
  no_grad, and a graph cut between the model's output and the loss are told apart from
  the weights' requires_grad and the records of the model's output.

Each error reaches the user unchanged; the report's advice is what changes."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.postmortem import classify
from nanwatch.report import Report


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _advice(
    tmp_path: Path, mode: str, step: Callable[[nn.Module, int], None], match: str
) -> dict[str, object]:
    """Run ``step`` for three steps under watch; the error it raises, unchanged, and the
    post-mortem's error section."""
    torch.manual_seed(0)
    model = _Net()
    with (
        pytest.raises(RuntimeError, match=match) as info,
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)) as nw,
    ):
        for i in range(3):
            step(model, i)
            nw.step()
    assert type(info.value) is RuntimeError  # the user's error, not nanwatch's
    (path,) = sorted(tmp_path.glob("*.json"))
    error = Report.load(path).error
    assert error is not None and error["message"] == str(info.value)
    return error


def _line_of(fn: Callable[..., object], text: str) -> str:
    """``test_postmortem_backward.py:N``: the line of ``fn`` holding ``text``."""
    lines, start = inspect.getsourcelines(fn)
    (n,) = [start + i for i, line in enumerate(lines) if text in line]
    return f"test_postmortem_backward.py:{n}"


_X, _Y = torch.randn(16, 8), torch.randint(0, 3, (16,))

MODES = ["watch", "sentinel", "forensic"]


@pytest.mark.parametrize("mode", MODES)
def test_the_same_loss_differentiated_twice_names_both_lines(tmp_path: Path, mode: str) -> None:
    def step(model: nn.Module, i: int) -> None:
        loss = F.cross_entropy(model(_X), _Y)
        loss.backward()  # first
        if i == 1:
            loss.backward()  # second

    error = _advice(tmp_path, mode, step, "backward through the graph a second time")
    assert error["class"] == "graph-freed"
    advice = str(error["advice"])
    assert advice.startswith("backward() ran twice on the same tensor in step 1")
    first, second = _line_of(step, "# first"), _line_of(step, "# second")
    assert re.search(rf"at \S*{first}, then at \S*{second}\. ", advice), advice
    assert "retain_graph=True to the first" in advice
    assert "hidden.detach()" not in advice  # not the carried-over story


@pytest.mark.parametrize("mode", MODES)
def test_a_second_loss_through_the_freed_forward_names_both_backwards(
    tmp_path: Path, mode: str
) -> None:
    def step(model: nn.Module, i: int) -> None:
        out = model(_X)
        main = F.cross_entropy(out, _Y)
        aux = out.pow(2).mean()
        main.backward()  # main loss
        aux.backward()  # auxiliary loss

    error = _advice(tmp_path, mode, step, "backward through the graph a second time")
    advice = str(error["advice"])
    main, aux = _line_of(step, "# main loss"), _line_of(step, "# auxiliary loss")
    assert re.match(rf"The backward\(\) at \S*{aux} reached a part of the graph", advice), advice
    assert re.search(rf"the one at \S*{main} in step 0", advice), advice
    assert "(loss_a + loss_b).backward()" in advice


def test_the_advice_for_two_losses_works() -> None:
    """The fix the advice gives (one backward of the sum) runs, with nothing to report."""
    torch.manual_seed(0)
    model = _Net()
    with nanwatch.watch(model) as nw:
        for _ in range(3):
            out = model(_X)
            (F.cross_entropy(out, _Y) + out.pow(2).mean()).backward()
            nw.step()
    assert nw.report.diagnoses == [] and nw.report.error is None


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_under_no_grad_is_named(tmp_path: Path, mode: str) -> None:
    def step(model: nn.Module, i: int) -> None:
        with torch.no_grad():
            out = model(_X)
        F.cross_entropy(out, _Y).backward()

    error = _advice(tmp_path, mode, step, "does not require grad")
    assert error["class"] == "no-graph"
    advice = str(error["advice"])
    assert advice.startswith("_Net's output in step 0 has no autograd graph"), advice
    assert "torch.no_grad() or torch.inference_mode()" in advice


@pytest.mark.parametrize("mode", MODES)
def test_a_graph_cut_before_the_loss_is_named(tmp_path: Path, mode: str) -> None:
    def step(model: nn.Module, i: int) -> None:
        out = model(_X).detach()  # a cut the user did not mean
        F.cross_entropy(out, _Y).backward()

    error = _advice(tmp_path, mode, step, "does not require grad")
    advice = str(error["advice"])
    assert advice.startswith("_Net's output in step 0 has a graph (AddmmBackward0)"), advice
    assert "cut it between the model's output and the loss" in advice


@pytest.mark.parametrize("mode", MODES)
def test_frozen_weights_are_named(tmp_path: Path, mode: str) -> None:
    def step(model: nn.Module, i: int) -> None:
        if i == 0:
            model.requires_grad_(False)  # frozen for fine-tuning, head never unfrozen
        F.cross_entropy(model(_X), _Y).backward()

    error = _advice(tmp_path, mode, step, "does not require grad")
    advice = str(error["advice"])
    assert advice.startswith("None of the 4 watched weights requires grad"), advice


def test_the_class_is_told_from_the_message_alone() -> None:
    x = torch.ones(2)
    with pytest.raises(RuntimeError) as info:
        x.sum().backward()
    found = classify(info.value)
    assert found["class"] == "no-graph"
    assert "print(loss.grad_fn)" in found["advice"]
