"""Generative models in sentinel and watch, which trace no op outside the modules:

- a VAE given raw pixel values (0..255): the ``logvar.exp()`` of its KL term, in the loss
  code, overflows at step 0. Sentinel and watch said only "the initial weights or the
  inputs put it there" with a template clamp; now the exp's argument is named (the
  recorded output of the module that made it, matched by exp's own result: the log of its
  smallest value is that output's min) and the inputs' range against a unit scale says the
  data was not normalized, with the scaling as the fix (the clamp only as a guard);
- a diffusion step whose schedule ``alpha_bar`` has negative entries, so the noised input
  ``xt = ab.sqrt() * x0 + ...`` is NaN: NW401 said "the batch itself is bad ... or your
  code"; the input is now read from the user's line that assigned it: a root of a
  tensor read from a table, checked where the table is built.

Each has a healthy control."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)

MODES = ["sentinel", "watch"]


def _run(model: nn.Module, mode: str, step, steps: int) -> nanwatch.Watcher:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            loss = step(model)
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.report.diagnoses:
                break
    return nw


# ------------------------------------------------------------- 1: VAE on raw pixel values
class _Vae(nn.Module):
    def __init__(self, d: int = 784, h: int = 400, z: int = 20) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.mu = nn.Linear(h, z)
        self.logvar = nn.Linear(h, z)
        self.dec = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.dec(z), mu, logvar


def _vae_step(scale: float):
    def step(model: nn.Module) -> torch.Tensor:
        x = torch.randint(0, 256, (32, 784)).float() * scale
        recon, mu, logvar = model(x)
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return F.mse_loss(recon, x, reduction="sum") + kl

    return step


@pytest.mark.parametrize("mode", MODES)
def test_a_vae_on_raw_pixels_names_the_logvar_output_and_the_unscaled_inputs(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Vae(), mode, _vae_step(1.0), steps=2)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op, d.step) == ("NW101", "aten.exp", 0), d
    said = "\n".join(d.evidence)
    who = "logvar's output (Linear)" if mode == "watch" else "_Vae's output[2] (_Vae)"
    assert f"exp's argument is {who}: min -" in said, said
    assert "the model's input[0] spans [0, 255]: inputs 255 times the unit scale" in said, said
    assert "the initial weights or the inputs" not in said
    assert d.explanation.startswith("The model's inputs were not normalized"), d.explanation
    assert "drifted up" not in d.explanation
    lines = d.fix.splitlines()
    assert lines[0].startswith("x = x / 255   # the inputs span [0, 255]"), d.fix
    assert lines[1].startswith("# and only as a guard: y = torch.exp(x.clamp(max=44.3))"), d.fix
    assert lines[1].endswith(f"# x: {who.split(' (', maxsplit=1)[0]}"), d.fix


@pytest.mark.parametrize("mode", MODES)
def test_an_exp_overflow_from_a_large_bias_names_the_module_but_not_the_inputs(mode: str) -> None:
    torch.manual_seed(0)
    model = _Vae()
    with torch.no_grad():
        model.logvar.bias.fill_(100.0)
    nw = _run(model, mode, _vae_step(1 / 255), steps=2)
    d = nw.report.diagnoses[0]
    assert (d.code, d.op) == ("NW101", "aten.exp"), d
    said = "\n".join(d.evidence)
    if mode == "watch":
        assert "exp's argument is logvar's output (Linear): min " in said, said
    assert "spans" not in said and "not normalized" not in d.explanation
    assert "the initial weights or the inputs put it there" in said


@pytest.mark.parametrize("mode", MODES)
def test_the_vae_on_scaled_pixels_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Vae(), mode, _vae_step(1 / 255), steps=3)
    assert nw.report.diagnoses == []


# ------------------------------------------- 2: diffusion, a schedule with negative entries
_T = 1000
_BETAS = torch.linspace(1e-4, 0.02, _T)
_WRONG_ALPHA_BAR = 1.0 - torch.cumsum(_BETAS, dim=0)  # a sum of betas: negative past t ~ 100
_ALPHA_BAR = torch.cumprod(1.0 - _BETAS, dim=0)


class _Denoiser(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, 64), nn.SiLU(), nn.Linear(64, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None].float() / _T], dim=1))


def _diffusion_step(alpha_bar: torch.Tensor):
    def step(model: nn.Module) -> torch.Tensor:
        x0 = torch.randn(128, 8)
        t = torch.randint(0, _T, (128,))
        noise = torch.randn_like(x0)
        ab = alpha_bar[t][:, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        return F.mse_loss(model(xt, t), noise)

    return step


@pytest.mark.parametrize("mode", MODES)
def test_a_noised_input_from_a_negative_schedule_names_its_line_and_table(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Denoiser(), mode, _diffusion_step(_WRONG_ALPHA_BAR), steps=2)
    d = nw.report.diagnoses[0]
    assert (d.code, d.title) == ("NW401", "NaN in an input your code computed with sqrt"), d
    said = "\n".join(d.evidence)
    assert "xt is not the batch as loaded: your code computed it at " in said, said
    assert ": xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise -- with ab.sqrt()" in said, said
    assert "ab = alpha_bar[t][:, None] (at " in said and "reads alpha_bar by index" in said
    assert "corrupted file" not in d.explanation and "nan_to_num" not in d.fix
    assert "xt has no autograd history: alpha_bar is a constant" in d.explanation
    assert d.fix.splitlines()[0].startswith(
        "assert (alpha_bar >= 0).all(), alpha_bar.min()   # right where alpha_bar is built"
    ), d.fix


def test_a_nan_in_loaded_data_passed_by_name_is_still_the_data() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    batch = torch.randn(32, 8)
    batch[3, 2] = float("nan")

    def step(model: nn.Module) -> torch.Tensor:
        xb = batch.clone()
        return model(xb).pow(2).mean()

    nw = _run(model, "watch", step, steps=1)
    d = nw.report.diagnoses[0]
    assert d.code == "NW401" and "your code computed" not in d.title, d


@pytest.mark.parametrize("mode", MODES)
def test_the_cumprod_schedule_trains_clean(mode: str) -> None:
    torch.manual_seed(0)
    nw = _run(_Denoiser(), mode, _diffusion_step(_ALPHA_BAR), steps=3)
    assert nw.report.diagnoses == []


class _LogScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(784, 8)
        self.log_scale = nn.Parameter(torch.full((8,), 100.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * torch.exp(self.log_scale)


def test_an_exp_of_a_weight_is_not_blamed_on_unscaled_inputs() -> None:
    torch.manual_seed(0)
    x = torch.randint(0, 256, (32, 784)).float()
    nw = _run(_LogScale(), "watch", lambda m: m(x).pow(2).mean(), steps=1)
    d = nw.report.diagnoses[0]
    assert d.code == "NW101", d
    assert "not normalized" not in d.explanation and "x = x / 255" not in d.fix, d
