"""A module's output gradient that spikes while the update does not move is no exploding
gradient (NW303); a weight written non-finite by a data-dependent init in the model's own
forward (ActNorm) is named as such, with the op and line that wrote it (NW301)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.rules.base import Diagnosis

torch.set_num_threads(1)


def _diags(nw: Any, code: str) -> list[Diagnosis]:
    return [d for t in nw.history for d in t.diagnoses if d.code == code]


# ---------------------------------------------------------------- NW303


class _User(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 16, mode="mean", padding_idx=0)
        self.mlp = nn.Linear(16, 16, bias=False)

    def forward(self, hist: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.mlp(self.bag(hist)), dim=-1)


class _TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = _User()
        self.item = nn.Embedding(100, 16)

    def forward(self, hist: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.user(hist) @ F.normalize(self.item(pos), dim=-1).T / 0.05


def test_f_normalize_of_an_all_padding_row_is_no_exploding_gradient() -> None:
    """A cold-start user whose history is all padding: F.normalize's gradient at the zero
    row is 1/eps times the upstream one, but the row's input is 0, so no parameter's
    gradient moves. It was NW303 'Exploding gradients' with clip_grad_norm_ as the fix."""
    torch.manual_seed(0)
    model = _TwoTower()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    norms = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, postmortem=False) as nw:
            for it in range(6):
                hist = torch.randint(1, 100, (32, 5))
                if it == 4:
                    hist[3] = 0  # all padding
                logits = model(hist, torch.randint(1, 100, (32,)))
                loss = F.cross_entropy(logits, torch.arange(32))
                opt.zero_grad()
                loss.backward()
                norms.append([p.grad.norm().item() for p in model.parameters()])
                opt.step()
                nw.step()
    # the step's update is as large as the others: nothing to clip
    assert max(n[0] for n in norms) < 2 * min(n[0] for n in norms)
    assert not _diags(nw, "NW303")


class _ZeroOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = nn.Linear(2, 2).requires_grad_(False)  # frozen preprocessing
        self.body = nn.Sequential(nn.Linear(2, 64), nn.Softplus(), nn.Linear(64, 64), nn.Softplus())
        self.out = nn.Linear(64, 2)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.feat(x)))


def test_an_output_gradient_growing_from_a_zero_init_is_no_exploding_gradient() -> None:
    """Sliced score matching with a zero-initialized output layer: the model's output
    gradient grows smoothly from exactly 0 to 14 times its median while the total norm
    stays level. It was NW303."""
    torch.manual_seed(0)
    score = _ZeroOut()
    opt = torch.optim.Adam(score.parameters(), lr=1e-3)
    data = torch.randn(2048, 2) @ torch.tensor([[1.0, 0.8], [0.0, 0.6]])
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(score, postmortem=False) as nw:
            for _ in range(25):
                x = data[torch.randint(0, 2048, (128,), generator=g)].requires_grad_(True)
                v = torch.randn(x.shape, generator=g)
                s = score(x)
                gsv = torch.autograd.grad((s * v).sum(), x, create_graph=True)[0]
                loss = ((gsv * v).sum(-1) + 0.5 * (s**2).sum(-1)).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    assert not _diags(nw, "NW303")


def test_a_real_explosion_still_warns_with_the_parameter_named() -> None:
    """The learning rate jumps 300 times at step 8: every gradient grows; NW303 names the
    parameter and module from the step the update moved."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, postmortem=False, on_anomaly="warn") as nw:
            for i in range(14):
                x = torch.randn(32, 8)
                loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
                opt.zero_grad()
                loss.backward()
                opt.step()
                if i == 8:
                    opt.param_groups[0]["lr"] = 3.0
                nw.step()
    found = _diags(nw, "NW303")
    assert found and found[0].parameter is not None
    assert "clip_grad_norm_" in found[0].fix


# ---------------------------------------------------------------- NW301


class _ActNorm(nn.Module):
    def __init__(self, c: int, eps: float) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.logs = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.eps = eps
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    @torch.no_grad()
    def initialize(self, x: torch.Tensor) -> None:
        std = x.std(dim=(0, 2, 3), keepdim=True)
        self.loc.data.copy_(-x.mean(dim=(0, 2, 3), keepdim=True))
        self.logs.data.copy_(torch.log(1.0 / (std + self.eps)))
        self.initialized.fill_(1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.initialized.item() == 0:
            self.initialize(x)
        return (x + self.loc) * torch.exp(self.logs), self.logs.sum()


class _Flow(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.an = _ActNorm(4, eps)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, logdet = self.an(x)
        return self.conv(y), logdet


#: the line of _ActNorm.initialize that writes logs
_LOGS_LINE = next(
    i
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if "self.logs.data.copy_(torch.log" in line and "if" not in line
)


def _actnorm_run(mode: str, eps: float) -> Any:
    torch.manual_seed(0)
    model = _Flow(eps)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(model, mode=mode, postmortem=False, on_anomaly="warn") as nw:
            for _ in range(3):
                x = torch.rand(16, 4, 8, 8) - 0.5
                x[:, 3] = 0.5  # an opaque alpha channel: constant in the first batch
                z, logdet = model(x)
                loss = 0.5 * (z**2).mean() - logdet / 256
                loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
    return nw


def test_actnorm_init_writing_inf_is_named_with_its_op_and_line() -> None:
    """ActNorm's data-dependent init sets logs = log(1 / std) with std = 0 on a constant
    channel. It was 'written outside an optimizer step' with an assert after EMA updates
    and loads as the fix; forensic records the reciprocal that made the inf on that line."""
    d = _diags(_actnorm_run("forensic", 0.0), "NW301")[0]
    assert d.title == "Non-finite weights written in the model's forward"
    assert d.parameter == "an.logs" and d.path == "an"
    assert d.source is not None and d.source.endswith(f"test_unseen_grads4.py:{_LOGS_LINE}")
    text = " ".join(d.evidence)
    assert "aten.reciprocal" in text and "self.logs.data.copy_" in text
    assert "add an eps to the divisor" in d.fix
    assert "assert torch.isfinite(self.logs).all()" in d.fix


def test_actnorm_init_writing_inf_in_watch_mode_lists_a_write_in_the_forward() -> None:
    """Without the op (watch mode records no ops) the writers listed include the model's
    own forward: it listed only EMA, load, pruning and tied weights."""
    d = _diags(_actnorm_run("watch", 0.0), "NW301")[0]
    assert d.title == "Non-finite weights written outside an optimizer step"
    assert "a write in the model's own forward (a data-dependent init)" in d.explanation


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_actnorm_init_with_an_eps_is_silent(mode: str) -> None:
    nw = _actnorm_run(mode, 1e-6)
    assert not nw.anomalies
    assert not _diags(nw, "NW301")
