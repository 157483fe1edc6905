"""Guards from user testing: a NaN or inf BCE target is bad data named where it is made, not
a target to scale (NW505); a CTC target its input cannot align (+inf, no error in torch)
follows on_anomaly="warn" so a loop that skips non-finite losses runs watched (NW516); ids
on both sides of an embedding table get no bigger table (NW513); CTCLoss(blank=C) with C
outputs is stopped with blank and C named (NW501); NW405 for a forward that wrote its own
buffers after reading them says the replay started from the values written."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.errors import GuardError


@pytest.fixture(autouse=True)
def no_function_mode_left() -> Iterator[None]:
    yield
    assert torch._C._len_torch_function_stack() == 0, "a TorchFunctionMode was left active"


def stopped(*modules: nn.Module, call: Any, **kw: Any) -> GuardError:
    kw = {"postmortem": False, "functional_guards": True, **kw}
    with pytest.raises(GuardError) as info, nanwatch.watch(*modules, **kw):
        call()
    return info.value


# ------------------------------------------------------------- 1. NaN target: bad data
def _bce_nan(logits_loss: bool) -> tuple[GuardError, dict[str, Any]]:
    torch.manual_seed(0)
    logits = torch.randn(4)
    lo, hi = torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([2.0, 0.0, 4.0, 4.0])
    ns: dict[str, Any] = {"F": F, "torch": torch, "logits": logits}

    def call() -> None:
        ctr = lo / hi  # 0/0 at position 1
        ns["ctr"] = ctr
        if logits_loss:
            F.binary_cross_entropy_with_logits(logits, ctr)
        else:
            F.binary_cross_entropy(logits.sigmoid(), ctr)

    return stopped(nn.Identity(), call=call), ns


@pytest.mark.parametrize("logits_loss", [True, False])
def test_nan_bce_target_is_bad_data_named_where_it_is_made(logits_loss: bool) -> None:
    err, ns = _bce_nan(logits_loss)
    assert (err.code, err.check) == ("NW505", "target-nonfinite")
    assert "target holds NaN at 1 position (of 4)" in str(err)
    assert "ctr is made at test_unseen_guards9.py:" in str(err)
    assert "ctr = lo / hi" in str(err)
    assert "scale" not in err.fix and "unbounded below" not in err.diagnosis.explanation
    assert "0/0" in err.diagnosis.explanation
    assert err.positions == ((1,),)
    assert err.fix.startswith("valid = torch.isfinite(ctr)")
    if logits_loss:  # the fix pastes and runs, finite
        first, second = err.fix.splitlines()
        exec(first, ns)
        assert second == "F.binary_cross_entropy_with_logits(logits[valid], ctr[valid])"
        assert torch.isfinite(eval(second, ns))
        assert "does not check its targets" in err.diagnosis.explanation
    else:
        assert isinstance(err, RuntimeError)  # torch's own error for BCELoss
        assert "rejects it" in err.diagnosis.explanation


def test_finite_bce_target_outside_0_1_keeps_its_scale_fix() -> None:
    t = torch.tensor([0.0, 255.0, 255.0, 0.0])
    err = stopped(nn.Identity(), call=lambda: F.binary_cross_entropy_with_logits(torch.zeros(4), t))
    assert (err.code, err.check) == ("NW505", "target-range")
    assert "outside [0, 1]" in str(err) and "t / 255" in err.fix


# ------------------------------------------- 2. CTC +inf: on_anomaly="warn" lets it run
def _short_ctc() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    lp = torch.randn(10, 2, 6).log_softmax(-1)
    tgt = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    return lp, tgt, torch.tensor([10, 3]), torch.tensor([4, 4])


def test_ctc_too_short_under_warn_runs_and_warns_so_a_loop_can_skip_it() -> None:
    ctc = nn.CTCLoss(reduction="sum")
    # the call runs; the +inf loss it makes is the step's anomaly, and the guard's note is
    # its cause: the anomaly's warning leads with it (not a generic non-finite value)
    warned = pytest.warns(RuntimeWarning, match="NW516 error: CTC target longer than its")
    with warned, nanwatch.watch(ctc, on_anomaly="warn", postmortem=False) as nw:
        loss = ctc(*_short_ctc())
        assert not math.isfinite(loss.item())  # what the skipping loop tests
        nw.step()
    (note,) = [n for t in (nw.trace, *nw.history) for n in t.notes if n.kind == "guard"]
    assert note.data["raised"] is False and note.data["code"] == "NW516"
    (d,) = [d for t in (nw.trace, *nw.history) for d in t.diagnoses if d.code == "NW516"]
    assert d.severity == "error"
    assert [t.diagnoses[0].code for t in nw.history] == ["NW516"]
    assert any("on_anomaly='warn': noted, and the call ran" in e for e in d.evidence)
    # raise (the default) still stops it before the kernel; zero_infinity never does
    stops = pytest.raises(GuardError, match="longer than its input can align")
    with stops, nanwatch.watch(ctc, postmortem=False):
        ctc(*_short_ctc())
    zi = nn.CTCLoss(reduction="sum", zero_infinity=True)
    with nanwatch.watch(zi, postmortem=False):
        assert math.isfinite(zi(*_short_ctc()).item())


def test_a_silently_wrong_input_is_stopped_under_warn_too() -> None:
    """A 0/255 target gives a finite, wrong loss: nothing downstream would say it."""
    with pytest.raises(GuardError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.watch(nn.Identity(), on_anomaly="warn", postmortem=False):
            F.binary_cross_entropy_with_logits(torch.zeros(2), torch.tensor([0.0, 255.0]))
    assert info.value.code == "NW505"


# ------------------------------------------------ 3. ids on both sides: no bigger table
class _MuLaw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 4)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.emb(q)


def test_ids_spread_below_0_and_past_the_table_get_no_bigger_table() -> None:
    m = _MuLaw()
    q = torch.tensor([[-235, -12, 40, 300, 493]])
    err = stopped(m, call=lambda: m(q))
    assert err.code == "NW513" and err.module == "emb"
    assert "min -235, max 493" in str(err) and "cannot hold a negative id" in str(err)
    assert "not a bigger table" in err.fix and "row for every id" not in err.fix
    assert "before quantizing" in err.fix


# ----------------------------------------------------- 4. CTC blank outside the classes
@pytest.mark.parametrize("functional", [False, True])
def test_ctc_blank_equal_to_the_number_of_outputs_is_stopped(functional: bool) -> None:
    torch.manual_seed(0)
    lp = torch.randn(8, 2, 10).log_softmax(-1)
    tgt, il, tl = torch.randint(0, 10, (2, 3)), torch.tensor([8, 8]), torch.tensor([3, 3])
    ctc = nn.CTCLoss(blank=10)
    if functional:
        err = stopped(nn.Identity(), call=lambda: F.ctc_loss(lp, tgt, il, tl, blank=10))
    else:
        err = stopped(ctc, call=lambda: ctc(lp, tgt, il, tl))
    assert (err.code, err.check) == ("NW501", "ctc-blank-range")
    assert "blank index 10 is outside the 10 classes" in str(err)
    assert "give the model 11 outputs" in err.fix and "blank=0" in err.fix
    assert isinstance(err, RuntimeError)  # torch's 'blank must be in label range'


# -------------------------------------------- 5. NW405: state the forward itself overwrote
class _SelfWriting(nn.Module):
    """Reads ``scale``, then writes it in place: 1 / 0 on the first call, 1 on the second."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("count", torch.zeros(3))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = z * self.scale.clone()
        with torch.no_grad():
            self.scale.copy_(1 / self.count)
            self.count.add_(1)
        return out


