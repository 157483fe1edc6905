"""A tensor computed without gradients that is NaN because it was normalized by the std of a
batch of one (REINFORCE's advantage whitening on the last, short batch), in watch mode: the
fix guards the batch of one first, which leaves every other batch as it was; the population
std is offered last and said to rescale every batch."""

from __future__ import annotations

import torch
from torch import nn

from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


def test_a_batch_of_one_std_is_guarded_first() -> None:
    torch.manual_seed(0)
    policy = nn.Linear(4, 3)
    x = torch.randn(1, 4)  # the last batch: one prompt

    def run() -> None:
        with torch.no_grad():
            reward = policy(x).max(-1).values
        adv = (reward - reward.mean()) / (reward.std() + 1e-8)
        logp = policy(x).log_softmax(-1)[:, 0]
        (-(adv * logp).mean()).backward()

    err = _raises(policy, run, "watch")
    d = next(d for d in err.diagnoses if "std" in d.fix)
    lines = d.fix.splitlines()
    guard = next(i for i, ln in enumerate(lines) if "numel() > 1 else 1.0" in ln)
    pop = next(i for i, ln in enumerate(lines) if "correction=0" in ln)
    assert guard < pop, d.fix
    assert "sqrt(N/(N-1))" in lines[pop]
    # the guard, on a healthy batch, is the plain std
    r = torch.tensor([1.0, 2.0, 4.0])
    guarded = (r - r.mean()) / ((r.std() if r.numel() > 1 else 1.0) + 1e-8)
    assert torch.equal(guarded, (r - r.mean()) / (r.std() + 1e-8))
