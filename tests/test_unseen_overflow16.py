"""NW101 found by user testing: samples a Langevin loop computed from the model's gradient
are not called bad data; an overflow in an unwatched float16 teacher called before the loss
is not put inside the loss; a float16 Gram matrix of the loss code is named in watch mode."""

from __future__ import annotations

import ast
import math

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from tests._diagnoses import first_of as _first
from tests._diagnoses import raises as _raises
from tests._diagnoses import text

torch.set_num_threads(1)


# ------------------------------ 1: an EBM sampler with a flipped sign: the loop made the input


class _Energy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.SiLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * self.net(x).pow(2).sum(-1)


def _ebm(clamp: str | None) -> nanwatch.AnomalyError | None:
    torch.manual_seed(0)
    model = _Energy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    buf = torch.rand(16, 4) * 2 - 1

    def sample(x0: torch.Tensor) -> torch.Tensor:
        x = x0.clone().requires_grad_(True)
        for _ in range(5):
            g = torch.autograd.grad(model(x).sum(), x)[0]
            x.data.add_(10.0 * g)  # the bug: x + step * dE/dx climbs the energy
            if clamp is not None:
                exec(clamp, {"x": x, "torch": torch})
        return x.detach()

    try:
        with nanwatch.watch(model) as nw:
            for _ in range(2):
                idx = torch.arange(8)
                xn = sample(buf[idx])
                buf[idx] = xn
                e_pos, e_neg = model(torch.rand(8, 4)), model(xn)
                loss = e_pos.mean() - e_neg.mean() + (e_pos**2 + e_neg**2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                nw.step()
    except nanwatch.AnomalyError as e:
        return e
    return None


def test_samples_grown_by_the_loop_are_not_called_the_dataset() -> None:
    err = _ebm(None)
    assert err is not None
    d = _first(err, "NW101")
    assert "trace them to the dataset" not in d.fix and "normalize" not in d.fix
    assert "x / 255" not in d.fix
    assert "the loop made the input" in text(d) and "torch.autograd.grad" in text(d)
    assert "sign" in d.explanation and "replay buffer" in d.explanation
    first = d.fix.splitlines()[0]
    assert first.startswith("x.data.clamp_(-1.0, 1.0)")
    ast.parse("\n".join(ln for ln in d.fix.splitlines()))
    assert _ebm(first.split("#", 1)[0].strip()) is None  # clamped where updated: no overflow


# ------------------------------ 2: an unwatched float16 teacher overflows before the loss


def test_an_unwatched_fp16_teacher_is_named_not_the_loss_module() -> None:
    torch.manual_seed(0)
    teacher = nn.Sequential(
        nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    with torch.no_grad():
        for m in teacher:
            if isinstance(m, nn.Linear):
                m.weight.mul_(80)
    teacher.half()
    student = nn.Linear(16, 10)
    kd = nn.KLDivLoss(reduction="batchmean")
    x = torch.randn(8, 16) * 3

    def run() -> None:
        with torch.no_grad():
            t = teacher(x.half()).float()
        kd(F.log_softmax(student(x), 1), F.softmax(t, 1)).backward()

    try:
        with nanwatch.watch(student, kd, mode="forensic"):
            run()
    except nanwatch.AnomalyError as e:
        err = e
    else:
        raise AssertionError("no anomaly")
    d = _first(err, "NW101")
    assert "inside KLDivLoss" not in d.fix and "where KLDivLoss is called" not in d.fix
    assert "teacher(...)" in d.fix and "teacher.float()" in d.fix
    assert "nanwatch.watch(model, teacher, ...)" in d.fix
    assert "float16" in d.fix and "65504" in d.fix


# ------------------------------ 3: a float16 Gram matrix in the loss code, watch mode


def _gram(fp32: bool, mode: str = "watch") -> nanwatch.AnomalyError | None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU()).half()
    for p in net.parameters():
        p.requires_grad_(False)

    def gram(f: torch.Tensor) -> torch.Tensor:
        if fp32:
            f = f.float()
        return f.transpose(-1, -2) @ f / f.shape[-2]

    with torch.no_grad():
        g0 = gram(net((torch.rand(1, 300, 8) * 60).half()))
    img = (torch.rand(1, 300, 8) * 60).half().requires_grad_(True)
    try:
        with nanwatch.watch(net, mode=mode) as nw:  # type: ignore[arg-type]
            F.mse_loss(gram(net(img)), g0).backward()
            nw.step()
    except nanwatch.AnomalyError as e:
        return e
    return None


def test_a_float16_gram_of_the_loss_code_is_an_overflow_in_watch_mode() -> None:
    for mode in ("watch", "sentinel"):
        err = _gram(False, mode)
        assert err is not None
        d = err.diagnoses[0]
        assert d.code == "NW101", d.code
        t = text(d)
        assert "bmm" in t and "65504" in t and "+inf" in t
        assert "a.float() @ b.float()" in d.fix and "forensic" in d.fix
        ast.parse(d.fix.splitlines()[0])
    assert _gram(True) is None


def test_a_nan_that_came_into_the_loss_is_not_claimed_as_a_product_overflow() -> None:
    torch.manual_seed(0)
    net = nn.Linear(8, 16).half()
    x = torch.rand(4, 8).half()
    y = torch.full((16, 16), math.nan, dtype=torch.float16)

    def run() -> None:
        f = net(x)
        F.mse_loss(f.transpose(0, 1) @ f, y).backward()

    err = _raises(net, run)
    assert all(d.code != "NW101" for d in err.diagnoses)
