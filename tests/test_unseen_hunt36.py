"""Classic NaN traps, run as a user runs them. A log-softmax written by hand,
``logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))``, whose exp overflows: the
model returns -inf (``x - log(inf)``) and ``F.nll_loss`` makes the loss +inf. The first
non-finite value is the exp's +inf, born in the model's forward: the first anomaly names
that module and op (it said "+inf born on the way to the loss, outside every watched
module's output"), in both modes, and the diagnosis's own fix trains finite. A -inf made
as one (a log of 0) and turned into +inf by the loss stays the loss code's. An
nn.MultiheadAttention given a key_padding_mask that masks a whole sequence: sentinel names
the attention module the NaN was born in, inside the root, as watch mode does (it named
the root), and the fix, run as the forward's code, trains finite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)

MODES = ["watch", "sentinel"]

_HAND_WRITTEN = "return logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))"


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        return logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(16, 10) * 400.0  # unnormalized features: logits in the hundreds
    return x, torch.randint(0, 5, (16,))


def _train(model: nn.Module, mode: str, steps: int = 2) -> nanwatch.Watcher:
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(steps):
            F.nll_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


def _model() -> Classifier:
    torch.manual_seed(0)
    return Classifier()


@pytest.mark.parametrize("mode", MODES)
def test_a_hand_written_log_softmax_overflow_is_born_in_the_model_not_the_loss(
    mode: str,
) -> None:
    nw = _train(_model(), mode)
    a = nw.first_anomaly
    assert a is not None and a.step == 0
    assert (a.path, a.origin) == ("Classifier", "module"), a.summary
    assert a.summary.startswith(
        "+inf born in the forward of Classifier (Classifier), which turned it into -inf in "
        "its output; it became +inf in (loss) (forward, output) [op aten.exp.default at "
    ), a.summary
    assert "on the way to the loss" not in a.summary
    d = nw.report.diagnoses[0]
    assert (d.code, d.path, d.op, d.step) == ("NW101", "Classifier", "aten.exp", 0), d.headline
    first = d.fix.splitlines()[0].split("  #")[0].strip()
    assert first == "return logits - torch.logsumexp(logits, -1, keepdim=True)", d.fix

    # the diagnosis's own line, in place of the hand-written one, trains finite
    fixed = _model()
    scope: dict[str, object] = {"torch": torch}
    exec(f"def forward(self, x):\n    logits = self.net(x)\n    {first}\n", scope)
    fixed.forward = scope["forward"].__get__(fixed)  # type: ignore[attr-defined]
    again = _train(fixed, mode)
    assert again.first_anomaly is None and not again.report.diagnoses


class LogProbs(nn.Module):
    """Log-probabilities of a softmax that underflows: log(0) = -inf, made as one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.fc(x), dim=-1))


@pytest.mark.parametrize("mode", MODES)
def test_a_log_of_zero_the_loss_turned_into_inf_stays_the_loss_codes(mode: str) -> None:
    torch.manual_seed(0)
    model = LogProbs()
    nw = _train(model, mode, steps=1)
    a = nw.first_anomaly
    assert a is not None and a.path == "(loss)", a.summary
    assert " born on the way to the loss, " in a.summary, a.summary
    assert "from -inf first seen in LogProbs (forward, output)" in a.summary
    assert a.op is not None and a.op.chain()[0].op == "aten.log.default"


class Encoder(nn.Module):
    """A token classifier over padded sequences; one sequence of the batch is all padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        pad = tokens == 0
        out, _ = self.attn(h, h, h, key_padding_mask=pad)
        return self.head(out.mean(1))


def _encode(model: nn.Module, mode: str) -> nanwatch.Watcher:
    torch.manual_seed(1)
    tokens = torch.randint(1, 50, (4, 6))
    tokens[1, 3:] = 0
    tokens[2] = 0  # an empty sequence: every key of its rows is masked
    y = torch.randint(0, 3, (4,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            F.cross_entropy(model(tokens), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", MODES)
def test_a_whole_sequence_masked_in_attention_names_the_attention_in_both_modes(
    mode: str,
) -> None:
    torch.manual_seed(0)
    nw = _encode(Encoder(), mode)
    a = nw.first_anomaly
    assert a is not None and a.step == 0 and a.path == "attn", a.summary
    assert a.summary.startswith("-inf born in the forward of attn (MultiheadAttention)")
    assert "(then NaN) [op aten.masked_fill_.Scalar at " in a.summary, a.summary
    if mode == "sentinel":  # seen in the root's output, born in the child
        assert ", inside Encoder; first seen in Encoder (forward, output)" in a.summary
    d = nw.report.diagnoses[0]
    assert (d.code, d.path, d.op) == ("NW402", "attn", "aten._softmax"), d.headline

    # the diagnosis's own lines, as the forward's code, train finite
    torch.manual_seed(0)
    fixed = Encoder()
    body = "\n".join(f"    {line}" for line in d.fix.splitlines())
    scope: dict[str, object] = {}
    exec(
        "def forward(self, tokens):\n    h = self.emb(tokens)\n    pad = tokens == 0\n"
        f"{body}\n    return self.head(out.mean(1))\n",
        scope,
    )
    fixed.forward = scope["forward"].__get__(fixed)  # type: ignore[attr-defined]
    again = _encode(fixed, mode)
    assert again.first_anomaly is None and not again.report.diagnoses
