"""Post-mortems of exceptions raised inside an optimizer's step (found on unseen models):
told from one raised after the step, and a shape mismatch of the optimizer's state (a
checkpoint of another architecture loaded with load_state_dict) named as such."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.postmortem import ADVICE, classify
from nanwatch.render import render_text
from nanwatch.report import Report


def _mlp(hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def _stepped_adam_state(hidden: int) -> dict[str, object]:
    """The optimizer checkpoint of a smaller model, after one step (exp_avg etc. exist)."""
    old = _mlp(hidden)
    opt = torch.optim.Adam(old.parameters())
    old(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    return opt.state_dict()


def _report(report_dir: Path) -> Report:
    (path,) = report_dir.glob("*.json")
    return Report.load(path)  # what `nanwatch report` reads back


def test_shape_mismatch_inside_adam_step_names_the_loaded_optimizer_state(
    report_dir: Path,
) -> None:
    """Adam's state from a model with hidden size 16 loaded into one with 32: the report said
    'after the optimizer step' and 'the module still running raised' (none was)."""
    torch.manual_seed(0)
    model, crit = _mlp(32), nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(_stepped_adam_state(16))
    x = torch.randn(16, 8)
    y = x.sum(1, keepdim=True)
    with (
        pytest.raises(RuntimeError, match="must match the size"),
        nanwatch.watch(model, crit, report_dir=str(report_dir)),
    ):
        loss = crit(model(x), y)
        loss.backward()
        optimizer.step()
    report = _report(report_dir)
    assert report.error is not None
    assert "inside Adam.step(), step 0" in report.headline
    assert "after the optimizer step" not in report.headline
    advice = report.error["advice"]
    assert advice.startswith("Adam.step() raised, not a module")
    assert "0.weight is [32, 8], its exp_avg is [16, 8]" in advice
    assert "3 of 4 parameters differ" in advice  # the output bias [1] has its shape
    assert "load_state_dict" in advice and "different architecture" in advice
    assert "still running" not in advice
    assert advice.endswith("optimizer.state.clear()")  # the user's name for it
    page = render_text(report, width=200)
    assert "optimizer.state.clear()" in page
    # the modules listed had all finished before the step raised: not "the last that ran"
    assert "Modules that ran before Adam.step() (all finished)" in page
    assert "Last modules that ran" not in page
    # the fix, pasted: the next step runs and the state has the weights' shapes
    exec(advice.rsplit(": ", 1)[1], {"optimizer": optimizer})
    crit(model(x), y).backward()
    optimizer.step()
    assert optimizer.state[model[0].weight]["exp_avg"].shape == model[0].weight.shape


def test_optimizer_state_mismatch_is_found_without_touching_a_tensor(report_dir: Path) -> None:
    """The post-mortem must work after a dead CUDA context: shapes are metadata only."""
    from tests.test_postmortem import NoTensorOps

    model = _mlp(32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    old = _mlp(16)
    old_opt = torch.optim.SGD(old.parameters(), lr=0.1, momentum=0.9)
    old(torch.randn(4, 8)).sum().backward()
    old_opt.step()
    opt.load_state_dict(old_opt.state_dict())
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError) as caught:
        opt.step()
    with NoTensorOps() as forbid:
        forbid.armed = True
        info = classify(caught.value, {id(model[2].weight): "head.weight"})
        forbid.armed = False
    assert forbid.violations == []
    assert info["optimizer"]["class"] == "SGD" and info["optimizer"]["variable"] == "opt"
    assert "its momentum_buffer is" in info["advice"] and "opt.state.clear()" in info["advice"]
    rows = {r["param"]: r for r in info["optimizer"]["mismatch"]}
    assert rows["head.weight"]["state_shape"] == [1, 16]  # named by the watcher's names
    assert "param_groups[0]['params'][0]" in rows  # and by position without one


def test_an_error_after_a_completed_step_keeps_its_text(report_dir: Path) -> None:
    """The healthy twin: the update finished, the user's own code raised after it."""
    model = _mlp(4)
    opt = torch.optim.Adam(model.parameters())
    with (
        pytest.raises(RuntimeError, match="must match the size"),
        nanwatch.watch(model, report_dir=str(report_dir)),
    ):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        _ = torch.ones(5) + torch.ones(3)
    report = _report(report_dir)
    assert report.error is not None and "optimizer" not in report.error
    assert "after the optimizer step, step 0" in report.headline
    assert report.error["advice"] == ADVICE["shape-mismatch"]


def test_an_error_in_the_closure_of_a_step_is_not_blamed_on_the_state(report_dir: Path) -> None:
    """LBFGS evaluates the closure (forward and backward) inside step(): a shape error
    there is the closure's, not the optimizer state's; its text stays as it was."""
    model = _mlp(4)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x = torch.randn(5, 8)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x) + torch.ones(7, 3)).sum()
        loss.backward()
        return loss

    with (
        pytest.raises(RuntimeError, match="must match the size"),
        nanwatch.watch(model, report_dir=str(report_dir)),
    ):
        opt.step(closure)
    report = _report(report_dir)
    assert report.error is not None and report.error["optimizer"]["in_closure"]
    assert "after the forward of" in report.headline and "inside" not in report.headline
    assert report.error["advice"] == ADVICE["shape-mismatch"]  # the modules are the lead


def test_a_reduced_state_factor_is_not_a_mismatch() -> None:
    """Adafactor keeps [rows, 1] and [1, cols] factors of a weight's variance: not another
    model's shapes."""
    adafactor = getattr(torch.optim, "Adafactor", None)
    if adafactor is None:
        pytest.skip("torch.optim.Adafactor came in torch 2.5")
    model = _mlp(4)
    opt = adafactor(model.parameters())
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    from nanwatch.postmortem import _state_mismatches

    assert _state_mismatches(opt, {}) == {}


def test_an_error_after_the_closures_backward_is_not_after_the_step(report_dir: Path) -> None:
    """The closure's backward had ended when it raised: the update had not happened yet,
    so 'after the optimizer step' was wrong."""
    model = _mlp(4)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x = torch.randn(5, 8)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        seen = loss.detach().expand(5) + torch.ones(3)  # the user's own bookkeeping, wrong
        assert seen.numel() == 5
        return loss

    with (
        pytest.raises(RuntimeError, match="must match the size"),
        nanwatch.watch(model, report_dir=str(report_dir)),
    ):
        opt.step(closure)
    report = _report(report_dir)
    assert "in the closure of LBFGS.step(), step 0" in report.headline
    assert report.error is not None and report.error["advice"] == ADVICE["shape-mismatch"]
