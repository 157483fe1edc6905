"""Unseen op evidence, round 4: torch.logdet of a matrix whose determinant is negative (NaN
from a NaN constant that logdet's decomposition selects with where) is named in watch and
forensic modes; a multiplication whose unsaved operand brought the NaN is not called
"0 × inf"; a 0 × +inf of an infinite constant interval is not called a -inf mask; the
inspect fix of an op whose line reduces after it inspects the operand before the reduction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from tests._diagnoses import first_bad, text, top

torch.set_num_threads(1)


class _Noise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 2)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return torch.diag_embed(self.enc(feat))


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_logdet_of_a_negative_determinant_is_named(mode: str) -> None:
    torch.manual_seed(0)
    m = _Noise()
    with torch.no_grad():
        m.enc.bias.copy_(torch.tensor([-0.5, 2.0]))  # det(P + R) < 0
    P = torch.eye(2) * 0.3
    with nanwatch.watch(m, on_anomaly="record", postmortem=False, mode=mode) as nw:
        cov = P + m(torch.randn(8, 4) * 0.1)
        nll = 0.5 * torch.logdet(cov).mean()
        nll.backward()
        nw.step()
    a = first_bad(nw).anomaly
    assert a is not None and a.op is not None, a
    assert a.op.op == "aten.logdet", a.summary
    diag = top(nw)
    body = text(diag)
    assert "0 × inf" not in body, body
    assert "none made it" not in body, body
    assert "negative determinant" in body, body
    assert "slogdet" in diag.fix, diag.fix
    if mode == "forensic":  # the op checker knows the user's line
        assert a.op.source is not None and "test_unseen_ops4.py" in a.op.source
        assert "slogdet(cov)" in diag.fix, diag.fix
        assert "scalar_tensor" not in a.summary, a.summary  # the constant is logdet's own


def test_a_positive_determinant_stays_silent() -> None:
    torch.manual_seed(0)
    m = _Noise()
    with torch.no_grad():
        m.enc.bias.copy_(torch.tensor([2.0, 2.0]))
    with nanwatch.watch(m, on_anomaly="record", postmortem=False, mode="forensic") as nw:
        nll = 0.5 * torch.logdet(torch.eye(2) * 0.3 + m(torch.randn(8, 4))).mean()
        nll.backward()
        nw.step()
    assert all(t.anomaly is None for t in nw.history)


def test_a_nan_an_unsaved_operand_brought_is_not_called_zero_times_inf() -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        y = m(torch.randn(8, 4)).squeeze(1)
        r = torch.where(y > 100, y, torch.tensor(float("nan")))  # a NaN constant put in
        loss = 0.5 * r.mean()  # MulBackward0 saves only 0.5
        loss.backward()
        nw.step()
    diag = top(nw)
    body = text(diag)
    assert "0 × inf" not in body, body
    assert "already held NaN" in body, body
    assert "MeanBackward0" in body, body  # the node that made the unsaved operand


class _Render(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.density = nn.Linear(3, 1)

    def forward(self, pts: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sigma = torch.relu(self.density(pts).squeeze(-1))
        dists = t[:, 1:] - t[:, :-1]
        dists = torch.cat([dists, torch.full_like(dists[:, :1], float("inf"))], -1)
        return 1.0 - torch.exp(-sigma * dists)


def test_zero_times_an_infinite_interval_is_not_called_a_neginf_mask() -> None:
    torch.manual_seed(0)
    r = _Render()
    with torch.no_grad():
        r.density.bias.fill_(-0.2)  # some densities exactly 0 after the ReLU
    t = torch.linspace(2.0, 6.0, 8).expand(16, 8)
    with nanwatch.watch(r, on_anomaly="record", postmortem=False) as nw:
        r(torch.randn(16, 8, 3) * 0.1, t).sum().backward()
        nw.step()
    diag = top(nw)
    assert "0 × inf" in diag.title, diag.title
    assert "-inf" not in diag.explanation, diag.explanation
    assert "finfo(dtype).min" not in diag.explanation, diag.explanation
    assert "full_like" in diag.explanation and "1e10" in diag.explanation, diag.explanation
    assert "torch.full_like(dists[:, :1], 1e10)" in diag.fix, diag.fix
    assert "finfo" not in diag.fix, diag.fix


class _Gold(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trans = nn.Parameter(torch.randn(3, 3) * 0.1)
        mask = torch.zeros(3, 3)
        mask[0, 2] = float("-inf")  # a forbidden transition
        self.register_buffer("constraint", mask)

    def forward(self, emis: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        trans = self.trans + self.constraint
        logZ = torch.logsumexp(emis + trans[0], dim=1)
        score = emis.gather(1, tags[:, None]).squeeze(1) + trans[0, tags]
        return (logZ - score).mean()


def test_the_inspect_fix_looks_at_the_op_before_the_line_reduces_it() -> None:
    torch.manual_seed(0)
    gold = _Gold()
    emis = torch.randn(4, 3, requires_grad=True)
    tags = torch.tensor([0, 2, 1, 2])  # gold paths through the forbidden transition
    with nanwatch.watch(gold, on_anomaly="record", postmortem=False) as nw:
        gold(emis, tags).backward()
        nw.step()
    diag = top(nw)
    assert "aten.sub" in (diag.op or ""), text(diag)
    assert "bad = ~torch.isfinite(logZ - score)" in diag.fix, diag.fix
    assert ".mean()" not in diag.fix, diag.fix  # a 0-d result cannot index (4,) inputs
    assert "print(logZ[bad], score[bad])" in diag.fix, diag.fix


def test_a_neginf_padded_list_loss_is_named_in_watch_mode() -> None:
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    feats, rels = torch.randn(4, 6, 10), torch.randint(0, 3, (4, 6)).float()
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False  # padded documents
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        scores = model(feats).squeeze(-1).masked_fill(~mask, float("-inf"))
        order = rels.masked_fill(~mask, -1).argsort(dim=1, descending=True)
        s = scores.gather(1, order)
        lcse = torch.logcumsumexp(s.flip(1), dim=1).flip(1)  # -inf over the padded tail
        (lcse - s).sum(1).mean().backward()
        nw.step()
    a = first_bad(nw).anomaly
    assert a is not None and a.op is not None, a
    assert a.op.op == "aten.sub" and a.op.node == "SubBackward0", a.summary
    diag = top(nw)
    assert diag.code == "NW402", text(diag)
    assert "-inf - (-inf)" in diag.title, diag.title


class _LogThenNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.log(x)
        h = self.norm(x)  # the line the LayerNorm's op runs at
        return self.proj(h)


def test_an_op_of_a_torch_module_is_placed_at_the_line_that_called_it() -> None:
    """The replay of a torch module (LayerNorm, no code of the user's) found its op's line
    by walking up to the first user frame: the next module's call that triggered the
    replay. The line is where the parent's forward calls the module."""
    import inspect

    lines, first = inspect.getsourcelines(_LogThenNorm.forward)
    norm_line = first + next(i for i, ln in enumerate(lines) if "self.norm(x)" in ln)
    m = _LogThenNorm()
    x = torch.rand(2, 4)
    x[0, 1] = 0.0
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(m, postmortem=False):
        m(x).sum().backward()
    a = info.value.anomaly
    assert a is not None and a.op is not None
    chain = a.op.chain()
    norm = next(ev for ev in chain if "layer_norm" in ev.op)
    assert norm.source is not None and norm.source.endswith(f":{norm_line}"), norm.source
    assert norm.code == "h = self.norm(x)  # the line the LayerNorm's op runs at"


def test_an_inf_the_users_division_put_in_a_loss_input_is_the_division() -> None:
    """``logits / temperature`` with a temperature of 0 between the model and a watched
    BCEWithLogitsLoss: the loss's input holds -inf, the loss makes NaN of it. The graph
    below that input names the division (NW111), not a log of 0 (NW110)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 1))
    crit = nn.BCEWithLogitsLoss()
    x = torch.randn(16, 6)
    y = (x[:, :1] > 0).float()
    temperature = y.sum() - y.sum()
    with (
        pytest.raises(nanwatch.AnomalyError) as info,
        nanwatch.watch(model, crit, postmortem=False),
    ):
        crit(model(x) / temperature, y).backward()
    err = info.value
    assert err.diagnosis is not None and err.diagnosis.code == "NW111", err.diagnosis
    assert err.anomaly is not None and err.anomaly.op is not None
    assert err.anomaly.op.chain()[0].op.startswith("aten.div")
