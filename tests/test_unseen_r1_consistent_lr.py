"""One run, one learning rate: an LSTM forecaster on an unscaled series (values ~1e3),
SGD at lr 5 with no clipping. A warning early in the run (an oversized update) sizes the
lr it asks for from the update it measured; the overflow a few steps later only divides
the lr by 10. The error must not ask for a higher lr than the run's warning already did
for the same optimizer and lr: it asks for the lower one, and says which diagnosis did."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import StepTrace
from nanwatch.rules.base import Diagnosis, _no_higher_lr

torch.set_num_threads(1)

_LR = re.compile(r"""\["lr"\] = ([\d.e+-]+)\s+# was 5 \(SGD\)""")


class _Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(1, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _series() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = torch.arange(0, 2000, dtype=torch.float32)
    s = 1000 + 300 * torch.sin(t / 20) + 50 * torch.randn(2000, generator=g)
    x = torch.stack([s[i : i + 24] for i in range(0, 1900, 5)]).unsqueeze(-1)
    y = torch.stack([s[i + 24] for i in range(0, 1900, 5)]).unsqueeze(-1)
    return x, y


@pytest.mark.parametrize("mode", ["sentinel", "watch", "forensic"])
def test_the_overflow_asks_for_no_higher_lr_than_the_earlier_warning(mode: str) -> None:
    torch.manual_seed(0)
    model = _Forecaster()
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    xs, ys = _series()
    g = torch.Generator().manual_seed(2)
    nw = nanwatch.watch(model, mode=mode)  # type: ignore[arg-type]
    with pytest.raises(nanwatch.AnomalyError) as info, nw:
        for _ in range(60):
            idx = torch.randint(0, len(xs), (32,), generator=g)
            loss = nn.functional.mse_loss(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    warned = [
        (t.step, d.code, float(m.group(1)))
        for t in nw.history
        for d in t.diagnoses
        if d.severity == "warning"
        for m in _LR.finditer(d.fix)
    ]
    assert warned, "the run's warnings asked for no lr"
    step, code, asked = min(warned, key=lambda w: w[2])
    errors = [d for d in info.value.diagnoses if d.severity == "error" and _LR.search(d.fix)]
    assert errors
    for d in errors:
        line = next(ln for ln in d.fix.splitlines() if _LR.search(ln))
        m = _LR.search(line)
        assert m is not None and float(m.group(1)) <= asked, line
        if float(m.group(1)) == asked:
            assert f"the {code} warning of step {step} asked for" in line


def _with(fix: str, step: int = 1, code: str = "NW308") -> list[StepTrace]:
    t = StepTrace(step=step)
    t.diagnoses = [Diagnosis(code, "t", "warning", fix=fix)]
    return [t]


def test_a_lower_lr_of_a_warning_replaces_a_tenth() -> None:
    hist = _with('opt.param_groups[0]["lr"] = 2e-4   # was 5 (SGD): its update was 40×')
    got = _no_higher_lr('for g in opt.param_groups: g["lr"] = 0.5   # was 5 (SGD)', hist)
    assert got == (
        'for g in opt.param_groups: g["lr"] = 2e-4   # was 5 (SGD); not 0.5: the NW308 '
        "warning of step 1 asked for 2e-4 already, the lower of the two"
    )


@pytest.mark.parametrize(
    "earlier",
    [
        'opt.param_groups[0]["lr"] = 0.9   # was 5 (SGD)',  # higher: the error's stands
        'opt.param_groups[0]["lr"] = 1e-4   # was 1 (SGD)',  # another lr, since changed
        'opt.param_groups[0]["lr"] = 1e-4   # was 5 (Adam)',  # another optimizer
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)",
    ],
)
def test_the_fix_is_kept_unless_the_same_lr_was_asked_lower(earlier: str) -> None:
    fix = 'for g in opt.param_groups: g["lr"] = 0.5   # was 5 (SGD)\n# and clip'
    assert _no_higher_lr(fix, _with(earlier)) == fix
    assert _no_higher_lr(fix, []) == fix
