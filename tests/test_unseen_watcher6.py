"""Normalizations with eps=0 are measured (0/0 is theirs to make), a numpy-scalar learning
rate is read, and a resumed watcher names weights that were non-finite at load as loaded."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.watcher import _ModInfo


def _preserves(m: nn.Module) -> bool:
    """Whether the watcher skips measuring ``m`` as unable to make a NaN of finite inputs."""
    return bool(_ModInfo("m", m, is_root=False, first_root=False).preserving)


def _first(nw: Any) -> Any:
    assert nw.anomalies, "no anomaly reported"
    return nw.anomalies[0]


def test_groupnorm_eps0_blamed_for_its_own_nan(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.GroupNorm(2, 8, eps=0.0),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    x = torch.randn(3, 3, 6, 6)
    x[1] = 0.0  # variance 0 and eps 0: 0/0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, on_anomaly="warn", report_dir=str(tmp_path)) as nw:
            model(x).sum().backward()
    a = _first(nw)
    assert a.path == "1", a.summary
    assert "GroupNorm" in a.summary and "AdaptiveAvgPool2d" not in a.summary


@pytest.mark.parametrize(
    ("module", "safe"),
    [
        (nn.LayerNorm(4), True),
        (nn.LayerNorm(4, eps=0.0), False),
        (nn.GroupNorm(2, 4, eps=0.0), False),
        (nn.BatchNorm1d(4, eps=0.0), False),
        (nn.BatchNorm2d(4), True),
        (nn.InstanceNorm2d(4, eps=0.0), False),
        (nn.LocalResponseNorm(2, k=0.0), False),
        (nn.LocalResponseNorm(2), True),
        (nn.Dropout(), True),
    ],
)
def test_norm_safety_follows_eps(module: nn.Module, safe: bool) -> None:
    assert _preserves(module) is safe


def test_rmsnorm_eps_zero_measured() -> None:
    if not hasattr(nn, "RMSNorm"):
        pytest.skip("no RMSNorm in this PyTorch")
    assert _preserves(nn.RMSNorm(4)) is True  # eps=None: the dtype's eps
    assert _preserves(nn.RMSNorm(4, eps=0.0)) is False


def test_numpy_lr_nan_is_a_learning_rate(tmp_path: Any) -> None:
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: np.float32(s) * np.float32("nan"))
    assert isinstance(opt.param_groups[0]["lr"], np.floating)
    assert math.isnan(float(opt.param_groups[0]["lr"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, on_anomaly="warn", report_dir=str(tmp_path)) as nw:
            for _ in range(3):
                model(torch.randn(5, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                nw.step()
    codes = [d.code for t in nw.history for d in t.diagnoses]
    assert "NW301" in codes
    msgs = [d.title for t in nw.history for d in t.diagnoses if d.code == "NW301"]
    assert any("learning rate" in m.lower() for m in msgs), msgs


def test_resumed_weights_nan_at_load_named_as_loaded(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch.watch(model, report_dir=str(tmp_path)) as nw1:
        for _ in range(2):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            nw1.step()
    state = nw1.state_dict()
    with torch.no_grad():  # the checkpoint the resumed run loads holds NaN weights
        model[0].weight.fill_(math.nan)
    nw2 = nanwatch.Watcher(
        [model], nanwatch.WatchConfig(on_anomaly="warn", report_dir=str(tmp_path))
    )
    nw2.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw2:
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            nw2.step()
    a = _first(nw2)
    assert "0.weight" in a.summary
    assert "loaded" in a.summary and "outside an optimizer step" not in a.summary, a.summary


def test_unmeasured_chain_named_as_a_range(tmp_path: Any) -> None:
    # an average pool overflows float32 (a sum of 3e38s), a Dropout passes it on: neither
    # is measured and the pool's output is freed, so which one made it cannot be replayed
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Dropout(0.1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4, 2),
    )
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(3e38)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, on_anomaly="warn", report_dir=str(tmp_path)) as nw:
            model(torch.randn(2, 3, 4, 4)).sum().backward()
    summary = _first(nw).summary
    assert "one of 1 (AdaptiveAvgPool2d), 2 (Dropout)" in summary, summary
    assert "finite output of 0 (Conv2d)" in summary
    assert "forensic" in summary


def test_warn_policy_under_warnings_as_errors_keeps_watching(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """on_anomaly='warn' with warnings turned into errors (a CI smoke test): the anomaly's
    warning goes to stderr; it is not read as nanwatch's own fault (an "internal error"
    that switched the hook off for the rest of the run)."""
    import warnings as _w

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with _w.catch_warnings():
        _w.simplefilter("error")
        with nanwatch.watch(model, on_anomaly="warn", postmortem=False) as nw:
            for step in range(4):
                x = torch.randn(3, 4)
                if step in (1, 3):
                    x[0, 0] = float("nan")
                model(x).sum().backward()
                nw.step()
    err = capsys.readouterr().err
    assert "internal error" not in err and "disabled" not in err
    assert "step 1: NaN in the input data" in err  # the warning itself, on stderr
    bad = [t.step for t in (*nw.history, nw.trace) if t.anomaly is not None]
    assert 1 in bad and 3 in bad
