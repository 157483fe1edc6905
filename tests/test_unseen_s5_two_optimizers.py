"""A GAN trained with two optimizers of one class (SGD for the generator and for the
discriminator), the discriminator's lr far too high: its update moves D's weights by
millions of times their size, the loss spikes and the gradients explode. Each fix names
the user's optimizer that holds the weights its diagnosis is about (``oD``, not the first
optimizer found, ``oG``), and the huge gradients of the step after the oversized update are
the lr's doing, not a Linear that "divides by a cancelled difference"; the overflow that
follows leads with that lr, not with a LayerNorm and an init."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.records import StepTrace

torch.set_num_threads(1)

MODES = ["sentinel", "watch", "forensic"]


def _train(mode: str, lr_d: float, lr_g: float = 0.01) -> tuple[list[StepTrace], Any]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    oG = torch.optim.SGD(G.parameters(), lr=lr_g)
    oD = torch.optim.SGD(D.parameters(), lr=lr_d)
    crit = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    with nanwatch.watch([G, D, crit], mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(8):
            real = torch.randn(16, 8) + 2
            fake = G(torch.randn(16, 4))
            d_loss = crit(D(real), ones) + crit(D(fake.detach()), zeros)
            oD.zero_grad()
            d_loss.backward()
            oD.step()
            g_loss = crit(D(fake), ones)
            oG.zero_grad()
            g_loss.backward()
            oG.step()
            nw.step()
    return nw.history, (G, D, oG, oD)


@pytest.mark.parametrize("mode", MODES)
def test_the_lr_fix_names_the_optimizer_of_the_weight_it_moved(mode: str) -> None:
    history, (G, D, oG, oD) = _train(mode, lr_d=50.0)
    (d,) = [d for t in history for d in t.diagnoses if d.code == "NW308"]
    assert d.parameter is not None and d.parameter.startswith("Sequential#2.")  # D's weight
    line = d.fix.splitlines()[0]
    assert line.startswith('oD.param_groups[0]["lr"] = '), d.fix
    assert "oG" not in d.fix
    exec(d.fix, {"oD": oD, "oG": oG})
    assert oD.param_groups[0]["lr"] < 1.0 and oG.param_groups[0]["lr"] == 0.01
    # every fix that names one of the two optimizers names the one holding its weight
    d_params = {f"Sequential#2.{n}" for n, _ in D.named_parameters()}
    g_params = {n for n, _ in G.named_parameters()}
    for t in history:
        for x in t.diagnoses:
            if x.parameter in d_params:
                assert "oG." not in x.fix, (x.code, x.fix)
            if x.parameter in g_params:
                assert "oD." not in x.fix, (x.code, x.fix)


@pytest.mark.parametrize("mode", MODES)
def test_huge_gradients_after_the_oversized_update_blame_no_module(mode: str) -> None:
    history, _ = _train(mode, lr_d=50.0)
    spike = next(t for t in history if any(d.code == "NW308" for d in t.diagnoses))
    for t in history:
        for d in t.diagnoses:
            assert "without cancellation" not in d.fix, (t.step, d.code, d.path, d.fix)
            assert "cancelled" not in d.explanation, (t.step, d.code, d.path, d.explanation)
    if mode != "sentinel":  # (sentinel measures no module's backward: none is named)
        # the step that spiked says the lr once (NW308); NW303 does not name D's Linear
        assert [d.code for d in spike.diagnoses].count("NW303") == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_healthy_gan_with_two_sgds_at_different_lrs_is_silent(mode: str) -> None:
    history, _ = _train(mode, lr_d=0.04, lr_g=0.01)
    assert len(history) == 8
    assert [(t.step, d.code) for t in history for d in t.diagnoses] == []
    assert all(t.anomaly is None for t in history)


@pytest.mark.parametrize("mode", MODES)
def test_the_overflow_the_spike_led_to_names_the_lr_first(mode: str) -> None:
    """The loss stays high after the spike, and a step later D's first Linear overflows:
    the error leads with the lr the NW308 warning named (on ``oD``), not with a LayerNorm
    and an init as if the weights had grown by themselves."""
    history, (_, _, oG, oD) = _train(mode, lr_d=50.0)
    warned = next(t for t in history if any(d.code == "NW308" for d in t.diagnoses))
    (w,) = [d for d in warned.diagnoses if d.code == "NW308"]
    (d,) = [d for t in history for d in t.diagnoses if d.code == "NW101"]
    assert d.step == warned.step + 1 and d.path == "Sequential#2.0"
    lines = d.fix.splitlines()
    assert lines[0] == w.fix.splitlines()[0] and lines[0].startswith("oD.param_groups")
    assert lines[1] == f"# the lr first (NW308 of step {warned.step}); then, if it still overflows:"
    assert "clip_grad_norm_(D.parameters()" in lines[2]
    assert f"since step {warned.step}" in " ".join(d.evidence)
    assert "Lower that learning rate first." in d.explanation
    exec(lines[0], {"oD": oD, "oG": oG})
    assert oD.param_groups[0]["lr"] < 1.0 and oG.param_groups[0]["lr"] == 0.01
