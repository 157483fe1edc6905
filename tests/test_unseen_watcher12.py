"""Watch and sentinel name the backward of svd / eigh at repeated singular values or
eigenvalues behind a parameter's NaN gradient (the module's own backward is replayed for
a parameter-gradient anomaly), and watch() takes a list of modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import code_lines

torch.set_num_threads(1)


class _Polar(nn.Module):
    """The polar factor U @ Vh of a weight initialized at the identity: every singular
    value is 1, and svd's backward divides by s_i² - s_j² = 0."""

    def __init__(self, d: int, fix: str | None = None) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.eye(d))
        self.fix = fix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fix is not None:
            scope = {"torch": torch, "self": self}
            exec(self.fix, scope)  # the fix's line, in place of the one below
            U, Vh = scope["U"], scope["Vh"]
        else:
            U, _, Vh = torch.linalg.svd(self.A)
        return x @ (U @ Vh).T


class _Sqrtm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.M = nn.Parameter(torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = 0.5 * (self.M + self.M.T)
        w, V = torch.linalg.eigh(S)
        return x @ (V @ torch.diag(w.clamp_min(1e-6).sqrt()) @ V.T)


def _error(model: nn.Module, mode: str) -> nanwatch.AnomalyError:
    crit = nn.MSELoss()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, crit, mode=mode) as nw,
    ):
        crit(model(x), y).backward()
        nw.step()
    return info.value


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_svd_backward_at_repeated_singular_values_is_named(mode: str) -> None:
    model = nn.Sequential(nn.Linear(4, 6), _Polar(6), nn.Tanh(), nn.Linear(6, 1))
    err = _error(model, mode)
    d = err.diagnoses[0]
    assert d.code == "NW111", err
    assert d.title == "Backward of svd at repeated singular values"
    assert "LinalgSvdBackward0" in "\n".join(d.evidence)
    assert "1.A" in str(err)
    line = d.fix.splitlines()[0].split("   #")[0]
    assert line == "U, _, Vh = torch.linalg.svd(self.A + 1e-4 * torch.randn_like(self.A))"
    compile(code_lines(d.fix), "<fix>", "exec")
    # the fix's line in place of the user's: the gradients are finite
    fixed = nn.Sequential(nn.Linear(4, 6), _Polar(6, fix=line), nn.Tanh(), nn.Linear(6, 1))
    crit = nn.MSELoss()
    with nanwatch.watch(fixed, crit, mode=mode) as nw:
        crit(fixed(torch.randn(8, 4)), torch.randn(8, 1)).backward()
        nw.step()
    assert nw.first_anomaly is None
    assert all(torch.isfinite(p.grad).all() for p in fixed.parameters())


def test_eigh_backward_at_repeated_eigenvalues_is_named_in_watch_mode() -> None:
    model = nn.Sequential(nn.Linear(4, 5), _Sqrtm(5), nn.Linear(5, 1))
    err = _error(model, "watch")
    d = err.diagnoses[0]
    assert d.code == "NW111", err
    assert d.title == "Backward of eigh at repeated eigenvalues"
    assert "w, V = torch.linalg.eigh(S + 1e-4 * jitter)" in d.fix
    compile(code_lines(d.fix), "<fix>", "exec")


def test_watch_takes_a_list_of_modules() -> None:
    q, qt = nn.Linear(3, 2), nn.Linear(3, 2)
    with nanwatch.watch([q, qt], nn.MSELoss()) as nw:
        assert nw.roots[:2] == [q, qt] and len(nw.roots) == 3
        q(torch.randn(4, 3)).sum().backward()
        nw.step()
    with nanwatch.watch((q, qt)) as nw:
        assert nw.roots == [q, qt]
    with pytest.raises(nanwatch.ConfigError, match=r"takes nn\.Module objects; got int"):
        nanwatch.watch([q, 3])
    with pytest.raises(nanwatch.ConfigError, match="got dict"):
        nanwatch.watch({"q": q})  # type: ignore[arg-type]
