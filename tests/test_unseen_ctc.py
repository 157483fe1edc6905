"""CTC from user testing: the log-probability table and the zeroed +inf loss of
``_ctc_loss`` are no hidden overflow (NW105); an MSE loss given a -inf target says the
infinity came in; CTCLoss fed raw logits (no log_softmax) is named by NW205."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

import nanwatch
from nanwatch.records import OpEvent, Phase, TensorStat
from nanwatch.rules._evidence import classify


class _Acoustic(nn.Module):
    def __init__(self, log_softmax: bool = True) -> None:
        super().__init__()
        self.out, self.log_softmax = nn.Linear(8, 6), log_softmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(x)
        return y.log_softmax(-1) if self.log_softmax else y


def _ctc_steps(zero_infinity: bool, target_lengths: list[int], mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    model, ctc = _Acoustic(), nn.CTCLoss(blank=0, zero_infinity=zero_infinity)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanwatch.NanwatchWarning)
        with nanwatch.watch(model, ctc, mode=mode) as nw:
            for _ in range(2):
                lp = model(torch.randn(10, 4, 8))  # (T, N, C)
                tg = torch.randint(1, 6, (4, 6))
                loss = ctc(lp, tg, torch.tensor([10, 10, 8, 4]), torch.tensor(target_lengths))
                loss.backward()
                nw.step()
    return nw


def _ctc_events(nw: nanwatch.Watcher) -> list[OpEvent]:
    return [ev for t in nw.history for ev in t.ops if "_ctc_loss" in ev.op]


def test_zeroed_impossible_ctc_sample_is_no_hidden_overflow() -> None:
    """Sample 3 has 6 labels in 4 frames: its loss is +inf, which zero_infinity=True zeroes.
    NW105 called it an overflow past float32's max and proposed .float()."""
    nw = _ctc_steps(True, [3, 5, 4, 6], "forensic")
    evs = _ctc_events(nw)
    assert evs and all(ev.born.strip() == "+inf" for ev in evs)
    assert evs[0].scalars.get("zero_infinity") == 1
    assert {classify(ev) for ev in evs} == {"log-zero"}
    assert "NW105" not in [d.code for d in nw.report.diagnoses]


def test_ctc_log_alpha_scratch_is_not_read() -> None:
    """log_alpha, the table _ctc_loss saves for its backward, is written only up to each
    sample's lengths: the rest is what the allocator held (1e31, +inf or NaN, run to run),
    and reading it made the classification of the same step differ with the tests run
    before it. A feasible batch has no CTC event at all."""
    nw = _ctc_steps(False, [3, 5, 4, 2], "forensic")
    assert _ctc_events(nw) == []
    assert not [d.code for d in nw.report.diagnoses]
    for ev in _ctc_events(_ctc_steps(True, [3, 5, 4, 6], "forensic")):
        assert [n for n, _ in ev.outputs] == ["output[0]"] or not ev.outputs


def _event(op: str, born: str, outputs: list[tuple[str, TensorStat]], **scalars: int) -> OpEvent:
    return OpEvent(
        op,
        Phase.FORWARD,
        "m",
        born,
        outputs[0][1],
        [("x", TensorStat(-2.0, 3.0, 8))],
        scalars=dict(scalars),
        outputs=outputs,
    )


def test_log_domain_outputs_classify_by_their_name_and_ctc_flag() -> None:
    loss = ("output[0]", TensorStat(7.0, math.inf, 4, posinf=1))
    alpha = ("output[1]", TensorStat(-math.inf, 3.0, 40, neginf=9))
    # +inf loss without zero_infinity: an impossible target, not a value past the max
    assert classify(_event("aten._ctc_loss.default", "+inf, -inf", [loss, alpha])) == "impossible"
    # an attention kernel's logsumexp of a row with every key masked: log 0
    out = ("output", TensorStat(-1.0, 1.0, 8))
    lse = ("logsumexp", TensorStat(-math.inf, 2.0, 4, neginf=1))
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert classify(_event(sdpa, "-inf", [out, lse])) == "log-zero"
    # a -inf outside the log table, or an exp past the max, stays what it was
    bad = ("output", TensorStat(-math.inf, 1.0, 8, neginf=1))
    assert classify(_event(sdpa, "-inf", [bad, lse])) != "log-zero"
    exp = ("output", TensorStat(1.0, math.inf, 8, posinf=1))
    assert classify(_event("aten.exp.default", "+inf", [exp])) == "overflow"


def test_mse_of_a_log_zero_target_says_the_inf_came_in_not_an_overflow() -> None:
    """log(f0) with unvoiced frames at 0: the op block said 'the squared differences
    overflow' though the target held -inf."""
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    f0 = 100 + 50 * torch.rand(6, 1)
    f0[4:] = 0.0
    nw = nanwatch.watch(m)
    raised = False
    try:
        with nw:
            nn.functional.mse_loss(m(torch.randn(6, 4)), torch.log(f0)).backward()
    except nanwatch.AnomalyError:
        raised = True
    assert raised
    mse = [e for t in nw.history for e in t.ops if "mse_loss" in e.op]
    assert mse
    why = str(mse[0].scalars.get("evidence"))
    assert "target held -inf, which came in" in why
    assert "overflow" not in why


def _raw_ctc(logits: torch.Tensor) -> list[nanwatch.Diagnosis]:
    ctc = nn.CTCLoss()
    tg = torch.randint(1, 6, (2, 4))
    with nanwatch.watch(ctc) as nw:
        loss = ctc(logits, tg, torch.tensor([12, 12]), torch.tensor([4, 4]))
        loss.backward()
        nw.step()
    return [d for d in nw.report.diagnoses if d.code == "NW205"]


def test_ctc_on_raw_logits_is_named_with_log_softmax_on_the_users_argument() -> None:
    torch.manual_seed(0)
    head = nn.Linear(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanwatch.NanwatchWarning)
        found = _raw_ctc(head(torch.randn(2, 12, 8)).transpose(0, 1))
    assert len(found) == 1
    d = found[0]
    assert "log-probabilities" in d.title and d.path == "CTCLoss"
    assert any("never above 0" in e for e in d.evidence)
    assert "loss = ctc(logits.log_softmax(-1), tg," in d.fix


def test_ctc_on_negative_unnormalized_scores_is_named_and_log_probs_are_not() -> None:
    torch.manual_seed(0)
    scores = (-0.1 - 0.8 * torch.rand(12, 2, 6)).requires_grad_()  # all < 0, rows sum > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanwatch.NanwatchWarning)
        found = _raw_ctc(scores)
        assert len(found) == 1 and "sum to at least" in found[0].evidence[0]
        ok = _raw_ctc(torch.randn(12, 2, 6).log_softmax(-1).requires_grad_())
    assert not ok
