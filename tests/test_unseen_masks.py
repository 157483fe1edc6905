"""Diagnoses for masks and losses found by user testing: BCELoss saturated on the right side
(silent), a fully padded sample in nn.MultiheadAttention's fused eval path and in sentinel
mode (NW402 with a key_padding_mask fix on the user's line), an additive mask of -1e9 cast
to float16 (NW402 names the cast), a KLDivLoss(log_target=True) given probabilities
(NW205), and the loss options the guard keeps for a fix that rewrites a loss call.

Each is checked on a tiny real model under ``nanwatch.watch`` on CPU, and every fix that
claims to be code is executed."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import code_lines, first_bad, top

# ---------------------------------------------------------------- NW201: right, not wrong


def test_bce_saturated_on_the_right_side_costs_nothing_and_is_silent() -> None:
    """p rounds to exactly 1.0 with target 1: that element costs 0, no element reaches the
    -100 clamp, and the loss is an ordinary 0.8: not the massive loss."""
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(2, 1), nn.Sigmoid())
    crit = nn.BCELoss()
    with nanwatch.watch(d, crit, ignore=["NW202"]) as nw:
        x = torch.randn(8, 2)
        x[0] = torch.tensor([40.0, 40.0])
        with torch.no_grad():
            d[0].weight.fill_(1.0)
            d[0].bias.zero_()
        p = d(x)
        loss = crit(p, torch.ones(8, 1))
        loss.backward()
        nw.step()
    assert int((p == 1).sum()) == 1 and 0.5 < loss.item() < 1.0
    assert [dg.code for dg in nw.history[0].diagnoses] == []


def test_bce_saturated_on_the_wrong_side_is_still_the_massive_loss() -> None:
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(2, 1), nn.Sigmoid())
    crit = nn.BCELoss()
    with nanwatch.watch(d, crit, ignore=["NW202"], on_anomaly="record") as nw:
        x = torch.randn(8, 2)
        x[0] = torch.tensor([40.0, 40.0])
        with torch.no_grad():
            d[0].weight.fill_(1.0)
            d[0].bias.zero_()
        y = torch.ones(8, 1)
        y[0] = 0.0
        loss = crit(d(x), y)
        loss.backward()
        nw.step()
    ds = [dg for dg in nw.history[0].diagnoses if dg.code == "NW201"]
    assert len(ds) == 1 and ds[0].severity == "error"
    assert "1 elements hit the log clamp at -100" in " | ".join(ds[0].evidence)


# ---------------------------------------------------------------- NW402: torch attention


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    h = torch.randn(3, 5, 16)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[:, 3:] = True
    pad[1] = True  # an empty sequence: every key masked
    return h, pad


def test_mha_fast_path_with_a_fully_padded_sample_is_nw402_and_its_fix_runs() -> None:
    """eval() + no_grad runs aten._native_multi_head_attention: the softmax is inside the
    fused kernel and the boolean mask is not recorded, but the NaN from finite inputs in an
    attention module is still a fully masked row."""
    attn = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    h, pad = _padded_batch()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(attn) as nw, torch.no_grad():
        out, _ = attn(h, h, h, key_padding_mask=pad, need_weights=False)  # noqa: RUF059 (raises)
    d = top(nw)
    assert d.code == "NW402" and d.op == "aten._native_multi_head_attention"
    assert "from finite inputs" in d.evidence[0]
    assert d.fix.splitlines()[:4] == [
        "key_padding_mask = pad.clone()",
        "empty = key_padding_mask.all(dim=-1)   # samples with no key to attend to (length 0)",
        "key_padding_mask[empty, 0] = False     # un-mask one key each: a finite, meaningless row",
        "out, _ = attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)",
    ]
    scope: dict[str, Any] = {"attn": attn, "h": h, "pad": pad, "torch": torch}
    with torch.no_grad():
        exec(code_lines(d.fix), scope)
    assert bool(torch.isfinite(scope["out"]).all())
    assert bool(pad[1].all())  # the user's own mask is left as it was


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        return self.head(a.mean(1))


def test_mha_in_sentinel_mode_gets_the_key_padding_mask_fix_not_the_hand_written_one() -> None:
    """Sentinel records only the root's call: the module that masked is named by the
    user's line, which passes a key_padding_mask."""
    model = Classifier()
    h, pad = _padded_batch()
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(model, mode="sentinel") as nw:
        model(h, pad).sum().backward()
        nw.step()
    d = top(nw)
    assert d.code == "NW402"
    assert "scores.masked_fill" not in d.fix
    assert "a, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask)" in d.fix
    scope: dict[str, Any] = {"self": model, "h": h, "pad": pad, "torch": torch}
    exec(code_lines(d.fix), scope)
    assert bool(torch.isfinite(scope["a"]).all())


# ---------------------------------------------------------------- NW402: a cast to -inf


class Fp16Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        mask = torch.zeros(pad.shape).masked_fill(pad, -1e9)  # float32: fine there
        scores = q @ k.transpose(1, 2) + mask[:, None, :].to(q.dtype)
        return scores.softmax(-1) @ x


