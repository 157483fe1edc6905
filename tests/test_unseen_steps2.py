"""Steps of loops nanwatch had never seen: a DCGAN watched generator first without
nw.step() (one step held the whole run), SAM and a WGAN's critic updates before the first
nw.step() (the first iteration counted as several steps, and a false exploding-gradient
warning compared the generator's step with the critic's), and validation batches under
no_grad between training steps (each shifted every later step number). Tiny loops on CPU."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind


def _gan() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh())
    D = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    og = torch.optim.Adam(G.parameters(), 2e-4, betas=(0.5, 0.999))
    od = torch.optim.Adam(D.parameters(), 2e-4, betas=(0.5, 0.999))
    return G, D, og, od


def test_a_dcgan_watched_generator_first_ends_its_steps_without_nw_step() -> None:
    """pytorch/examples' DCGAN order (D on real, G, D on fake, D's update, G's update),
    watch(G, D, criterion): G was always called right after D's backward on real data,
    which looked like gradient accumulation: step 0 held all 6 iterations. Now a step ends
    with each update, as with D watched first."""
    G, D, og, od = _gan()
    crit = nn.BCEWithLogitsLoss()
    with nanwatch.watch(G, D, crit, on_anomaly="record", postmortem=False) as nw:
        for it in range(6):
            D.zero_grad()
            real = torch.randn(8, 6)
            if it == 4:
                real[2, 1] = float("nan")  # a bad sample of the real data at iteration 4
            crit(D(real).view(-1), torch.ones(8)).backward()
            fake = G(torch.randn(8, 4))
            crit(D(fake.detach()).view(-1), torch.zeros(8)).backward()
            od.step()
            G.zero_grad()
            crit(D(fake).view(-1), torch.ones(8)).backward()
            og.step()
    steps = [t.step for t in nw.history]
    assert steps == list(range(len(steps))) and len(steps) >= 2 * 4  # a step per update
    assert max(sum(c.root for c in t.calls) for t in nw.history) <= 5  # none grows with the run
    a = nw.first_anomaly
    # the real batch of iteration 4 is in iteration 4's discriminator step, not the last one
    assert a is not None and a.kind is AnomalyKind.INPUT and a.step == 2 * 4


def test_sam_with_nw_step_is_one_step_per_call() -> None:
    """SAM's first forward/backward and its in-place climb to w + e ended an automatic step
    before the first nw.step(), which gave up folding it (a weight written twice): 5 calls
    of nw.step() made 6 steps."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(m.parameters(), 0.05, momentum=0.9)
    with nanwatch.watch(m, postmortem=False) as nw:
        for _ in range(5):
            x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
            F.cross_entropy(m(x), y).backward()
            with torch.no_grad():
                norm = torch.norm(torch.stack([p.grad.norm() for p in m.parameters()]))  # type: ignore[union-attr]
                es = [p.grad * 0.05 / (norm + 1e-12) for p in m.parameters()]
                for p, e in zip(m.parameters(), es, strict=True):
                    p.add_(e)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            with torch.no_grad():
                for p, e in zip(m.parameters(), es, strict=True):
                    p.sub_(e)
            opt.step()
            opt.zero_grad()
            nw.step()
    assert nw.step_index == 5
    assert [t.step for t in nw.history] == [0, 1, 2, 3, 4]
    assert sum(c.path == "Sequential" for c in nw.history[0].calls) == 2  # both passes


def test_a_wgans_critic_updates_fold_into_the_first_nw_step() -> None:
    """n_critic = 5 critic updates, then the generator's, then nw.step(): the first
    iteration's critic updates stayed automatic steps (8 calls made 13 steps), and NW303
    called the generator's gradient norm 'exploding' next to the critic-only steps'."""
    G, D, og, od = _gan()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(G, D, postmortem=False) as nw:
            for _ in range(8):
                for _ in range(5):
                    od.zero_grad()
                    fake = G(torch.randn(8, 4)).detach()
                    (-D(torch.randn(8, 6)).mean() + D(fake).mean()).backward()
                    od.step()
                    for p in D.parameters():
                        p.data.clamp_(-0.01, 0.01)
                og.zero_grad()
                (-D(G(torch.randn(8, 4))).mean()).backward()
                og.step()
                nw.step()
    assert nw.step_index == 8
    assert [t.step for t in nw.history] == list(range(8))
    assert sum(c.path == "Sequential#2" for c in nw.history[0].calls) == 11  # D: 5 × 2 + 1
    assert nw.report.diagnoses == []
    assert not [w for w in caught if "nanwatch" in str(w.message)]


def _train_with_validation(nval: int, *, nan_at: int = -1) -> nanwatch.Watcher:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        for it in range(12):
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            if it == nan_at:
                x[0, 0] = float("nan")
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if it % 4 == 3 and it < 11:  # validation between training steps
                m.eval()
                with torch.no_grad():
                    for _ in range(nval):
                        F.cross_entropy(m(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
                m.train()
    return nw


def test_validation_between_training_steps_does_not_shift_their_numbers() -> None:
    """Three validation batches under no_grad after iterations 3 and 7: each batch but the
    last was a step of its own, so a NaN of iteration 9 was said at step 13. Now the
    validation belongs to the next training step, and one longer than the ring of steps
    holds no more memory than the ring."""
    nw = _train_with_validation(3, nan_at=9)
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.INPUT and a.step == 9
    nw = _train_with_validation(3)
    assert [t.step for t in nw.history] == list(range(12))
    assert sum(c.path == "Sequential" for c in nw.history[4].calls) == 2  # last val + train
    nw = _train_with_validation(40)
    assert nw.step_index == 12  # (after the last step ended with the run)
    assert [t.step for t in nw.history] == [8, 9, 10, 11]  # the validation's steps are gone
