"""A forward that wrote its own buffers in place, then read what an earlier call wrote there,
is module state (NW405), not a transient fault: a replay starts from what it wrote. A NaN
gradient born in the backward of a watched module with no watched children is pinpointed
by replaying that module's own backward, its freed input made again by its producer."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch


class _RunningScale(nn.Module):
    """Scales by 1 / a running variance that starts at 0: the first forward writes inf
    into ``inv_scale``, the second reads it, then overwrites it with a finite value."""

    def __init__(s, d: int = 3) -> None:
        super().__init__()
        s.register_buffer("inv_scale", torch.ones(d))
        s.register_buffer("var", torch.zeros(d))

    def forward(s, z: torch.Tensor) -> torch.Tensor:
        y = z * s.inv_scale.clone()  # not saved for backward: written below
        with torch.no_grad():
            s.inv_scale.copy_(1 / s.var)
            s.var.mul_(0.9).add_(z.var(0), alpha=0.1)
        return y


class _AE(nn.Module):
    def __init__(s) -> None:
        super().__init__()
        s.enc = nn.Linear(5, 3)
        s.vq = _RunningScale()
        s.dec = nn.Linear(3, 5)

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        return s.dec(s.vq(s.enc(x)))


def _run(model: nn.Module, steps: int, tmp_path: Any, **kw: Any) -> tuple[Any, str]:
    """Train ``steps`` steps (the forward writes the state; no update needed); the raised
    error's message, as the user reads it."""
    torch.manual_seed(0)
    msg = ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, report_dir=str(tmp_path), **kw) as nw:
            try:
                for _ in range(steps):
                    model(torch.randn(3, 5)).pow(2).mean().backward()
                    nw.step()
            except nanwatch.AnomalyError as err:
                msg = str(err)
    return nw, msg


def _trace(nw: Any) -> Any:
    return next(t for t in (nw._trace, *nw.history) if t.anomaly is nw.first_anomaly)


def _diagnosed(nw: Any) -> list[str]:
    return [d.code for d in _trace(nw).diagnoses]


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_forward_that_read_state_it_then_overwrote_is_not_transient(
    tmp_path: Any, mode: str
) -> None:
    torch.manual_seed(0)
    nw, msg = _run(_AE(), 3, tmp_path, mode=mode)
    a = nw.first_anomaly
    assert a is not None and a.step == 1, a
    assert not a.transient, a.summary
    codes = _diagnosed(nw)
    assert "NW404" not in codes and "NW405" in codes, (codes, a.summary)
    assert "in place" in msg and "inv_scale" in msg, msg
    assert "the replay started from the values it wrote" in msg
    assert "NW405" in msg and "Transient" not in msg
    note = next(n for n in _trace(nw).notes if n.kind == "module_state")
    assert note.data.get("overwritten") is True
    assert any(t["name"].endswith("inv_scale") for t in note.data["tensors"])


class _Flaky(nn.Module):
    """Holds a buffer it never writes, and makes an inf a replay does not reproduce (a
    one-off branch, as a hardware fault would be)."""

    def __init__(s) -> None:
        super().__init__()
        s.fc = nn.Linear(3, 3)
        s.register_buffer("calls", torch.zeros(()))

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        y = s.fc(x) * 2
        if not torch.jit.is_scripting() and getattr(s, "poison", False):
            s.poison = False
            y = y + float("inf")  # made by a Python-level branch the replay does not take
        return y


def test_a_clean_replay_of_a_module_that_writes_no_state_stays_transient(tmp_path: Any) -> None:
    # no buffer written in the forward: the old verdict stands
    m = nn.Sequential(nn.Linear(3, 3), _Flaky())
    m[1].poison = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, on_anomaly="warn", report_dir=str(tmp_path)) as nw:
            m(torch.randn(2, 3)).sum().backward()
    a = nw.first_anomaly
    assert a is not None and a.transient, a.summary if a else None
    assert "NW404" in _diagnosed(nw)


def test_running_statistics_a_training_forward_only_writes_are_not_read_state() -> None:
    # a norm in training mode normalizes with the batch's statistics and only updates its
    # running ones (on torches whose batch_norm bumps their version): those writes cannot
    # explain a clean replay; in eval mode the forward reads them
    from nanwatch.watcher import _read_state

    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    assert not _read_state(net, "1.running_mean") and not _read_state(net[1], "running_var")
    assert _read_state(net, "1.num_batches_tracked")
    net.eval()
    assert _read_state(net, "1.running_mean") and _read_state(net[1], "running_var")
    vq = nn.Module()
    vq.register_buffer("embed", torch.zeros(2))
    assert _read_state(vq, "embed")


class _SqrtVQ(nn.Module):
    """A leaf module (no children) whose own code takes sqrt of a distance that is 0 for the
    tokens its codebook was copied from: sqrt's backward at 0 is inf, times 0 is NaN."""

    def __init__(s, k: int = 4, d: int = 3) -> None:
        super().__init__()
        s.codebook = nn.Parameter(torch.randn(k, d))
        s.inited = False

    def forward(s, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not s.inited:
            with torch.no_grad():
                s.codebook.copy_(z[: s.codebook.shape[0]])
            s.inited = True
        dist = torch.sqrt(((z[:, None, :] - s.codebook[None]) ** 2).sum(-1))
        dmin, idx = dist.min(1)
        return z + (s.codebook[idx] - z).detach(), dmin.mean()


class _VQAE(nn.Module):
    def __init__(s) -> None:
        super().__init__()
        s.enc = nn.Linear(5, 3)
        s.vq = _SqrtVQ()
        s.dec = nn.Linear(3, 5)

    def forward(s, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, commit = s.vq(s.enc(x))
        return s.dec(q), commit


def test_a_leaf_modules_own_backward_is_pinpointed_in_watch_mode(tmp_path: Any) -> None:
    # vq's input (enc's output) was saved by no backward node: it is made again by enc
    torch.manual_seed(0)
    m = _VQAE()
    x = torch.randn(8, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(m, on_anomaly="warn", report_dir=str(tmp_path)) as nw:
            rec, commit = m(x)
            (F.mse_loss(rec, x) + 0.25 * commit).backward()
    a = nw.first_anomaly
    assert a is not None and a.path == "vq", a
    assert a.op is not None and "sqrt" in a.op.op, a.summary
    # the user's line in vq's forward, not the backward() call
    assert "in the backward of " in a.summary and "test_unseen_watcher8.py:" in a.summary, a.summary
    codes = _diagnosed(nw)
    assert codes[0] == "NW112", codes