def test_module_state_overwritten_by_its_forward_says_the_replay_ran_clean() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), _SelfWriting())
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            m(torch.randn(4, 3)).sum().backward()
            nw.step()
    trace = nw.first_bad_step
    assert trace is not None
    (d,) = [d for d in trace.diagnoses if d.code == "NW405"]
    text = " ".join(d.evidence)
    assert "holds" not in text and "made it again" not in text
    assert "ran clean" in text and "started from the values the forward wrote" in text
    assert "read its own buffers before writing them in place" in d.explanation
    assert "outside the forward" not in d.explanation
    assert "assert torch.isfinite(" in d.fix


def _masked_actions(log_prob: str, *, defer: bool = False, policy: str = "record") -> Any:
    """A policy whose logits the training loop masks with -inf, and actions from a stale
    buffer: row 0 took action 3, which the mask forbids. No guard sees a hand-written
    gather or a Categorical's log_prob; F.cross_entropy's guard does."""
    torch.manual_seed(0)
    pol = nn.Linear(6, 4)
    legal = torch.ones(16, 4, dtype=torch.bool)
    legal[:, 3] = False
    a = torch.randint(0, 3, (16,))
    a[0] = 3
    adv = torch.randn(16)
    nw = nanwatch.watch(pol, on_anomaly=policy, postmortem=False)
    nw._defer_cpu = defer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nw:
            logits = pol(torch.randn(16, 6)).masked_fill(~legal, float("-inf"))
            if log_prob == "cross_entropy":
                loss = F.cross_entropy(logits, a)
            else:
                if log_prob == "gather":
                    logp = torch.log_softmax(logits, -1).gather(1, a[:, None]).squeeze(1)
                else:
                    logp = torch.distributions.Categorical(logits=logits).log_prob(a)
                loss = -(logp * adv).mean()
            loss.backward()
            nw.step()
    return nw


def test_a_noted_target_logit_of_minus_inf_is_the_cause_of_the_inf_loss_it_lets_run() -> None:
    # under "warn" the guard notes it and the call runs; the +inf loss is the anomaly, and
    # the note names its cause
    nw = _masked_actions("cross_entropy", policy="warn")
    top = nw.history[0].diagnoses[0]
    assert top.code == "NW518" and top.severity == "error"
    assert all(d.code != "NW100" for d in nw.history[0].diagnoses)


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("log_prob", ["gather", "categorical"])
def test_a_gathered_log_probability_of_a_masked_action_is_named_from_the_graph(
    log_prob: str, defer: bool
) -> None:
    d = _masked_actions(log_prob, defer=defer).history[0].diagnoses[0]
    assert d.code == "NW518" and d.severity == "error"
    assert d.title == "Gathered log-probability is -inf: the index selects a masked entry"
    said = "\n".join(d.evidence)
    assert "picked -inf in 1 of 16 rows" in said
    assert "<- maskedfill: entries a mask set to -inf" in said
    assert "legal.gather(1, a[:, None])" in d.fix


def test_gathers_that_pick_finite_entries_say_nothing() -> None:
    from nanwatch.ops import graph_selections

    x = torch.tensor([[0.0, float("-inf")], [0.0, 0.0]], requires_grad=True)
    ok = torch.log_softmax(x, 1).gather(1, torch.tensor([[0], [1]]))
    assert graph_selections(ok.grad_fn) == []
    bad = torch.log_softmax(x, 1).gather(-1, torch.tensor([[1], [0]]))  # dim -1: saved unsigned
    (sel,) = graph_selections(bad.grad_fn)
    assert sel["picked"] == {"-inf": 1} and sel["dim"] == 1 and sel["rows"] == 2
