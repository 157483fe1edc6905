"""The learning rate "rose" only within one optimizer: a GAN's two optimizers of one class
(the generator's lr 1e4, the discriminator's 0.01) are two schedules, not one that went
from 0.01 to 1e4."""

from __future__ import annotations

import torch
from torch import nn

import nanwatch
from nanwatch.rules.overflow import _lr_rise, _LrStep

torch.set_num_threads(1)


def test_two_optimizers_of_one_class_are_not_one_schedule() -> None:
    steps = [_LrStep(0, "SGD", (0.01,), (0,), 1), _LrStep(0, "SGD", (1e4,), (0,), 2)]
    assert _lr_rise(steps) is None
    warmup = [_LrStep(0, "SGD", (0.01,), (0,), 1), _LrStep(3, "SGD", (0.1,), (0,), 1)]
    assert _lr_rise(warmup) == (warmup[0], warmup[1])


def test_the_optimizer_note_says_which_optimizer_stepped() -> None:
    g, d = nn.Linear(2, 2), nn.Linear(2, 1)
    opt_g = torch.optim.SGD(g.parameters(), lr=1e4)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.01)
    with nanwatch.watch(g, d) as nw:
        d(g(torch.randn(4, 2))).sum().backward()
        opt_d.step()
        opt_g.step()
        notes = [n for n in nw.trace.notes if n.kind == "optimizer"]
        nw.step()
    assert {n.data["ident"] for n in notes} == {id(opt_g), id(opt_d)}
