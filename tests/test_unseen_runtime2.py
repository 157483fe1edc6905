"""Runtime and generic fixes found by user testing: BatchNorm running statistics that a
skipped NaN batch poisoned are traced to that batch's training forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import text

torch.set_num_threads(1)


# ------------------------------ 1: running statistics poisoned by a skipped NaN batch


def _bn_run(mode: str, *, check_first: bool = False) -> tuple[nn.Module, list[nanwatch.Diagnosis]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    )
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(4, 3, 4, 4) for _ in range(4)]
    ys = [torch.randint(0, 3, (4,)) for _ in range(4)]
    xs[1][2, 0, 1, 1] = float("nan")
    with nanwatch.watch(model, crit, mode=mode, on_anomaly="record") as nw:
        for x, y in zip(xs, ys, strict=True):
            if check_first and not torch.isfinite(x).all():
                continue
            loss = crit(model(x), y)
            if not torch.isfinite(loss):  # the usual guard: too late for BatchNorm
                opt.zero_grad()
                continue
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 3, 4, 4))
    return model, list(nw.report.diagnoses)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_running_stats_poisoned_by_a_skipped_batch_name_its_training_forward(mode: str) -> None:
    model, found = _bn_run(mode)
    codes = [d.code for d in found]
    assert codes.index("NW401") < codes.index("NW405")  # the cause first
    d = found[codes.index("NW405")]
    t = text(d)
    assert "written outside the forward" not in t
    assert "step 1 (NW401)" in t and "training forward" in t
    assert "skipping that batch's backward" in d.explanation
    assert "if not torch.isfinite(x).all(): continue" in d.fix
    # the fix: a loop body that checks the batch, then the reset of every norm
    body, _, reset = d.fix.partition("continue")
    compile(
        "for x in []:\n" + "\n".join("    " + ln for ln in body.splitlines()) + "continue",
        "f",
        "exec",
    )
    assert not torch.isfinite(model[1].running_mean).all()
    exec(reset, {"model": model, "torch": torch})
    assert torch.isfinite(model[1].running_mean).all()
    # the check before the forward keeps them clean
    model, _ = _bn_run(mode, check_first=True)
    assert torch.isfinite(model[1].running_mean).all()


# ------------------------------ 2: a hidden overflow in every module of a class: one fix


class _RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.fc, self.ln2 = _RMSNorm(8), nn.Linear(8, 8), _RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        return self.ln2(x + self.fc(h))


def _hidden(model: nn.Module) -> list[nanwatch.Diagnosis]:
    x = torch.randn(2, 8)
    x[0, 3] = 400.0  # 400 ** 2 > 65504: x.pow(2) is inf in float16, rsqrt(inf) = 0
    x = x.half()
    with nanwatch.watch(model, mode="forensic", on_anomaly="record") as nw:
        model(x).float().sum().backward()
        nw.step()
    return [d for d in nw.report.diagnoses if d.code == "NW105"]


def test_a_hidden_overflow_in_every_module_of_a_class_lists_them_and_fixes_the_class() -> None:
    torch.manual_seed(0)
    model = _Net().half()
    (d,) = _hidden(model)
    assert "ln1, ln2 (each a _RMSNorm)" in d.evidence[0]
    assert "type(sub).__name__ == '_RMSNorm'" in d.fix
    exec(d.fix, {"model": model, "torch": torch})  # the pasted fix: every _RMSNorm at once
    try:
        assert _hidden(model) == []
    finally:
        for m in model.modules():
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()


# ------------------------------ 3: the pinned op, not the last autograd node, is "by"


def test_a_value_computed_between_roots_names_the_pinned_op_not_the_last_node() -> None:
    gen, crit = nn.Linear(2, 12), nn.MSELoss()
    with torch.no_grad():
        gen.weight.zero_()
        gen.bias[:4].zero_()  # the first generated row is all 0

    def run() -> None:
        w = gen(torch.ones(2)).view(3, 4)
        w = w / w.norm(dim=1, keepdim=True)  # 0 / 0 in the user's code, between the roots
        crit(torch.ones(5, 4) @ w.t(), torch.zeros(5, 3)).backward()

    with nanwatch.watch(gen, crit, mode="watch", on_anomaly="record") as nw:
        run()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.op is not None and "div" in a.op.op
    assert "by MmBackward0" not in a.summary
    assert "(last op MmBackward0)" in a.summary and "[op aten.div" in a.summary
