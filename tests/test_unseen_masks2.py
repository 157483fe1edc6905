"""NW402, unseen cases (2): an inverted key_padding_mask (a tokenizer's attention_mask, 1 =
real token, passed where True means IGNORE) gets the inversion, not an un-masked key; a
softmax over choices (a task's allowed experts) with every choice masked is not called an
attention row; the hidden-NaN fix names only what the user's function has."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Normal

import nanwatch

torch.set_num_threads(1)


def code_lines(fix: str) -> str:
    return "\n".join(line for line in fix.splitlines() if not line.lstrip().startswith("#"))


def top(nw: Any) -> Any:
    return next(d for t in nw.history for d in t.diagnoses if d.code == "NW402")


# ------------------------------------------------- an inverted key_padding_mask


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x: torch.Tensor, kpm: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        a, _ = self.attn(h, h, h, key_padding_mask=kpm)
        return x + a


class Classifier(nn.Module):
    def __init__(self, inverted: bool) -> None:
        super().__init__()
        self.inverted = inverted
        self.embed = nn.Embedding(50, 16, padding_idx=0)
        self.block = Block()
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kpm = attention_mask.bool() if self.inverted else attention_mask == 0
        x = self.block(self.embed(ids), kpm)
        m = attention_mask.unsqueeze(-1).float()
        return self.head((x * m).sum(1) / m.sum(1))


def _batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = torch.tensor(lengths)
    am = (torch.arange(int(n.max()))[None] < n[:, None]).long()
    return torch.randint(1, 50, am.shape, generator=g) * am, am


def _run_classifier(inverted: bool, lengths: list[int]) -> tuple[Classifier, Any]:
    torch.manual_seed(0)
    model = Classifier(inverted)
    ids, am = _batch(lengths)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        model(ids, am).sum().backward()
        nw.step()
    return model, nw


def test_an_inverted_key_padding_mask_is_named_and_its_fix_inverts_it() -> None:
    """The old fix un-masked key 0 of the 'empty' samples: the NaN went away and every real
    token stayed masked. The full-length samples are the fully masked ones here."""
    model, nw = _run_classifier(True, [8, 5, 3, 8, 6, 4, 8, 7])
    d = top(nw)
    assert d.path == "block.attn" and d.op == "aten._softmax"
    ev = d.evidence[0]
    assert "looks inverted" in ev and "True at the keys to IGNORE" in ev
    assert "full-length ones (no padding)" in ev and "38% of the samples" in ev
    first = d.fix.splitlines()[0].split("  #")[0].strip()
    assert first == "a, _ = self.attn(h, h, h, key_padding_mask=~kpm)"
    assert "empty" not in d.fix and "length 0" not in d.fix
    # pasted into Block.forward: the padding is masked, the real tokens are not
    ids, am = _batch([8, 5, 3, 8, 6, 4, 8, 7])
    h = model.block.ln(model.embed(ids))
    scope: dict[str, Any] = {"self": model.block, "h": h, "kpm": am.bool(), "torch": torch}
    exec(code_lines(d.fix), scope)
    want, _ = model.block.attn(h, h, h, key_padding_mask=am == 0)
    assert torch.equal(scope["a"], want)


def test_a_tokenizer_attention_mask_passed_as_is_gets_attention_mask_eq_0() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    x = torch.randn(2, 4, 8)
    with pytest.raises(nanwatch.AnomalyError), nanwatch.watch(mha, postmortem=False) as nw:
        out, w = mha(x, x, x, key_padding_mask=attention_mask.bool())  # noqa: RUF059
    d = top(nw)
    assert "attention_mask.bool() is a tokenizer's attention_mask" in d.evidence[0]
    first = d.fix.splitlines()[0].split("  #")[0].strip()
    assert first == "out, w = mha(x, x, x, key_padding_mask=(attention_mask == 0))"
    scope: dict[str, Any] = {"mha": mha, "x": x, "attention_mask": attention_mask}
    exec(code_lines(d.fix), scope)
    assert bool(torch.isfinite(scope["out"]).all())
    assert float(scope["w"][1, :, 2:].detach().abs().max()) == 0.0  # padding: no weight


def test_a_right_key_padding_mask_stays_silent() -> None:
    _, nw = _run_classifier(False, [8, 5, 3, 8, 6, 4, 8, 7])
    assert not [d for t in nw.history for d in t.diagnoses]


def test_a_right_mask_with_an_empty_sample_keeps_the_empty_sample_fix() -> None:
    """A genuinely empty sequence in a dynamically padded batch is not an inversion."""
    _, nw = _run_classifier(False, [8, 5, 0, 7, 6, 4, 8, 7])
    d = top(nw)
    assert "looks inverted" not in " | ".join(d.evidence)
    assert "~kpm" not in d.fix
    assert "empty = key_padding_mask.all(dim=-1)" in d.fix


# ------------------------------------------------- a softmax over choices, not attention


class TaskMoE(nn.Module):
    def __init__(self, complete: bool, d: int = 16, n_experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(n_experts)])
        allowed = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]])
        if not complete:
            allowed[3] = 0  # a new task whose row of the table was left empty
        self.register_buffer("allowed", allowed.bool())

    def forward(self, x: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        logits = self.router(x).masked_fill(~self.allowed[task], float("-inf"))
        gates = logits.softmax(-1)
        outs = torch.stack([e(x) for e in self.experts], 1)
        return (gates.unsqueeze(-1) * outs).sum(1)


def _run_moe(complete: bool) -> tuple[TaskMoE, torch.Tensor, Any]:
    torch.manual_seed(0)
    moe = TaskMoE(complete)
    x, task = torch.randn(16, 16), torch.arange(16) % 4
    with nanwatch.watch(moe, on_anomaly="record", postmortem=False) as nw:
        moe(x, task).pow(2).mean().backward()
        nw.step()
    return moe, task, nw


def test_a_router_softmax_with_every_expert_masked_is_no_valid_choice() -> None:
    """It was 'Fully masked attention row ... (an empty sequence, length 0)', and the
    finfo.min fix silently sent the task's tokens to the experts it forbids."""
    moe, task, nw = _run_moe(False)
    d = top(nw)
    assert d.path == "TaskMoE" and d.op == "aten._softmax"
    assert d.title == "Fully masked softmax row: no valid choice left"
    words = " ".join([d.title, d.explanation, d.fix, *d.evidence]).lower()
    assert "attention" not in words and "length 0" not in words and "sequence" not in words
    assert "at least one allowed entry" in d.explanation
    assert "finfo" not in d.fix
    lines = d.fix.splitlines()
    assert lines[0].startswith('assert self.allowed[task].any(dim=-1).all(), "a row with')
    assert lines[1] == 'logits = self.router(x).masked_fill(~self.allowed[task], float("-inf"))'
    assert "each row keeps at least one allowed entry" in lines[2]
    with pytest.raises(AssertionError):  # the check finds the empty row of the table
        exec(lines[0], {"self": moe, "task": task})
    exec(lines[0], {"self": TaskMoE(True), "task": task})


