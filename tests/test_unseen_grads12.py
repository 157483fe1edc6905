"""NW301 for a gradient written in place after backward (an A-GEM projection's
``p.grad.copy_(...)``): the line is found, worded as an in-place write, and the 0/0 of the
projection is named with a guard that ends it; in-place writes to ``.grad`` of every form
are read from the user's source."""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

import nanwatch
from nanwatch.rules.gradients import _grad_write

torch.set_num_threads(1)


# ------------------------------ 1: A-GEM writes a 0/0 projection into p.grad in place

_AGEM = """
import torch
import torch.nn.functional as F
from torch import nn


def train(model, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in params])
        g_ref = torch.zeros_like(g)  # an empty episodic memory
        ratio = torch.clamp(torch.dot(g, g_ref) / torch.dot(g_ref, g_ref), max=0.0)
        g = g - ratio * g_ref
        off = 0
        for p in params:
            p.grad.copy_(g[off : off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()
"""


def _load(tmp_path: Path, name: str, src: str) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_an_in_place_grad_write_is_named_with_the_projections_0_over_0(
    tmp_path: Path, mode: str
) -> None:
    mod = _load(tmp_path, f"agem_{mode}", _AGEM)
    model = _model()
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, mode=mode, postmortem=False),
    ):
        mod.train(model)
    (d,) = [d for d in info.value.diagnoses if d.code == "NW301"]
    ev = "\n".join(d.evidence)
    assert "in place" in ev and "a new tensor" not in ev
    assert "your code writes the gradient at" in ev and "p.grad.copy_(g[off" in ev
    assert "torch.dot(g, g_ref) / torch.dot(g_ref, g_ref)" in d.explanation
    assert "0/0 when g_ref is all zeros" in d.explanation
    fix = d.fix or ""
    assert "torch.dot(g_ref, g_ref).clamp_min(1e-12)" in fix and "opt.step()" in fix
    compile(fix, "<fix>", "exec")
    # the guarded line the fix gives, pasted over the user's: the run stays finite
    m = re.search(r"#   line (\d+): (.+)", fix)
    assert m is not None
    lines = _AGEM.splitlines()
    old = lines[int(m.group(1)) - 1]
    assert "torch.dot(g_ref, g_ref)" in old
    lines[int(m.group(1)) - 1] = old[: len(old) - len(old.lstrip())] + m.group(2)
    fixed = _load(tmp_path, f"agem_fixed_{mode}", "\n".join(lines) + "\n")
    model = _model()
    with nanwatch.watch(model, mode=mode, postmortem=False) as nw:
        fixed.train(model)
    assert not nw.anomalies


@pytest.mark.parametrize(
    ("stmt", "target", "divisor"),
    [
        ("p.grad.data = g / n", "p.grad", "n"),
        ("p.grad /= n", "p.grad", "n"),
        ("p.grad.div_(n)", "p.grad", "n"),
        ("p.grad[p.grad != 0] = g[p.grad != 0]", "p.grad", None),
        ("p.grad.mul_(g)", "p.grad", None),
    ],
)
def test_every_in_place_form_of_a_grad_write_is_read(
    tmp_path: Path, stmt: str, target: str, divisor: str | None
) -> None:
    src = textwrap.dedent(
        f"""
        def step(params, opt, g, n):
            for p in params:
                p.grad.zero_()
                {stmt}
            opt.step()
        """
    )
    path = tmp_path / "writes.py"
    path.write_text(src)
    gw = _grad_write(f"{path}:6")
    assert gw is not None and gw.in_place
    assert gw.code == stmt and gw.target == target and gw.where == f"{path}:5"
    assert gw.own_divisor == divisor


def test_a_new_tensor_assigned_to_grad_comes_before_an_in_place_clip(tmp_path: Path) -> None:
    src = "def step(p, opt, a, n):\n    p.grad.mul_(0.5)\n    p.grad = a / n\n    opt.step()\n"
    path = tmp_path / "both.py"
    path.write_text(src)
    gw = _grad_write(f"{path}:4")
    assert gw is not None and not gw.in_place and gw.code == "p.grad = a / n"