def test_a_minus_1e9_mask_cast_to_float16_is_named_and_the_rewritten_line_runs() -> None:
    m = Fp16Attention().half()
    _, pad = _padded_batch()
    x = torch.randn(3, 5, 16, dtype=torch.float16)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(m) as nw:
        m(x, pad).float().sum().backward()
    d = top(nw)
    assert d.code == "NW402"
    cast = next(e for e in d.evidence if e.startswith("the -inf came from"))
    assert cast.startswith("the -inf came from the cast to float16 (aten._to_copy at ")
    assert cast.endswith(
        "the mask value -1e+09 is finite, but beyond float16's range (most negative -65504), so "
        "the cast made it -inf"
    )
    assert "the cast to float16 rounded it to -inf" in d.explanation
    line = d.fix.splitlines()[1]
    assert line == (
        "scores = q @ k.transpose(1, 2) + "
        "mask[:, None, :].clamp_min(torch.finfo(torch.float16).min).to(q.dtype)"
    )
    q, k = m.qk(x).chunk(2, -1)
    mask = torch.zeros(pad.shape).masked_fill(pad, -1e9)
    scope: dict[str, Any] = {"q": q, "k": k, "mask": mask, "torch": torch}
    exec(line, scope)
    assert bool(torch.isfinite(scope["scores"].softmax(-1)).all())


# ---------------------------------------------------------------- NW205: KL log target


def _kl_steps(use_module: bool, *, probabilities: bool) -> tuple[Any, list[Any], int]:
    torch.manual_seed(0)
    student, teacher = nn.Linear(10, 5), nn.Linear(10, 5)
    kl = nn.KLDivLoss(reduction="batchmean", log_target=True)
    line = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.watch(student, kl) as nw:
            for _ in range(3):
                x = torch.randn(16, 10)
                with torch.no_grad():
                    z = teacher(x)
                    t = z.softmax(-1) if probabilities else z.log_softmax(-1)
                logp = F.log_softmax(student(x), -1)
                line = _kl_steps.__code__.co_firstlineno + 16 + (0 if use_module else 2)
                if use_module:
                    loss = kl(logp, t)
                else:
                    loss = F.kl_div(logp, t, reduction="batchmean", log_target=True)
                loss.backward()
                nw.step()
    ours = [w for w in caught if issubclass(w.category, nanwatch.NanwatchWarning)]
    return nw, ours, line


@pytest.mark.parametrize(
    ("use_module", "fix"),
    [
        (True, "kl = nn.KLDivLoss(reduction='batchmean', log_target=False)"),
        (False, 'loss = F.kl_div(logp, t, reduction="batchmean", log_target=False)'),
    ],
)
def test_kl_div_log_target_given_probabilities_is_said_once_at_the_users_line(
    use_module: bool, fix: str
) -> None:
    nw, ours, line = _kl_steps(use_module, probabilities=True)
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert (ours[0].filename, ours[0].lineno) == (__file__, line)
    d = next(d for d in nw.history[0].diagnoses if d.code == "NW205")
    assert d.severity == "warning"
    assert d.title == "Probabilities where log-probabilities are expected"
    assert "with log_target=True; log-probabilities are never above 0" in d.evidence[0]
    assert d.fix.splitlines() == [
        f"{fix}  # the target is probabilities",
        "# or keep log_target=True and pass log-probabilities as t (F.log_softmax, not F.softmax)",
    ]


def test_kl_div_log_target_given_log_probabilities_is_silent() -> None:
    nw, ours, _ = _kl_steps(True, probabilities=False)
    assert ours == []
    assert all(not t.diagnoses for t in nw.history)


# ---------------------------------------------------------------- loss options for NW113


def test_an_all_ignored_batch_keeps_the_losses_options_for_the_fix() -> None:
    """A fix that rewrites the loss as F.cross_entropy(..., reduction='sum') must keep the
    criterion's label_smoothing and class weights: the guard writes them, in the user's
    names, into the loss note."""
    m = nn.Linear(4, 3)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1, weight=torch.ones(3))
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(m, crit) as nw:
        loss = crit(m(torch.randn(5, 4)), torch.full((5,), -100))
        loss.backward()
        nw.step()
    notes = [n for n in first_bad(nw).notes if n.kind == "loss_input"]
    assert [n.data.get("loss_options") for n in notes] == [
        "weight=crit.weight, label_smoothing=0.1"
    ]


def test_a_hand_written_masked_fill_is_fixed_on_the_users_own_line_and_runs() -> None:
    """The template fix 'scores.masked_fill(mask, finfo.min)' dropped the user's ~ and
    [:, None, :]: pasted, it crashed on shapes and masked the kept keys."""
    torch.manual_seed(0)
    proj = nn.Linear(8, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False  # an empty sequence: no key to keep
    with nanwatch.watch(proj, on_anomaly="record", postmortem=False, mode="forensic") as nw:
        h = proj(torch.randn(2, 5, 8))
        scores = h @ h.transpose(1, 2)
        scores.masked_fill_(~mask[:, None, :], float("-inf"))
        torch.softmax(scores, dim=-1).sum().backward()
        nw.step()
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW402")
    line = d.fix.splitlines()[0].split("  #")[0].strip()
    assert line == "scores.masked_fill_(~mask[:, None, :], torch.finfo(scores.dtype).min)"
    scores = torch.randn(2, 5, 5)
    exec(line, {"torch": torch, "scores": scores, "mask": mask})
    assert torch.isfinite(torch.softmax(scores, dim=-1)).all()
    assert (scores[0] > -1e30).all()  # the kept keys of sample 0 stay unmasked
