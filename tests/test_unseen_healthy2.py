"""Healthy training that must stay silent, second round: ordinary, correct loops of families
not in test_unseen_healthy.py, each run in watch and sentinel mode with
``on_anomaly="raise"`` and nanwatch's warnings turned into errors. First among them a
contrastive loss at its floor, whose rounding-level gradients NW303 took for a level to
explode from."""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

_MODES = ("watch", "sentinel")

#: one loop: (model, the other modules to watch, a function running step i)
_Loop = tuple[nn.Module, tuple[nn.Module, ...], Callable[[int], None]]


def _run_silent(loop: _Loop, mode: str, steps: int) -> nanwatch.Watcher:
    """Run ``loop`` for ``steps`` steps under watch(on_anomaly="raise"), every nanwatch
    warning an error; the watcher, for what it recorded."""
    model, extra, step = loop
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanwatch.NanwatchWarning)
        with nanwatch.watch(model, *extra, mode=mode, on_anomaly="raise") as nw:
            for i in range(steps):
                step(i)
                nw.step()
    assert [(d.code, d.step, d.title) for d in nw.report.diagnoses] == []
    return nw


# ------------------------------------------------ NW303: a jump from rounding-level norms


def _contrastive(dtype: torch.dtype, *, blow_up_at: int | None = None) -> _Loop:
    """InfoNCE at temperature 0.01 on two noisy views of the same batch: the positives are
    near-identical, so the loss sits at its floor (~0) and the gradients are rounding
    noise, until an ordinary batch gives an ordinary (still small) gradient.
    ``blow_up_at``: that step's loss is multiplied by 1e6 (a real explosion)."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32)).to(dtype)
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x = torch.randn(32, 16, dtype=dtype)
        z1 = F.normalize(enc(x), dim=-1)
        z2 = F.normalize(enc(x + 0.1 * torch.randn_like(x)), dim=-1)
        loss = F.cross_entropy((z1 @ z2.T / 0.01).float(), torch.arange(32))
        if i == blow_up_at:
            loss = loss * 1e6
        loss.backward()
        opt.step()
        opt.zero_grad()

    return enc, (), step


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_jump_from_rounding_level_gradients_to_small_ones_is_no_explosion(
    dtype: torch.dtype, mode: str
) -> None:
    """NW303 called the step-4 gradient (6e-4 after four steps of ~3e-7, the loss ~0) a
    2271x explosion and advised clip_grad_norm_(max_norm=2e-06), which would freeze
    training. Jumping from noise to a norm far below the weights' (about 6) explodes
    nothing."""
    nw = _run_silent(_contrastive(dtype), mode, 8)
    norms = [t.grad_norm for t in nw.history]
    assert all(n is not None for n in norms)
    # the jump is there: many times the median before it, as NW303 measures
    assert norms[4] > 100 * statistics.median(norms[:4])  # type: ignore[type-var]


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_jump_from_rounding_level_to_the_weights_scale_is_still_exploding(
    dtype: torch.dtype, mode: str
) -> None:
    """The floor does not hide a real explosion from the same rounding-level history: a
    gradient as large as the weights themselves is still NW303, with a clip that binds."""
    model, _, step = _contrastive(dtype, blow_up_at=4)
    with nanwatch.watch(model, mode=mode, on_anomaly="record") as nw:
        for i in range(6):
            step(i)
            nw.step()
    found = [d for d in nw.report.diagnoses if d.code == "NW303"]
    assert [d.step for d in found] == [4]
    assert "max_norm=1.0" in found[0].fix


# ------------------------------------------------------------ ordinary loops, all silent


def _classifier(width: int = 32, classes: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, classes))


def _memorize_ce() -> _Loop:
    """Eight samples memorized: the loss goes to ~0 and its gradients with it."""
    m = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    x, y = torch.randn(8, 8), torch.arange(8) % 4
    opt = torch.optim.Adam(m.parameters(), 3e-2)

    def step(i: int) -> None:
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (), step


def _memorize_bce() -> _Loop:
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    crit = nn.BCEWithLogitsLoss()
    x, y = torch.randn(8, 8), (torch.arange(8) % 2).float()[:, None]
    opt = torch.optim.Adam(m.parameters(), 5e-2)

    def step(i: int) -> None:
        loss = crit(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (crit,), step


def _low_precision(dtype: torch.dtype) -> Callable[[], _Loop]:
    def build() -> _Loop:
        m = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)).to(dtype)
        x, y = torch.randn(8, 8, dtype=dtype), torch.arange(8) % 4
        opt = torch.optim.SGD(m.parameters(), 0.5)

        def step(i: int) -> None:
            loss = F.cross_entropy(m(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        return m, (), step

    return build


def _batches(opt: torch.optim.Optimizer, m: nn.Module, after: Callable[[], None]) -> Callable:
    def step(i: int) -> None:
        x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        after()

    return step


def _warmup_from_zero() -> _Loop:
    """AdamW with a LambdaLR warm-up whose first lr is 0."""
    m = _classifier()
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 10))
    return m, (), _batches(opt, m, sch.step)


def _cosine_to_zero() -> _Loop:
    """SGD with momentum whose cosine schedule reaches lr 0 and stays there."""
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9)
    sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12, eta_min=0.0)
    done = [0]

    def after() -> None:
        done[0] += 1
        if done[0] <= 12:
            sch.step()

    return m, (), _batches(opt, m, after)


def _frozen_backbone() -> _Loop:
    back = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
    for p in back.parameters():
        p.requires_grad_(False)
    m = nn.Sequential(back, nn.Linear(32, 4))
    opt = torch.optim.Adam(m[1].parameters(), 1e-3)
    return m, (), _batches(opt, m, lambda: None)


def _grad_accumulation() -> _Loop:
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), 0.05)

    def step(i: int) -> None:
        for _ in range(4):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            (F.cross_entropy(m(x), y) / 4).backward()
        opt.step()
        opt.zero_grad()

    return m, (), step


def _label_smoothing() -> _Loop:
    m = _classifier()
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    opt = torch.optim.Adam(m.parameters(), 1e-2)

    def step(i: int) -> None:
        loss = crit(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (crit,), step


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 16, *, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=not tied)
        if tied:
            self.out.weight = self.emb.weight

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(t))))


def _masked_lm_labels(i: int, t: torch.Tensor, *, none_at: int) -> torch.Tensor:
    lab = t.clone()
    lab[torch.rand(t.shape) >= 0.15] = -100
    if i == none_at:  # a batch where nothing was masked
        lab[:] = -100
    return lab


def _masked_lm_mean_over_counted() -> _Loop:
    """Masked LM whose loss is the sum over the masked tokens over their count (at least
    1): a batch with every target ignored gives 0, not NaN."""
    m = _TinyLM()
    opt = torch.optim.AdamW(m.parameters(), 1e-3)

    def step(i: int) -> None:
        t = torch.randint(0, 20, (4, 12))
        lab = _masked_lm_labels(i, t, none_at=7).view(-1)
        total = F.cross_entropy(m(t).view(-1, 20), lab, ignore_index=-100, reduction="sum")
        loss = total / (lab != -100).sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (), step


def _gan() -> _Loop:
    g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    d = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    og = torch.optim.Adam(g.parameters(), 2e-4, betas=(0.5, 0.999))
    od = torch.optim.Adam(d.parameters(), 2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)

    def step(i: int) -> None:
        real, fake = torch.randn(32, 2) * 0.5 + 2, g(torch.randn(32, 8))
        loss_d = bce(d(real), ones) + bce(d(fake.detach()), zeros)
        od.zero_grad()
        loss_d.backward()
        od.step()
        loss_g = bce(d(fake), ones)
        og.zero_grad()
        loss_g.backward()
        og.step()

    return g, (d,), step


def _tied_lm() -> _Loop:
    m = _TinyLM(30, tied=True)
    opt = torch.optim.Adam(m.parameters(), 1e-3)

    def step(i: int) -> None:
        t = torch.randint(0, 30, (8, 10))
        loss = F.cross_entropy(m(t)[:, :-1].reshape(-1, 30), t[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (), step


class _DictHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.cls, self.reg = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.body(x))
        return {"logits": self.cls(h), "value": self.reg(h)}


def _dict_output() -> _Loop:
    m = _DictHeads()
    opt = torch.optim.Adam(m.parameters(), 1e-3)

    def step(i: int) -> None:
        x, y, v = torch.randn(16, 16), torch.randint(0, 4, (16,)), torch.randn(16, 1)
        out = m(x)
        loss = F.cross_entropy(out["logits"], y) + F.mse_loss(out["value"], v)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (), step


def _ema_weights() -> _Loop:
    """An EMA copy updated under no_grad after each step, and evaluated."""
    m, ema = _classifier(), _classifier()
    ema.load_state_dict(m.state_dict())
    ema.requires_grad_(False)
    opt = torch.optim.Adam(m.parameters(), 1e-3)

    def after() -> None:
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), m.parameters(), strict=True):
                pe.mul_(0.99).add_(pm, alpha=0.01)
            ema(torch.randn(4, 16))

    return m, (ema,), _batches(opt, m, after)


def _hinge_at_zero() -> _Loop:
    """A multi-class hinge loss that reaches exactly 0: its gradients are exactly 0."""
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    crit = nn.MultiMarginLoss()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    opt = torch.optim.SGD(m.parameters(), 0.1)

    def step(i: int) -> None:
        loss = crit(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (crit,), step


class _UnusedPooler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.pooler = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _unused_parameter() -> _Loop:
    m = _UnusedPooler()
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    return m, (), _batches(opt, m, lambda: None)


def _zero_init_head() -> _Loop:
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    nn.init.zeros_(m[4].weight)
    nn.init.zeros_(m[4].bias)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return m, (), _batches(opt, m, lambda: None)


def _autocast_bf16() -> _Loop:
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(m.parameters(), 1e-3)

    def step(i: int) -> None:
        x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (), step


_HEALTHY: dict[str, Callable[[], _Loop]] = {
    "memorize_cross_entropy": _memorize_ce,
    "memorize_bce": _memorize_bce,
    "bfloat16_sgd_memorize": _low_precision(torch.bfloat16),
    "float16_sgd_memorize": _low_precision(torch.float16),
    "adamw_lambdalr_warmup_from_0": _warmup_from_zero,
    "cosine_schedule_to_lr_0": _cosine_to_zero,
    "frozen_backbone": _frozen_backbone,
    "gradient_accumulation_4": _grad_accumulation,
    "label_smoothing": _label_smoothing,
    "masked_lm_sum_over_count": _masked_lm_mean_over_counted,
    "gan_two_optimizers": _gan,
    "weight_tying": _tied_lm,
    "dict_output": _dict_output,
    "ema_under_no_grad": _ema_weights,
    "hinge_loss_at_0": _hinge_at_zero,
    "unused_parameter": _unused_parameter,
    "zero_initialized_head": _zero_init_head,
    "autocast_bfloat16": _autocast_bf16,
}


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("family", list(_HEALTHY))
def test_an_ordinary_training_loop_is_silent(family: str, mode: str) -> None:
    torch.manual_seed(0)
    _run_silent(_HEALTHY[family](), mode, 16)


@pytest.mark.parametrize("mode", _MODES)
def test_a_masked_lm_batch_with_every_target_ignored_is_explained_and_nothing_else(
    mode: str,
) -> None:
    """reduction='mean' over no counted target is 0/0 = NaN by PyTorch's definition: that
    step is NW113 with the fix that counts (sum / count clamped at 1), and the steps before
    it raise nothing."""
    torch.manual_seed(0)
    m = _TinyLM()
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    with (
        pytest.raises(nanwatch.AnomalyError) as err,
        nanwatch.watch(m, mode=mode, on_anomaly="raise") as nw,
    ):
        for i in range(10):
            t = torch.randint(0, 20, (4, 12))
            lab = _masked_lm_labels(i, t, none_at=7).view(-1)
            loss = F.cross_entropy(m(t).view(-1, 20), lab, ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    assert [(d.code, d.step) for d in nw.report.diagnoses] == [("NW113", 7)]
    assert err.value.anomaly is not None and err.value.anomaly.step == 7
    d = nw.report.diagnoses[0]
    assert "all 48 targets equal ignore_index=-100" in d.evidence
    assert "reduction='sum'" in d.fix and "clamp_min(1)" in d.fix


# ------------------------------------- NW103: float16 logits whose exp runs in float32


def _float16_logits(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> _Loop:
    """A float16 classifier memorizing 8 samples: its logits grow past half of float16's
    exp bound (11.09) within 16 steps. ``loss_of(logits, y)`` computes the loss."""
    m = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)).half()
    x, y = torch.randn(8, 8).half(), torch.arange(8) % 4
    opt = torch.optim.SGD(m.parameters(), 0.3)

    def step(i: int) -> None:
        loss = loss_of(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return m, (), step


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize(
    "loss_of",
    [
        lambda z, y: F.cross_entropy(z.float() / 2, y),
        lambda z, y: F.nll_loss(F.log_softmax(z.float(), -1), y),
    ],
    ids=["float_then_temperature", "float_then_log_softmax"],
)
def test_float16_logits_computed_on_in_float32_before_the_loss_are_not_near_exp_overflow(
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mode: str
) -> None:
    """NW103 knew F.cross_entropy(logits.float(), y) computes its exp in float32, but not
    F.cross_entropy(logits.float() / T, y) nor a log_softmax of the float32 copy: every op
    after the widening copy runs in float32, far from float16's exp bound."""
    torch.manual_seed(0)
    _run_silent(_float16_logits(loss_of), mode, 16)


def test_float16_logits_exponentiated_in_float16_still_warn() -> None:
    """An exp taken in float16 before the copy is the overflow NW103 warns of."""
    torch.manual_seed(0)

    def loss_of(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = z.exp().float()
        return F.nll_loss((p / p.sum(-1, keepdim=True)).log(), y)

    model, _, step = _float16_logits(loss_of)
    with nanwatch.watch(model, on_anomaly="record") as nw:
        for i in range(16):
            step(i)
            nw.step()
    assert "NW103" in [d.code for d in nw.report.diagnoses]
