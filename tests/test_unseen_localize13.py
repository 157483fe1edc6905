"""Localization fixes found by user testing: a NaN gradient summed from several consumers
of one output is not blamed on the watched one that sent a finite part; a replay that drew
new random numbers says so, and one given the forward's generator state repeats its draws."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanwatch import localize, ops
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 3: the gradient at a shared output is a sum of consumers'


class _Floor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp_min(1e-9)


class _Conditional(nn.Module):
    """A Gaussian likelihood with no lower bound on the scale: the scale is 0, the forward
    stays finite (erfc of +-inf) and the backward of ``/ scales`` is 0 / 0."""

    def __init__(self) -> None:
        super().__init__()
        self.floor = _Floor()
        self.register_buffer("scales", torch.zeros(4))

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y_hat = y * 1.0
        v = y_hat.abs()
        upper = torch.erfc((v - 0.5) / self.scales)
        lower = torch.erfc((v + 0.5) / self.scales)
        return y_hat, self.floor(0.5 * (upper - lower))


class _Codec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.cond, self.dec = nn.Linear(4, 4), _Conditional(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y_hat, lik = self.cond(self.enc(x))
        return self.dec(y_hat), lik


def test_a_nan_gradient_at_an_output_two_consumers_used_is_not_blamed_on_the_finite_one() -> None:
    m = _Codec()
    x = torch.randn(3, 4)

    def run() -> None:
        out, lik = m(x)
        ((out - x) ** 2).mean().add(torch.log(lik).sum()).backward()

    err = _raises(m, run, "watch")
    a = err.anomaly
    assert a is not None and a.kind.value == "backward"
    assert a.path == "cond", a.summary
    assert "code in cond that used its own output[0]" in a.summary
    assert "the backward of dec (Linear in float32)" in a.summary
    assert "born in the backward of dec:" not in a.summary


# ------------------------------ 1, 2: random draws in a replayed forward


class _Noise(nn.Module):
    """Noise with one exact zero in every draw: x / 0 wherever the draw is its minimum."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = torch.rand_like(x)
        return self.gain * (x.abs() + 1) / (u - u.min())


def test_a_replay_given_the_forwards_generator_state_repeats_its_draws() -> None:
    m, x = _Noise(), torch.ones(4, 8)
    state = ops.forward_rng((x,), {})
    assert state is not None
    out = m(x)  # the run's own draw
    assert not torch.isfinite(out).all()
    torch.set_rng_state(state[0])
    u = torch.rand_like(x)
    run_max = float((u - u.min()).max())
    after = torch.get_rng_state()

    result = ops.replay(m, (x,), {}, path="noise", rng=state)
    ev = result.first()
    assert ev is not None and ev.op == "aten.div.Tensor"
    assert result.random and result.same_draws and not result.new_draws
    divisor = dict(ev.inputs)["other"]
    assert divisor is not None and divisor.max == run_max  # the run's numbers, not new ones
    assert localize.redrawn(ev) is None
    assert torch.equal(torch.get_rng_state(), after)  # the user's generator is left as it was

    again = ops.replay(m, (x,), {}, path="noise")  # no state: new draws, and it says so
    ev2 = again.first()
    assert ev2 is not None and again.new_draws and localize.redrawn(ev2) == 1


@pytest.mark.landed_only(
    reason="replays the module on its inputs, alive as backward begins, with new draws; read "
    "after backward freed them, its root is replayed from the generator state the root call "
    "began with, and repeats the run's own draws"
)
def test_an_op_traced_with_new_random_draws_says_its_numbers_are_not_the_runs() -> None:
    m = nn.Sequential(nn.Linear(8, 8), _Noise(), nn.Linear(8, 2))

    def run() -> None:
        m(torch.randn(4, 8)).sum().backward()

    err = _raises(m, run, "watch")
    a = err.anomaly
    assert a is not None and a.op is not None and a.path == "1"
    assert "aten.div" in a.summary
    assert "a replay that drew new random numbers (attempt 1)" in a.summary
    assert "not the run's" in a.summary


class _GumbelHead(nn.Module):
    """A float16 model that divides Gumbel-perturbed logits by an annealed temperature: at
    a tiny tau only some draws pass float16's max, so a replay with new draws misses it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 10), nn.Linear(10, 16)

    def forward(self, x: torch.Tensor, tau: float) -> torch.Tensor:
        g = -torch.empty_like(x[:, :10]).exponential_().log()
        return self.out(torch.softmax((self.fc(x) + g) / tau, dim=-1))


def test_a_root_that_draws_is_replayed_with_its_own_draws() -> None:
    for mode in ("watch", "sentinel"):
        torch.manual_seed(12)
        m = _GumbelHead().half()
        x = torch.randn(32, 16).half()
        tau = 1.2e-4
        lim = torch.finfo(torch.float16).max
        # the overflow needs a large |logit + noise| in this draw, not in most others
        state = torch.get_rng_state()
        g = -torch.empty(32, 10, dtype=torch.float16).exponential_().log()
        assert not torch.isfinite((m.fc(x) + g) / tau).all()
        hits = 0
        for _ in range(8):
            g2 = -torch.empty(32, 10, dtype=torch.float16).exponential_().log()
            hits += int(bool(((m.fc(x) + g2).abs() / tau > lim).any()))
        assert hits == 0, "only the run's own draw overflows: new draws would miss it"
        torch.set_rng_state(state)

        def run(m: nn.Module = m, x: torch.Tensor = x, tau: float = tau) -> None:
            m(x, tau).float().sum().backward()

        err = _raises(m, run, mode)
        a = err.anomaly
        assert a is not None and a.op is not None, mode
        assert "aten.div" in a.summary, (mode, a.summary)
        assert "new random numbers" not in a.summary
