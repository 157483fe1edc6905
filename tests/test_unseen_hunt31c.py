"""Exploding gradients explained by the evidence the trace holds, whichever NW303 path
finds them. A jump of the gradient norm over its recent level names the module whose own
backward multiplied the gradient past 1 / eps (as a norm huge from the first step does),
or by far more than it did in every step before. Sentinel mode measures only the model's
output gradient and its parameters': a parameter whose gradient jumped far more than the
gradient the loss sent back names its module, and says the jump happened inside the model
between its output and that module, and no more. And the headline and the summary of
``-log(sigmoid(x))`` word the birth alike: what the op made, then what the value became."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.report import anomaly_headline

torch.set_num_threads(1)


class _OnePassNorm(nn.Module):
    """A normalization that computes its variance as E[x²] - E[x]² in bfloat16: for
    activations near 300 that differ by 2 the variance cancels to 0, and the gradient
    through sqrt(var + 1e-6) is multiplied by about 1e9."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.bfloat16)
        mean = h.mean(-1, keepdim=True)
        var = (h * h).mean(-1, keepdim=True) - mean * mean
        y = (h - mean) / torch.sqrt(var + 1e-6)
        return (y * self.w).to(x.dtype)


class _TwoPassNorm(_OnePassNorm):
    """The fix NW303 gives: the variance as the mean of squared deviations, in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        var = ((h - mean) ** 2).mean(-1, keepdim=True)
        return ((h - mean) / torch.sqrt(var + 1e-6) * self.w).to(x.dtype)


def _train(
    norm: type[nn.Module], mode: str, dtype: torch.dtype, *, zeros_at: int = 6
) -> nanwatch.Watcher:
    """Six healthy steps (the first layer's outputs spread by about 100 around 300), then
    a batch of zeros: the first layer gives its bias alone, 299 and 301, whose variance
    cancels in bfloat16."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), norm(16), nn.Linear(16, 1))
    with torch.no_grad():
        net[0].weight.mul_(100.0)
        net[0].bias.fill_(299.0)
        net[0].bias[::2] += 2.0
    net.to(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    with nanwatch.watch(net, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for i in range(zeros_at + 1):
            x = torch.zeros(4, 8) if i == zeros_at else torch.randn(4, 8)
            out = net(x.to(dtype)).float()
            nn.functional.mse_loss(out, torch.randn(4, 1)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def _nw303(nw: nanwatch.Watcher) -> nanwatch.Diagnosis:
    found = [d for t in nw.history for d in t.diagnoses if d.code == "NW303"]
    assert len(found) == 1, [(t.step, [d.code for d in t.diagnoses]) for t in nw.history]
    return found[0]


@pytest.mark.parametrize(
    ("dtype", "eps"), [(torch.float32, "float32 (8.39e+06)"), (torch.bfloat16, "bfloat16 (128)")]
)
def test_a_jump_of_the_gradient_norm_names_the_module_whose_backward_multiplied_it(
    dtype: torch.dtype, eps: str
) -> None:
    d = _nw303(_train(_OnePassNorm, "watch", dtype))
    assert d.step == 6 and d.path == "1", d.headline
    said = " ".join(d.evidence)
    assert "median of the previous 6 steps" in d.evidence[0], d.evidence
    assert "module 1 (_OnePassNorm) multiplied the gradient" in d.evidence[1], d.evidence
    assert "in its own backward at step 6" in said and f"past 1 / eps of {eps}" in said, said
    assert "E[x²] - E[x]²" in d.explanation, d.explanation
    assert "a bad batch, a loss spike" not in d.explanation, d.explanation
    assert d.fix.startswith("# in 1's forward (_OnePassNorm): compute what it divides by"), d.fix
    assert "((x - mean) ** 2).mean()" in d.fix, d.fix
    if dtype is torch.bfloat16:
        return  # its input is bfloat16: 299 and 301 arrive as one value, whatever it computes
    # the fix: a two-pass variance in float32; the same batch of zeros leaves the norms level
    nw = _train(_TwoPassNorm, "watch", dtype)
    assert nw.first_anomaly is None
    assert not [d for t in nw.history for d in t.diagnoses if d.code == "NW303"]


def test_a_jump_below_one_over_eps_names_the_module_whose_own_gain_jumped() -> None:
    """float16 activations: the module's bfloat16 variance still cancels, its backward
    multiplies by about 1 / sqrt(1e-6) = 1000, short of 1 / eps of float16 (1024). In every
    step before it multiplied by a small fraction: the jump began there all the same."""
    d = _nw303(_train(_OnePassNorm, "watch", torch.float16))
    assert d.step == 6 and d.path == "1", d.headline
    line = d.evidence[1]
    assert line.startswith("module 1 (_OnePassNorm) multiplied the gradient "), d.evidence
    assert "in its own backward at step 6" in line and "in each of the 6 steps before" in line
    assert "the jump began there" in d.explanation, d.explanation
    assert "a bad batch, a loss spike" not in d.explanation, d.explanation
    assert d.fix.startswith(
        "# in 1's forward (_OnePassNorm): find what it divides by that became small at step 6"
    ), d.fix
    nw = _train(_TwoPassNorm, "watch", torch.float16)
    assert nw.first_anomaly is None
    assert not [d for t in nw.history for d in t.diagnoses if d.code == "NW303"]


def test_sentinel_names_the_module_whose_gradient_jumped_past_what_the_loss_sent_back() -> None:
    d = _nw303(_train(_OnePassNorm, "sentinel", torch.bfloat16))
    assert d.step == 6 and d.path == "0" and d.parameter == "0.bias", d.headline
    said = " ".join(d.evidence)
    assert "parameter 0.bias: gradient norm" in said, d.evidence
    assert "module Sequential: max |gradient of its output|" in said, d.evidence
    assert "the gradient the loss sent back into it" in said, d.evidence
    assert "parameters whose gradient stayed near its level: 2.bias" in said, d.evidence
    assert "The gradient the loss sent back into Sequential stayed near its level" in (
        d.explanation
    ), d.explanation
    assert (
        "the jump happened inside the model, between Sequential's output and module 0 "
        "(Linear). Either a backward on that path multiplied the gradient"
    ) in d.explanation, d.explanation
    # what sentinel cannot know it leaves to watch, and does not guess
    assert "mode='watch' measures each module's backward" in d.explanation, d.explanation
    assert "_OnePassNorm" not in d.explanation and "a bad batch" not in d.explanation
    assert d.fix.startswith(
        "# rerun to step 6 under nanwatch.watch(model, mode='watch'): it names the module"
    ), d.fix
    # and watch, as that fix says, names the module
    assert _nw303(_train(_OnePassNorm, "watch", torch.bfloat16)).path == "1"


def test_sentinel_does_not_blame_the_models_backward_for_a_jump_the_loss_sent_back() -> None:
    """A batch whose targets are 1000 times larger: the loss's gradient jumps, and every
    parameter's gradient with it. Nothing inside the model multiplied it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    with nanwatch.watch(net, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
        for i in range(7):
            y = torch.randn(4, 1) * (1000.0 if i == 6 else 1.0)
            nn.functional.mse_loss(net(torch.randn(4, 8)), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    d = _nw303(nw)
    assert d.step == 6
    assert "inside the model" not in d.explanation, d.explanation
    assert "a bad batch, a loss spike" in d.explanation, d.explanation


def test_the_headline_and_the_summary_of_minus_log_sigmoid_say_the_same_birth() -> None:
    """``-log(p)`` of a saturated sigmoid: aten.log made -inf, the minus after it +inf.
    Both lines say what was born first, then what it became."""
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    with torch.no_grad():
        model[0].bias.fill_(-200.0)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        (-torch.log(model(torch.randn(8, 4)))).mean().backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None
    head = anomaly_headline(a)
    assert head.startswith("-inf born in the forward of (loss) by aten.log"), head
    assert head.endswith(" (then +inf), step 0"), head
    assert a.summary.startswith("-inf born on the way to the loss, "), a.summary
    assert " (then +inf) [op aten.log" in a.summary, a.summary
    assert "+inf born" not in a.summary and "+inf born" not in head
