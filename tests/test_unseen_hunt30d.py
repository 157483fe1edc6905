"""Exploding gradients whose cause the trace already shows: a learning rate above gradient
descent's stable limit (the gradient norm multiplied by about the same factor at every
update, the loss rising with it), named with the optimizer's lr and a lower one that
works; and a growth that began with a jump the lr does not explain, not blamed on it."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.stats import HostRead

torch.set_num_threads(1)


class _LSTMReg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _train_lstm(lr: float, mode: str, steps: int) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net, criterion = _LSTMReg(), nn.MSELoss()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    with nanwatch.watch(net, criterion, mode=mode, on_anomaly="record") as nw:
        for _ in range(steps):
            x, y = torch.randn(4, 10, 4), torch.randn(4, 1) * 1000
            criterion(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
            if nw.first_anomaly is not None:
                break
    return nw


def _suggested_lr(fix: str) -> float:
    m = re.search(r'g\["lr"\] = ([0-9.e+-]+)', fix)
    assert m is not None, fix
    return float(m.group(1))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_gradients_that_multiply_with_each_sgd_update_name_the_lr(mode: str) -> None:
    nw = _train_lstm(1e4, mode, 6)
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW303")
    said = " ".join(d.evidence)
    assert "3 updates of SGD lr 10000" in said, d.evidence
    assert "the loss rose from" in said, d.evidence
    assert "(lr 10000 × gradient norm" in said, d.evidence
    assert "learning rate is about" in d.explanation, d.explanation
    assert d.fix.startswith('for g in opt.param_groups: g["lr"] = '), d.fix
    assert "# was 10000 (SGD)" in d.fix, d.fix
    lr = _suggested_lr(d.fix)
    assert lr < 1e4 / 1000, d.fix
    # at the lr it suggests the gradients stop multiplying: no inf, no NaN, no growth
    nw = _train_lstm(lr, mode, 8)
    assert nw.first_anomaly is None
    norms = [t.grad_norm for t in nw.history]
    assert all(g is not None and g < 1e3 * norms[0] for g in norms), norms
    assert not any(
        "updates of SGD" in e for t in nw.history for d in t.diagnoses for e in d.evidence
    )


class _BF16Norm(nn.Module):
    """A bfloat16 normalization with the variance as E[x²] - E[x]²: for activations near
    300 that vary by 0.5 the variance cancels, sqrt(var + 1e-6) is 1e-3, and the gradient
    through it jumps by 1e12 in one step: a jump the lr does not explain."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        y = (x - mean) / torch.sqrt(var + 1e-6)
        return (y * self.w).float()


class _TwoPassNorm(_BF16Norm):
    """The fix NW303 gives: the variance as the mean of squared deviations, in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-6) * self.w


def _train_norm(norm: type[nn.Module], mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), norm(16), nn.Linear(16, 1))
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.fill_(300.0)
        net[0].bias[::2] += 0.5
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with nanwatch.watch(net, mode=mode, on_anomaly="record") as nw:
        for _ in range(3):
            nn.functional.mse_loss(net(torch.randn(4, 8)), torch.randn(4, 1)).backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_growth_that_began_with_a_far_larger_jump_is_not_blamed_on_the_lr(mode: str) -> None:
    nw = _train_norm(_BF16Norm, mode)
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW303")
    assert not any("updates of SGD" in e for e in d.evidence), d.evidence
    assert 'g["lr"]' not in d.fix, d.fix


def test_exploding_gradients_name_the_module_whose_backward_multiplied_them() -> None:
    nw = _train_norm(_BF16Norm, "watch")
    d = next(d for t in nw.history for d in t.diagnoses if d.code == "NW303")
    assert d.path == "1", d.headline
    said = " ".join(d.evidence)
    assert "module 1 (_BF16Norm) multiplied the gradient" in said, d.evidence
    assert "in its own backward at step 1" in said, d.evidence
    assert "past 1 / eps of float32" in said, d.evidence
    assert "E[x²] - E[x]²" in d.explanation, d.explanation
    assert d.fix.startswith("# in 1's forward (_BF16Norm): compute what it divides by"), d.fix
    assert "((x - mean) ** 2).mean()" in d.fix, d.fix
    # the fix: a two-pass float32 variance; the gradients stay finite and level
    nw = _train_norm(_TwoPassNorm, "watch")
    assert nw.first_anomaly is None
    assert not [d for t in nw.history for d in t.diagnoses if d.code == "NW303"]


def test_a_tiny_llama_at_a_huge_lr_in_sentinel_names_the_lr() -> None:
    transformers = pytest.importorskip("transformers")

    def run(lr: float) -> nanwatch.Watcher:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        model = transformers.LlamaForCausalLM(cfg)
        opt = torch.optim.SGD(model.parameters(), lr)
        with nanwatch.watch(model, mode="sentinel", on_anomaly="record", postmortem=False) as nw:
            for _ in range(4):
                ids = torch.randint(0, 64, (2, 8))
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                nw.step()
                if nw.first_anomaly is not None:
                    break
        return nw

    nw = run(3e3)
    a = nw.first_anomaly
    assert a is not None and a.step == 2
    d = nw.history[2].diagnoses[0]
    said = " ".join(d.evidence)
    # the GPU-bound pass (tests._gpu_bound) reads nothing before the update
    gpu_bound = getattr(HostRead.ready, "__name__", "") == "_never_landed"
    if not gpu_bound:
        assert d.code == "NW101", d.headline
        # the replay of the model's backward on the way to the parameter finds the overflow
        # where watch finds it (the final norm's backward, at values the lr grew)
        assert d.path == "model.norm", d.headline
        assert "the values grew during training (SGD lr 3000)" in said, d.evidence
    else:  # read after the update (nothing landed before it): no replay, the growth
        assert d.code == "NW302", d.headline
        assert "1 update of SGD lr 3000" in said, d.evidence
        assert "the loss rose from" in said, d.evidence
        assert "learning rate is about" in d.explanation, d.explanation
    assert 'for g in opt.param_groups: g["lr"] = ' in d.fix, d.fix
    nw = run(_suggested_lr(d.fix))
    assert nw.first_anomaly is None
