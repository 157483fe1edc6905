"""Watcher fixes found by user testing: a parametrization registered after attach is not
re-run by nanwatch (its leaf is watched instead), lazy modules can be watched before their
first forward, ``torch.jit.script`` and ``torch.jit.trace`` of a watched model work inside
the ``with`` block, and a gradient written in place after backward with NaN is blamed on
the code that wrote it, not on the optimizer."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm

import nanwatch
from tests._diagnoses import first_of, raises

torch.set_num_threads(1)


def _roles(nw: Any, phase: str) -> set[str]:
    return {r.role for t in nw.history for r in t.records if r.phase.name == phase}


# ------------------------------ 1: parametrizations registered after attach


class _Softplus(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return F.softplus(w)

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w.clamp_min(1e-4).expm1().log()


def _parametrized_run(mode: str | None) -> tuple[list[float], list[torch.Tensor], set[str]]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    torch.manual_seed(1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses: list[float] = []

    def loop(nw: Any) -> None:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for step in range(6):
            if step == 1:
                spectral_norm(m[0])
                orthogonal(m[2])
                opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            if step == 2:
                parametrize.register_parametrization(m[4], "weight", _Softplus())
                opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            if step == 4:
                parametrize.remove_parametrizations(m[4], "weight")
                opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if nw is not None:
                nw.step()

    roles: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the non-leaf .grad warning
        if mode is None:
            loop(None)
        else:
            with nanwatch.watch(m, mode=mode) as nw:  # type: ignore[arg-type]
                loop(nw)
            roles = _roles(nw, "GRADIENT")
    state = [t.detach().clone() for t in m.state_dict().values()]
    return losses, state, roles


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_parametrization_registered_after_attach_keeps_the_numbers_bit_for_bit(
    mode: str,
) -> None:
    ref_losses, ref_state, _ = _parametrized_run(None)
    losses, state, roles = _parametrized_run(mode)
    assert losses == ref_losses  # exact: no extra power iteration, no read of a property
    assert len(state) == len(ref_state)
    for a, b in zip(state, ref_state, strict=True):
        assert torch.equal(a, b)  # spectral_norm's _u/_v included
    # the leaves the optimizer steps are the ones watched
    assert "0.parametrizations.weight.original" in roles
    assert "2.parametrizations.weight.original" in roles


def test_a_nan_in_a_parametrized_leaf_is_found_on_the_leaf() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(8, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m) as nw:
        for step in range(3):
            if step == 1:
                spectral_norm(m[2])
            if step == 2:
                with torch.no_grad():
                    m[2].parametrizations.weight.original[0, 0] = float("nan")
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = first_of(info.value, "NW301")
    assert "2.parametrizations.weight.original" in d.title + "\n".join(d.evidence)


# ------------------------------ 2: lazy modules watched before their first forward


def _lazy_run(mode: str | None) -> tuple[list[float], set[str]]:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3)
    )
    x, y = torch.randn(4, 2, 6, 6), torch.randint(0, 3, (4,))
    losses: list[float] = []

    def loop(nw: Any) -> None:
        opt = None
        for _ in range(3):
            out = m(x)
            if opt is None:
                opt = torch.optim.SGD(m.parameters(), lr=0.1)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if nw is not None:
                nw.step()

    if mode is None:
        loop(None)
        return losses, set()
    with nanwatch.watch(m, mode=mode) as nw:  # type: ignore[arg-type]
        loop(nw)
    first = {r.role for r in nw.history[0].records if r.phase.name == "GRADIENT"}
    return losses, first


@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_lazy_modules_are_watched_once_their_first_forward_made_their_weights(mode: str) -> None:
    ref, _ = _lazy_run(None)
    losses, first_grads = _lazy_run(mode)
    assert losses == ref
    # the gradients of the first backward, right after the weights were made, are checked
    assert {"0.weight", "1.weight", "4.weight", "4.bias"} <= first_grads


# ------------------------------ 3, 4: torch.jit.script and torch.jit.trace inside the block


def _trained(mode: str) -> tuple[nn.Module, torch.Tensor, Any]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(6, 4)
    return m, x, nanwatch.watch(m, mode=mode)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["watch", "sentinel", "forensic"])
def test_a_watched_model_can_be_scripted_inside_the_block(mode: str) -> None:
    m, x, w = _trained(mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's own
        with w as nw:
            m(x).sum().backward()
            nw.step()
            scripted = torch.jit.script(m)
            assert torch.equal(scripted(x), m(x))
            # the model itself keeps its hooks: a NaN is still found after scripting
            with pytest.raises(nanwatch.AnomalyError):
                m(torch.full_like(x, float("nan"))).sum().backward()
                nw.step()


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_tracing_a_watched_model_records_no_read_of_nanwatch(mode: str) -> None:
    m, x, w = _trained(mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with w as nw:
            m(x).sum().backward()
            nw.step()
            traced = torch.jit.trace(m, x[:2])
            assert torch.equal(traced(x), m(x))
    tracer = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    assert not tracer, [str(w.message) for w in tracer[:2]]


# ------------------------------ 5: a gradient written in place after backward


def _agem(model: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in params])
        g_ref = torch.zeros_like(g)  # an empty episodic memory
        g = g - torch.dot(g, g_ref) / torch.dot(g_ref, g_ref) * g_ref  # 0/0
        off = 0
        for p in params:
            p.grad.copy_(g[off : off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()


@pytest.mark.parametrize(
    "mode",
    [
        "watch",
        pytest.param(
            "sentinel",
            marks=pytest.mark.accelerator_weaker(
                reason="read late, the gradients are read after the user's write: the NaN "
                "is blamed on backward, one step late"
            ),
        ),
    ],
)
def test_a_gradient_written_in_place_after_backward_is_blamed_on_that_code(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    err = raises(model, lambda: _agem(model), mode)
    d = first_of(err, "NW301")
    assert "step 0" in str(err).splitlines()[0]  # the same step in both modes
    assert "your code wrote after backward" in d.title
    assert "replaced after backward by your code" in "\n".join(d.evidence)
    assert "opt.state" not in d.fix  # not the optimizer's running state
    assert "opt.step()" in d.fix
    compile(d.fix, "<fix>", "exec")


def test_a_clipped_gradient_written_in_place_stays_silent() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    with nanwatch.watch(model) as nw:
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            nw.step()
    assert nw.first_anomaly is None
    assert not [n for t in nw.history for n in t.notes if n.kind == "grad_written"]
