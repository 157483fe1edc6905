"""Domain fixes found by user testing: a KL to a reference whose softmax underflowed takes
log q from the reference's logits (xlogy only for p log p); a division by one exp (not a
sum of exps) floors the exp, not a logsumexp; a 1 - tanh(r) ** 2 that cancelled to 0 keeps
tanh off +-1 and covers every use of the difference; a std over one sample keeps healthy
batches unscaled; a division inside torch.distributions names the distribution's
parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._diagnoses import code_lines
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises

torch.set_num_threads(1)


# ------------------------------ 1: KL to a reference softmax that underflowed: log q, not xlogy


class _KlToRef(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.policy = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
        logp = self.policy(x).log_softmax(-1)
        with torch.no_grad():
            q = ref_logits.softmax(-1)
        p = logp.exp()
        kl = (p * (torch.log(p) - torch.log(q))).sum(-1).mean()
        return kl


def test_kl_whose_reference_softmax_underflowed_takes_log_q_from_its_logits() -> None:
    torch.manual_seed(0)
    m = _KlToRef()
    ref_logits = torch.zeros(3, 8)
    ref_logits[:, 0] = 200.0  # a very peaked reference: q is exactly 0 off token 0
    x = torch.randn(3, 4)

    def run() -> None:
        m(x, ref_logits).backward()

    d = _first(_raises(m, run, "forensic"), "NW110")
    assert "log_q = ref_logits.log_softmax(-1)" in d.fix
    assert "kl = (torch.xlogy(p, p) - p * log_q).sum(-1).mean()" in d.fix
    assert "torch.xlogy(p, q)" not in d.fix
    assert any("log(q)" in e and "subtracted" in e for e in d.evidence)
    # the fix, pasted, gives a finite KL
    with torch.no_grad():
        logp = m.policy(x).log_softmax(-1)
        env = {"torch": torch, "ref_logits": ref_logits, "p": logp.exp(), "q": None}
        exec(code_lines(d.fix), env)
        assert torch.isfinite(env["kl"])


# ------------------------------ 2: a division by one exp() that underflowed: floor it, no logsumexp


class _Gauss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.head(x)
        mu, log_sig = out[:, :2], out[:, 2:]
        sig = log_sig.exp()
        z = (y - mu) / sig
        return (-0.5 * z**2 - log_sig).sum(-1)


def _gauss() -> tuple[_Gauss, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = _Gauss()
    with torch.no_grad():
        m.head.bias[3] = -120.0  # exp(-120) is 0 in float32
    return m, torch.randn(3, 2) * 0.1, torch.randn(3, 2)


def test_division_by_one_exp_that_underflowed_floors_the_exp_not_a_logsumexp() -> None:
    m, x, y = _gauss()

    def run() -> None:
        torch.logsumexp(m(x, y), 0).backward()

    d = _first(_raises(m, run, "forensic"), "NW111")
    assert "exp() underflowed to 0" in d.title
    assert "sig = log_sig.exp().clamp_min(torch.finfo(log_sig.dtype).tiny ** 0.25)" in d.fix
    assert "logsumexp" not in d.fix and "log_sig = log_sig" not in d.fix
    assert "overflows" in d.explanation
    # the fix, pasted in place of the exp's line, makes the step finite (the gradients of
    # the step that raised dropped: read late, the raise came after its backward wrote them)
    m.zero_grad(set_to_none=True)
    out = m.head(x)
    mu, log_sig = out[:, :2], out[:, 2:]
    env = {"torch": torch, "log_sig": log_sig}
    exec(code_lines(d.fix), env)
    loss = torch.logsumexp((-0.5 * ((y - mu) / env["sig"]) ** 2 - log_sig).sum(-1), 0)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_division_by_one_exp_without_the_line_gives_the_floor_pattern() -> None:
    m, x, y = _gauss()
    head = m.head

    def run() -> None:  # the loss outside the watched module: watch mode has no line
        out = head(x)
        s = out[:, 2:].exp()
        torch.logsumexp((-0.5 * ((y - out[:, :2]) / s) ** 2).sum(-1), 0).backward()

    d = _first(_raises(head, run, "watch"), "NW111")
    assert "torch.exp(x).clamp_min(torch.finfo(x.dtype).tiny ** 0.25)" in d.fix
    assert "logsumexp" not in d.fix
    compile(code_lines(d.fix), "<fix>", "exec")


# ------------------------------ 3: 1 - tanh(r) ** 2 cancelled to 0: keep tanh off +-1, every use


def _bivariate(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    zx, zy, r = out.unbind(-1)
    rho = torch.tanh(r)
    one_m = 1 - rho**2
    z = zx**2 + zy**2 - 2 * rho * zx * zy
    nll = z / (2 * one_m) + torch.log(6.28 * torch.sqrt(one_m))
    return nll.mean()


def test_zero_difference_of_a_saturated_tanh_clamps_the_tanh_and_floors_every_use() -> None:
    torch.manual_seed(0)
    head = nn.Linear(2, 3)
    with torch.no_grad():
        head.bias[2] = 12.0  # tanh(12) is 1.0 in float32
    x, y = torch.randn(4, 2) * 0.1, torch.randn(4, 2)

    def run() -> None:
        _bivariate(head(x), y).backward()

    d = _first(_raises(head, run, "forensic"), "NW111")
    assert "cancelled to 0" in d.title
    assert (
        "rho = torch.tanh(r).clamp(-1 + torch.finfo(r.dtype).eps, 1 - torch.finfo(r.dtype).eps)"
        in d.fix
    )
    assert "one_m = (1 - rho**2).clamp_min(torch.finfo(rho.dtype).eps)" in d.fix
    assert "(2 * one_m).clamp_min" not in d.fix and "buffer" not in d.fix
    # each fix, pasted, makes the step finite
    out = head(x)
    zx, zy, r = out.unbind(-1)
    for line in (code_lines(d.fix), d.fix.splitlines()[1].lstrip("# ").removeprefix("or ")):
        env = {"torch": torch, "r": r, "rho": torch.tanh(r)}
        exec(line, env)
        rho = env["rho"]
        one_m = env.get("one_m", 1 - rho**2)
        nll = (zx**2 + zy**2 - 2 * rho * zx * zy) / (2 * one_m) + torch.log(6.28 * one_m.sqrt())
        assert torch.isfinite(nll).all()


# ------------------------------ 4: std over a batch of one: guard it, healthy batches unchanged


@pytest.mark.filterwarnings("ignore:std\\(\\). degrees of freedom:UserWarning")
def test_std_of_a_batch_of_one_is_guarded_first_and_the_population_std_says_it_rescales() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(1, 3)

    def run() -> None:
        logp = lin(x).log_softmax(-1)[:, 0]
        reward = torch.ones(1)
        adv = (reward - reward.mean()) / (reward.std() + 1e-8)
        (-(adv * logp).mean()).backward()

    d = _first(_raises(lin, run, "forensic"), "NW113")
    first = d.fix.splitlines()[0]
    guarded = "(reward.std() if reward.numel() > 1 else 1.0)"
    assert guarded in first and "correction=0" not in first
    assert "drop_last=True" in d.fix
    assert "correction=0" in d.fix and "1.15x at N = 4" in d.fix
    for n in (1, 4):  # finite at one sample, the same advantages as before at four
        reward = torch.arange(float(n))
        env = {"torch": torch, "reward": reward}
        exec(code_lines(d.fix), env)
        assert torch.isfinite(env["adv"]).all()
        if n > 1:
            assert torch.equal(env["adv"], (reward - reward.mean()) / (reward.std() + 1e-8))
