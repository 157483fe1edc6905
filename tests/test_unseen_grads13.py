"""NW301 for NaN made by the user's own optimizer code: gradient centralization's std of a
1-element weight (the fix leaves it out of the loop, never skips every step), a
hand-written optimizer's 0/0 at a zero norm (its step()'s line, guarded, not "clear the
state"), and SAM's perturbation divided by a gradient norm of 0."""

from __future__ import annotations

import ast
import importlib.util
import itertools
from pathlib import Path
from types import ModuleType

import pytest
import torch

import nanwatch
from tests._diagnoses import code_lines, text

torch.set_num_threads(1)

_counter = itertools.count()


def _load(tmp_path: Path, src: str) -> ModuleType:
    name = f"_grads13_{next(_counter)}"
    path = tmp_path / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _diagnose(mod: ModuleType) -> nanwatch.Diagnosis | None:
    """The NW301 diagnosis of ``mod.train`` run under watch; None when it runs clean."""
    torch.manual_seed(0)
    model = mod.make()
    try:
        with nanwatch.watch(model) as nw:
            mod.train(model, nw)
    except nanwatch.AnomalyError as e:
        return next(d for d in e.diagnoses if d.code == "NW301")
    return None


# ------------------------------ 1: gradient centralization over a 1-element weight

_GC = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor([2.0]))

    def forward(self, x):
        return self.fc(x) * self.scale


def make():
    return Net()


def train(model, nw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for _ in range(2):
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            g = p.grad
            p.grad.copy_((g - g.mean()) / g.std())
        opt.step()
        opt.zero_grad()
        nw.step()
"""


@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_std_of_a_one_element_weight_is_named_and_the_fix_leaves_it_out(tmp_path: Path) -> None:
    d = _diagnose(_load(tmp_path, _GC))
    assert d is not None
    t = text(d)
    assert "1 element" in t and "N - 1" in t and "g.std()" in t
    code = code_lines(d.fix)
    assert "p.numel() <= 1" in code and "continue" in code
    assert ".step()" not in code  # skipping every step is no fix for a NaN at every step
    # pasted first in the loop's body, the run is clean
    lines = _GC.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip() == "for p in model.parameters():")
    pasted = [ln for ln in d.fix.splitlines() if not ln.lstrip().startswith("#")]
    body = "\n".join(" " * 12 + ln for ln in pasted)
    fixed = "\n".join([*lines[: at + 1], body, *lines[at + 1 :]])
    ast.parse(fixed)
    assert _diagnose(_load(tmp_path, fixed)) is None


# ------------------------------ 2: a hand-written optimizer's 0/0 at a zero norm

_LAMB = """
import torch
from torch import nn


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                upd = p.grad.sign() * p.grad.abs().sqrt() + 0.01 * p
                w_norm = p.norm()
                u_norm = upd.norm()
                trust = w_norm / u_norm
                p.add_(upd, alpha=-g["lr"] * trust.item())


def make():
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    nn.init.zeros_(m[1].weight)  # zero-initialized head: its gradient is 0 too
    nn.init.zeros_(m[1].bias)
    return m


def train(model, nw):
    opt = Lamb(model.parameters())
    x = torch.randn(8, 4)
    for _ in range(2):
        (model(x) * 0.0).sum().backward()
        opt.step()
        opt.zero_grad()
        nw.step()
"""


def test_a_hand_written_optimizer_is_named_with_its_zero_norm_division(tmp_path: Path) -> None:
    d = _diagnose(_load(tmp_path, _LAMB))
    assert d is not None
    t = text(d)
    assert "Lamb" in d.title and "not torch.optim" in t
    assert "gradient norm 0" in t
    assert "trust = w_norm / u_norm" in t
    assert "s.clear()" not in d.fix and "load_state_dict" not in d.fix
    code = code_lines(d.fix)
    # a ratio of norms: 1 where either is 0 (LAMB's convention), not a clamp that gives 0
    assert (
        "trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, "
        "torch.ones_like(w_norm))" in code
    )
    ast.parse(code)
    fixed = _LAMB.replace("trust = w_norm / u_norm", code.strip())
    assert _diagnose(_load(tmp_path, fixed)) is None


_ROOT = """
import torch
from torch import nn


class RootOpt(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @staticmethod
    def inv_root(m):
        ev, q = torch.linalg.eigh(m)
        return q @ torch.diag(ev.pow(-1.0 / 4)) @ q.T

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None or p.dim() != 2:
                    continue
                gr = p.grad
                p.add_(RootOpt.inv_root(gr @ gr.T) @ gr, alpha=-g["lr"])


def make():
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False))


def train(model, nw):
    opt = RootOpt(model.parameters())
    x = torch.randn(8, 4)
    for _ in range(2):
        model(x)[:, 0].sum().backward()
        opt.step()
        opt.zero_grad()
        nw.step()
"""


def test_a_negative_power_in_a_helper_of_its_step_is_found_and_guarded(tmp_path: Path) -> None:
    d = _diagnose(_load(tmp_path, _ROOT))
    assert d is not None
    t = text(d)
    assert "RootOpt" in d.title and "negative power of 0" in t
    assert "s.clear()" not in d.fix
    assert "ev.clamp_min(1e-12).pow(-1.0 / 4)" in code_lines(d.fix)


# ------------------------------ 3: SAM's rho * g / ||g|| at a gradient of 0

_SAM = """
import torch
from torch import nn


def make():
    m = nn.Linear(3, 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[5.0, 0.0, 0.0]]))
        m.bias.zero_()
    return m


def train(model, nw):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    y = torch.tensor([1.0, -1.0])
    for _ in range(2):
        torch.clamp(1 - y * model(x).squeeze(1), min=0).mean().backward()  # hinge, 0
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            for p in model.parameters():
                p.add_(p.grad * (0.05 / norm))
        opt.zero_grad()
        torch.clamp(1 - y * model(x).squeeze(1), min=0).mean().backward()
        opt.step()
        opt.zero_grad()
        nw.step()
"""


def test_a_write_after_a_zero_gradient_norm_names_the_division_by_it(tmp_path: Path) -> None:
    d = _diagnose(_load(tmp_path, _SAM))
    assert d is not None
    t = text(d)
    assert "norm 0" in t and "0 / 0" in t and "SAM" in t
    assert "EMA" not in d.explanation
    assert "+ 1e-12" in d.fix
