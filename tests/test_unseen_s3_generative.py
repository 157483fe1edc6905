"""Generative training (VAEs, diffusion models), each run in sentinel, watch and forensic:

- a VAE's KL annealing weight ``beta = torch.clamp(step / warmup_steps, max=1.0)`` with a
  warmup of 0 steps: at step 0 it is 0/0 = NaN. Sentinel and watch said "a single value,
  NaN: most likely a batch of one sample, whose std() or var() is NaN" with a std fix; the
  statement that made beta (known from the frame that called backward()) holds a division
  and no std: it is 0/0 there, and the fix guards that division in the user's line;
- a diffusion UNet block calling ``F.group_norm(x, 32)`` on 48 channels: the post-mortem
  said only "The last modules that ran before the exception are listed"; it now says
  which counts of groups divide the channels and ``math.gcd(32, channels)``;
- timesteps drawn by ``torch.randint(0, T + 1, ...)`` indexing a schedule of T entries: the
  post-mortem guessed "Ids that start at 1 need t - 1" when the draw's smallest value
  happened to be 1; it now names the randint statement and its exclusive high bound.

Each has a healthy control: the fixed code trains clean."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.postmortem import classify
from tests._diagnoses import first_of, text

torch.set_num_threads(1)

MODES = ["sentinel", "watch", "forensic"]
T = 50


# ------------------------------------------ 1: KL annealing weight 0/0 at a warmup of 0


class _VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.mu = nn.Linear(16, 2)
        self.logvar = nn.Linear(16, 2)
        self.dec = nn.Linear(2, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


def _train_vae(model: _VAE, warmup_steps: torch.Tensor, steps: int = 3) -> None:
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for step in range(steps):
        x = torch.rand(16, 8)
        recon, mu, logvar = model(x)
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        beta = torch.clamp(step / warmup_steps, max=1.0)
        loss = F.mse_loss(recon, x) + beta * kl
        opt.zero_grad()
        loss.backward()
        opt.step()


def _vae_error(mode: str) -> nanwatch.AnomalyError:
    torch.manual_seed(0)
    model = _VAE()
    try:
        with nanwatch.watch(model, mode=mode):  # type: ignore[arg-type]
            _train_vae(model, torch.tensor(0.0))
    except nanwatch.AnomalyError as e:
        return e
    raise AssertionError("no anomaly")


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_single_nan_weight_made_by_a_division_is_told_as_0_over_0_not_a_batch_of_one(
    mode: str,
) -> None:
    d = first_of(_vae_error(mode), "NW100")
    said = text(d)
    assert "beta was made by `beta = torch.clamp(step / warmup_steps, max=1.0)`" in said
    assert "is 0/0, so warmup_steps was 0" in said
    assert "batch of one" not in said and "std" not in d.fix
    assert "warmup_steps was 0: set it to at least 1" in d.fix
    fixed = next(ln for ln in d.fix.splitlines() if ln.startswith("beta = "))
    code = fixed.split("   #")[0]
    scope = {"torch": torch, "step": 0, "warmup_steps": torch.tensor(0.0)}
    exec(code, scope)
    assert torch.isfinite(scope["beta"]).all()
    scope = {"torch": torch, "step": 5, "warmup_steps": torch.tensor(10.0)}
    exec(code, scope)
    assert float(scope["beta"]) == 0.5  # unchanged where the warmup is not 0


def test_forensic_names_the_division_of_the_warmup_line() -> None:
    d = first_of(_vae_error("forensic"), "NW111")
    assert d.source is not None and "warmup_steps" in text(d)
    assert "batch of one" not in text(d)


@pytest.mark.parametrize("mode", MODES)
def test_the_vae_with_a_nonzero_warmup_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    model = _VAE()
    with nanwatch.watch(model, mode=mode) as nw:  # type: ignore[arg-type]
        _train_vae(model, torch.tensor(10.0))
    assert all(t.anomaly is None for t in nw.history)


def test_a_single_nan_over_a_std_of_one_value_still_says_a_batch_of_one() -> None:
    """The statement is read: a std there (or in the denominator's own statement) keeps
    the batch-of-one diagnosis."""
    model = nn.Linear(3, 1)

    def run() -> None:
        r = torch.rand(1)
        s = r.std()
        w = (r - r.mean()) / s
        loss = (model(torch.rand(1, 3)).squeeze() * w).sum()
        loss.backward()

    try:
        with nanwatch.watch(model):
            run()
    except nanwatch.AnomalyError as e:
        d = first_of(e, "NW100")
    else:
        raise AssertionError("no anomaly")
    assert "batch of one" in text(d) and "0/0, so" not in text(d)


# ----------------------------------- 2: GroupNorm whose groups do not divide the channels


class _Block(nn.Module):
    def __init__(self, c: int, groups: int | None = None) -> None:
        super().__init__()
        self.groups = groups
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups is None:
            return x + self.conv(F.silu(F.group_norm(x, 32)))
        return x + self.conv(F.silu(F.group_norm(x, self.groups)))


def _unet(groups: int | None) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 48, 3, padding=1), _Block(48, groups), nn.Conv2d(48, 3, 1))


def _train_unet(model: nn.Module) -> None:
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(2):
        x = torch.randn(2, 3, 8, 8)
        loss = F.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _error(directory: Path) -> dict:
    (path,) = sorted(directory.glob("*.json"))
    return json.loads(path.read_text())["error"]


@pytest.mark.parametrize("mode", MODES)
def test_group_norm_groups_not_dividing_the_channels_get_the_divisors_and_gcd(
    mode: str, tmp_path: Path
) -> None:
    model = _unet(None)
    with (
        pytest.raises(RuntimeError, match="divisible by num_groups"),
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)),  # type: ignore[arg-type]
    ):
        _train_unet(model)
    advice = _error(tmp_path)["advice"]
    assert "48 channels do not split into 32" in advice
    assert "1, 2, 3, 4, 6, 8, 12, 16, 24, 48" in advice
    assert "num_groups = math.gcd(32, channels) (16 for 48 channels" in advice
    assert math.gcd(32, 48) == 16


@pytest.mark.parametrize("mode", MODES)
def test_the_unet_with_groups_from_gcd_trains_clean(mode: str) -> None:
    model = _unet(math.gcd(32, 48))
    with nanwatch.watch(model, mode=mode) as nw:  # type: ignore[arg-type]
        _train_unet(model)
    assert all(t.anomaly is None for t in nw.history)


def test_group_norm_constructor_and_weight_messages_get_their_advice() -> None:
    with pytest.raises(ValueError) as ctor:
        nn.GroupNorm(32, 48)
    assert "math.gcd(32, channels) (16 for 48 channels" in classify(ctor.value)["advice"]
    with pytest.raises(RuntimeError) as built:
        nn.GroupNorm(16, 64)(torch.randn(2, 48, 4, 4))
    advice = classify(built.value)["advice"]
    assert "built for 64 channels" in advice and "num_channels=48" in advice
    other = classify(RuntimeError("Expected number of channels to be 3"))
    assert "GroupNorm" not in other["advice"]


# ------------------------- 3: timesteps drawn with randint(0, T + 1) index a T-entry table


class _Eps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None].float() / T], 1))


def _train_ddpm(model: nn.Module, high: int, steps: int = 20) -> None:
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, T), 0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(steps):
        x0 = torch.randn(8, 4)
        t = torch.randint(0, high, (8,))
        noise = torch.randn_like(x0)
        a = alphas_cumprod[t][:, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        loss = F.mse_loss(model(xt, t), noise)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _train_ddpm_plus_one(model: nn.Module) -> None:
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, T), 0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(20):
        x0 = torch.randn(8, 4)
        t = torch.randint(0, T + 1, (8,))
        noise = torch.randn_like(x0)
        a = alphas_cumprod[t][:, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        loss = F.mse_loss(model(xt, t), noise)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("mode", MODES)
def test_a_randint_high_past_the_schedule_is_named_as_exclusive(mode: str, tmp_path: Path) -> None:
    torch.manual_seed(0)  # the first draw holding 50 holds 1 as its smallest value
    model = _Eps()
    with (
        pytest.raises(IndexError),
        nanwatch.watch(model, mode=mode, report_dir=str(tmp_path)),  # type: ignore[arg-type]
    ):
        _train_ddpm_plus_one(model)
    advice = _error(tmp_path)["advice"]
    assert "t was drawn by `t = torch.randint(0, T + 1, (8,))`" in advice
    assert "torch.randint's high is exclusive" in advice
    assert "the high for 50 entries is T " in advice
    assert "start at 1" not in advice and "renumbered" not in advice


def test_a_randint_high_given_as_a_number_is_told_with_the_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Eps()
    with (
        pytest.raises(IndexError),
        nanwatch.watch(model, report_dir=str(tmp_path)),
    ):
        _train_ddpm(model, T + 3)
    advice = _error(tmp_path)["advice"]
    # the high is a name of the caller's: its value is read in the frame, not guessed
    assert "t was drawn by `t = torch.randint(0, high, (8,))`" in advice
    assert "draws up to 52" in advice and "the high for 50 entries is 50 " in advice


@pytest.mark.parametrize("mode", MODES)
def test_the_ddpm_with_randint_0_T_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    model = _Eps()
    with nanwatch.watch(model, mode=mode) as nw:  # type: ignore[arg-type]
        _train_ddpm(model, T, steps=5)
    assert all(t.anomaly is None for t in nw.history)
