"""NW401 beyond the batch: an input a no-grad sampling loop computed between two calls of
the model (a division by 0 in the update, not an attack's normalization), and a functional
loss's target that held -inf (log of 0) or a single NaN reading, with its count."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

from ._diagnoses import first_bad, text


def _conv() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.SiLU(), nn.Conv2d(4, 1, 3, padding=1))


def test_an_inf_a_no_grad_sampling_loop_computed_is_not_an_attacks_normalization() -> None:
    """A sampler's 1 / alpha.sqrt() with alpha = 0 (a schedule's last value) under no_grad:
    the next model call gets +-inf in every value. It was titled NaN, told an adversarial
    attack's story and fixed with an l2_normalize."""
    model = _conv()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    alphas = torch.tensor([0.5, 0.9, 0.0])
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            x0 = torch.randn(4, 1, 6, 6)
            loss = F.mse_loss(model(x0), x0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
        with torch.no_grad():  # the sampler: one step of its own
            x = torch.randn(4, 1, 6, 6)
            for i in reversed(range(3)):
                eps = model(x)
                x = 1 / alphas[i].sqrt() * (x - 0.1 * eps)
        nw.step()
    t = first_bad(nw)
    d = t.diagnoses[0]
    assert d.code == "NW401"
    assert d.title == "inf in an input your code computed between two calls of Sequential"
    body = text(d)
    assert "no gradient was taken between the two calls: a sampling loop?" in body
    assert "every value of the bad samples is +inf or -inf" in body
    assert "mode='forensic'" in d.fix
    assert "l2_normalize" not in d.fix and "PGD" not in d.explanation


def test_a_nan_an_attack_made_keeps_its_normalization_story() -> None:
    """The twin with a gradient between the calls: a per-sample L2 step of a zero input
    gradient is 0/0; the attack's story and its l2_normalize fix stay."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)
    )
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x, y = torch.rand(4, 1, 6, 6), torch.randint(0, 3, (4,))
        x[2] = 0.0
        delta = torch.zeros_like(x).requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(model(x + delta), y), delta)
        g = g / g.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        F.cross_entropy(model(x + 0.1 * g), y).backward()
        nw.step()
    d = first_bad(nw).diagnoses[0]
    assert d.title == "NaN in an input your code computed between two calls of Sequential"
    assert "(a gradient was computed between the two calls)" in text(d)
    assert "def l2_normalize" in d.fix


def _gru() -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(1, 8, batch_first=True)
            self.fc = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.gru(x)[0])

    torch.manual_seed(0)
    return Net()


def test_a_minus_inf_target_from_a_log_of_zero_in_f_mse_loss_is_bad_targets() -> None:
    """torch.log(sales) with zero sales passed to F.mse_loss: the graph walk names
    aten.mse_loss, which only read the -inf; it was the generic NW100."""
    for mode in ("watch", "sentinel"):
        model = _gru()
        with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
            torch.manual_seed(1)
            sales = torch.poisson(torch.full((8, 21, 1), 3.0))
            zeros = int((sales[:, 1:] == 0).sum())
            assert zeros > 0
            y = torch.log(sales[:, 1:])
            F.mse_loss(model(torch.log1p(sales[:, :-1])), y).backward()
            nw.step()
        d = first_bad(nw).diagnoses[0]
        assert d.code == "NW401", (mode, d.code, d.title)
        assert d.title == "NaN or inf in the loss targets"
        body = text(d)
        assert "holds -inf: min -inf" in body
        assert f"{zeros} -inf" in body
        assert "log(0)" in body and "log1p" in d.fix
        assert "std()" not in d.fix


def test_a_single_nan_reading_in_the_target_is_counted_and_the_fix_finds_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        x, y = torch.randn(400, 4), torch.randn(400, 1)
        y[10, 0] = float("nan")
        F.mse_loss(model(x), y).backward()
        nw.step()
    d = first_bad(nw).diagnoses[0]
    assert d.code == "NW401"
    assert "1 of its 400 values is NaN" in text(d)
    assert "y.std()" not in d.fix
    space: dict[str, object] = {"torch": torch, "y": y, "print": lambda *a: found.extend(a)}
    found: list[object] = []
    exec("\n".join(ln for ln in d.fix.splitlines() if ln.startswith("print(")), space)
    assert found == [[[10, 0]]]


def test_advantage_normalization_of_a_one_sample_batch_names_std_of_one_value() -> None:
    """adv.std() of one value is NaN; the fix said clamp_min on the denominator, which
    leaves a NaN a NaN."""
    torch.manual_seed(0)
    ac = nn.Linear(4, 3)
    opt = torch.optim.SGD(ac.parameters(), lr=0.01)
    with nanwatch.watch(ac, on_anomaly="record", postmortem=False) as nw:
        for n in (16, 1):
            obs, act, adv = torch.randn(n, 4), torch.randint(0, 3, (n,)), torch.randn(n)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # std(): degrees of freedom is <= 0
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            logp = ac(obs).log_softmax(-1).gather(1, act[:, None]).squeeze(1)
            loss = -(logp * adv).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    d = first_bad(nw).diagnoses[0]
    assert "a batch of one sample, whose std() or var() is NaN" in text(d)
    assert "adv.std(correction=0)" in d.fix and "drop_last=True" in d.fix
