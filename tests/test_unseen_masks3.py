"""Masks and -inf, unseen cases (3): a finite mask constant that overflows the dtype
(``* -1e9`` in float16) is named as the overflow and the user's line is fixed with
finfo.min; NW202's fix keeps the user's BCE arguments and names their sigmoid; under
``nanwatch run`` the advice is the forensic command, not ``nw.replay``; a logsumexp over a
row that is all -inf (a hand-written CTC lattice) gets its own NaN-gradient diagnosis."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch import cli
from nanwatch.report import Report

torch.set_num_threads(1)


def diagnosis(nw: Any, code: str) -> Any:
    return next(d for t in nw.history for d in t.diagnoses if d.code == code)


# ------------------------------------------------- -1e9 is -inf in float16


class HalfAttn(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = q @ k.transpose(-1, -2)
        ext = (1.0 - keep[:, None, :].to(scores.dtype)) * -1e9
        scores = scores + ext
        return scores.softmax(-1)


def test_a_mask_constant_past_float16s_max_is_named_and_replaced_by_finfo_min() -> None:
    torch.manual_seed(0)
    model = HalfAttn().half()
    keep = torch.ones(2, 4)
    keep[1] = 0  # an empty sample: every key masked
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(torch.randn(2, 4, 8).half(), keep)
        nw.step()
    d = diagnosis(nw, "NW402")
    said = " ".join(d.evidence) + d.explanation
    assert "-1e9 is -inf in float16 (max 65504)" in said
    assert "Masking with -inf is fine" not in d.explanation
    first = d.fix.splitlines()[0]
    assert first.startswith(
        "ext = (1.0 - keep[:, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min"
    )
    assert "masked_fill" not in d.fix  # a float keep-mask: masked_fill(mask, ...) would crash
    fixed = first.split("   #", 1)[0].strip()  # the fix runs and the row stays finite
    scores = torch.zeros(2, 4, 4, dtype=torch.float16)
    ns: dict[str, Any] = {"keep": keep, "scores": scores, "torch": torch}
    exec(fixed, ns)
    assert torch.isfinite((scores + ns["ext"]).softmax(-1)).all()


# ------------------------------------------------- NW202 keeps the user's BCE


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(z))


def test_sigmoid_bce_fix_keeps_the_functional_call_and_its_reduction() -> None:
    torch.manual_seed(0)
    dec = Decoder()
    x = (torch.rand(3, 6) > 0.5).float()
    with nanwatch.watch(dec, on_anomaly="record") as nw:
        x_hat = dec(torch.randn(3, 4))
        recon = F.binary_cross_entropy(x_hat, x, reduction="sum") / x.size(0)
        recon.backward()
        nw.step()
    fix = diagnosis(nw, "NW202").fix
    assert fix.splitlines()[0].startswith("return self.fc(z)")  # first: the sigmoid goes
    first = fix.splitlines()[1]
    assert first.startswith(
        'recon = F.binary_cross_entropy_with_logits(x_hat, x, reduction="sum") / x.size(0)'
    )
    assert "torch.sigmoid" in fix and "nn.Sigmoid" not in fix
    assert not first.rstrip().endswith(":")  # the one-line form is a whole statement


def test_sigmoid_bce_fix_rewrites_the_users_bceloss_module_line() -> None:
    torch.manual_seed(0)
    dec = Decoder()
    x = (torch.rand(3, 6) > 0.5).float()
    bce = nn.BCELoss(reduction="sum", weight=torch.ones(6))
    with nanwatch.watch(dec, on_anomaly="record") as nw:
        loss = bce(dec(torch.randn(3, 4)), x)
        loss.backward()
        nw.step()
    first = diagnosis(nw, "NW202").fix.splitlines()[1]  # [0] drops the sigmoid
    assert first.startswith('bce = nn.BCEWithLogitsLoss(reduction="sum", weight=torch.ones(6))')
    assert "criterion = nn.BCEWithLogitsLoss()" not in diagnosis(nw, "NW202").fix


# ------------------------------------------------- nanwatch run: the forensic command

_SCRIPT = """
import torch
from torch import nn

class Radial(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)
    def forward(self, xy):
        r = torch.sqrt((xy * 1.0).pow(2).sum(-1, keepdim=True))
        return self.fc(torch.cat([xy * 1.0, r], -1))

model = Radial()
xy = torch.zeros(4, 2, requires_grad=True)
out = model(xy)
with torch.no_grad():
    xy.add_(0.5)  # the input buffer refilled in place before backward: no exact replay
out.sum().backward()
"""
# (watch mode names a sqrt in a root's own code by replaying its backward on the call's
# inputs; the in-place refill above makes that replay impossible, so the advice is needed)


def test_under_nanwatch_run_the_advice_is_the_forensic_command(tmp_path: Path) -> None:
    script = tmp_path / "pinn.py"
    script.write_text(textwrap.dedent(_SCRIPT), encoding="utf-8")
    reports = tmp_path / "reports"
    args = ["run", "--on-anomaly", "record", "--report-dir", str(reports), str(script)]
    assert cli.main([*args, "--steps", "5"]) == 0
    report = Report.load(reports / "pinn.json")
    d = next(d for d in report.diagnoses if d.code == "NW100")
    assert d.fix.splitlines()[0] == f"nanwatch run --mode forensic {script} --steps 5"
    said = d.fix + " ".join(d.evidence)
    assert "nw.replay" not in said and "def step_fn" not in said
    assert "nanwatch run --mode forensic" in " ".join(d.evidence)


def test_in_the_users_process_the_advice_stays_a_replay() -> None:
    ns: dict[str, Any] = {}
    exec(textwrap.dedent(_SCRIPT).split("out = model(xy)")[0], ns)
    model, xy = ns["model"], ns["xy"]
    with nanwatch.watch(model, on_anomaly="record") as nw:
        out = model(xy)
        with torch.no_grad():
            xy.add_(0.5)
        out.sum().backward()
        nw.step()
    d = diagnosis(nw, "NW100")
    assert "nw.replay(step_fn)" in d.fix and "nanwatch run" not in d.fix


# ------------------------------------------------- logsumexp over all -inf


def lattice_loss(logp: torch.Tensor) -> torch.Tensor:
    NEG = float("-inf")
    alpha = torch.cat([logp[0, :1], torch.full((3,), NEG)])
    for t in range(1, logp.shape[0]):
        prev = torch.cat([torch.tensor([NEG]), alpha[:-1]])
        alpha = torch.logsumexp(torch.stack([alpha, prev]), 0) + logp[t]
    return -alpha[1]  # state 3 is never reached in 2 steps: its row stays -inf


def test_logsumexp_over_an_all_neg_inf_row_names_its_nan_gradient() -> None:
    torch.manual_seed(0)
    head = nn.Linear(5, 4)
    with nanwatch.watch(head, mode="forensic", on_anomaly="record") as nw:
        logp = head(torch.randn(3, 5)).log_softmax(-1)
        lattice_loss(logp).backward()
        nw.step()
    d = diagnosis(nw, "NW402")
    assert "logsumexp" in d.title
    said = " ".join(d.evidence) + d.explanation
    assert "exp(-inf - (-inf))" in said and "-inf everywhere" in said
    assert d.fix.splitlines()[0].startswith("NEG = -1e30")
    assert "F.ctc_loss" in d.fix and "clamp(lo + eps" not in d.fix
    assert not any(x.code == "NW100" for t in nw.history for x in t.diagnoses)