def test_a_router_with_every_task_allowed_an_expert_stays_silent() -> None:
    _, _, nw = _run_moe(True)
    assert not [d for t in nw.history for d in t.diagnoses]


# ------------------------------------------------- the hidden-NaN fix in the user's names


@pytest.mark.parametrize("mode", ["watch", "forensic"])
def test_the_hidden_nan_fix_names_only_what_the_users_function_has(mode: str) -> None:
    """The template's second and third lines used ``p``, which the user's code lacks."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    x, y = torch.randn(16, 4), torch.randn(16)
    y[5] = float("nan")
    mask = ~torch.isnan(y)
    with (
        pytest.raises(nanwatch.AnomalyError),
        nanwatch.watch(net, mode=mode, postmortem=False) as nw,
    ):
        out = net(x)
        lp = Normal(out[:, 0], F.softplus(out[:, 1]) + 1e-3, validate_args=False).log_prob(y)
        loss = -torch.where(mask, lp, torch.zeros_like(lp)).sum() / mask.sum()
        loss.backward()
        nw.step()
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW407")
    assert d.title.startswith("NaN hidden by a mask")
    lines = d.fix.splitlines()
    assert lines[0].startswith("y = torch.nan_to_num(y)")
    assert all("p - y" not in line and "p[mask]" not in line for line in lines), d.fix
    scope: dict[str, Any] = {"torch": torch, "y": y.clone()}
    exec(code_lines(d.fix), scope)
    assert bool(torch.isfinite(scope["y"]).all())
