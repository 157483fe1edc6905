"""Localization found by user testing: a NaN an op made of infinities that came in with a
module's buffer (a VQ-VAE's EMA codebook, a buffer written outside the forward), the fix of
NW405 for a module that is not the watched model (a center loss beside a classifier), a
NaN gradient born in a submodule given the same input as its parent (a PINN's radial
feature at the origin), and a double backward's NaN born in the loss code (an Eikonal
term through ``torch.autograd.grad(create_graph=True)``). Tiny CPU loops."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import LOSS_PATH


def _top(nw: Any) -> Any:
    trace = nw.first_bad_step
    assert trace is not None and trace.diagnoses
    return trace.diagnoses[0]


# ------------------------------------------------- 1. non-finite module state read by an op


class Codebook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.rand(4, 3) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.table.t()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.book = Codebook()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.book(self.fc(x).abs() + 1)


def test_a_nan_an_op_made_of_a_buffers_infinities_is_the_buffers() -> None:
    """A buffer written outside the forward holds +inf and -inf in one row; ``x @ E.t()``
    makes NaN of them. The replay named the matmul as the NaN's birth (NW100, "NaN born
    ... by aten.mm"): the infinities came in with the buffer, which is the blame (NW405)."""
    torch.manual_seed(0)
    net, x = Net(), torch.rand(5, 3)
    with nanwatch.watch(net, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            net(x).sum().backward()
            with torch.no_grad():
                if step == 0:
                    net.book.table[0, 0] = float("inf")
                    net.book.table[0, 1] = float("-inf")
            nw.step()
    a = nw.first_anomaly
    assert (a.step, a.path, a.op) == (1, "book", None)
    d = _top(nw)
    assert d.code == "NW405"
    assert "book.table (buffer, float32) holds +inf, -inf" in d.evidence
    assert "written outside the forward" in d.explanation
    assert "torch.isfinite(net.book.table).all()" in d.fix


class EMAQuantizer(nn.Module):
    """A VQ codebook updated by EMA in the forward: a code no sample picked has a cluster
    size of 0, and its entry becomes ±inf (embed_avg / 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("embedding", torch.randn(6, 4))
        self.register_buffer("cluster_size", torch.zeros(6))
        self.register_buffer("embed_avg", self.embedding.clone())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        dist = (z**2).sum(1, keepdim=True) - 2 * z @ self.embedding.t()
        idx = dist.argmin(1)
        onehot = F.one_hot(idx, 6).type(z.dtype)
        zq = self.embedding[idx]
        with torch.no_grad():
            self.cluster_size.mul_(0.9).add_(onehot.sum(0), alpha=0.1)
            self.embed_avg.mul_(0.9).add_(onehot.t() @ z, alpha=0.1)
            self.embedding.copy_(self.embed_avg / self.cluster_size.unsqueeze(1))
        return z + (zq - z).detach()


def test_a_vq_codebook_of_infinities_is_blamed_on_the_division_not_the_matmul() -> None:
    """Forensic mode traced ``z @ E.t()`` of a codebook holding +inf and -inf (written by the
    last step's EMA update) as the NaN's birth: "NaN born ... by aten.mm (then +inf,
    -inf)". The record held the infinities the op read, not its NaN: the op that made them
    is the division by a cluster size of 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), EMAQuantizer(), nn.Linear(4, 8))
    x = torch.randn(3, 8)  # 3 samples: most of the 6 codes stay unused
    with nanwatch.watch(model, mode="forensic", on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            F.mse_loss(model(x), x).backward()
            nw.step()
    a = nw.first_anomaly
    assert a.path == "1"
    assert a.op is not None and a.op.op == "aten.div.Tensor"
    assert "aten.mm" not in a.summary


# ------------------------------------------------------- 2. NW405's fix for a second root


class CenterLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("centers", torch.zeros(3, 2))

    def forward(self, feat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((feat - self.centers[y]) ** 2).sum(1).mean()

    @torch.no_grad()
    def update(self, feat: torch.Tensor, y: torch.Tensor) -> None:
        count = F.one_hot(y, 3).float().sum(0)
        self.centers -= 0.5 * self.centers / count[:, None]  # 0/0 for a class not seen


def test_module_state_fix_names_no_model_the_script_does_not_have() -> None:
    """The NaN buffer is a center loss's, watched beside the model and a second loss: the
    fix said ``m = model`` (the generic name, renamed to the classifier or left undefined)
    and only listed the non-finite tensors. It checks the buffer where it is written."""
    torch.manual_seed(0)
    net, ce, center = nn.Linear(4, 2), nn.CrossEntropyLoss(), CenterLoss()
    head = nn.Linear(2, 3)
    with nanwatch.watch(net, head, ce, center, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            x, y = torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 0, 1 + (step > 0)])
            f = net(x)  # class 2 unseen at step 0: its center becomes 0/0, read at step 1
            (ce(head(f), y) + center(f, y)).backward()
            center.update(f.detach(), y)
            nw.step()
    d = _top(nw)
    assert (d.code, d.path) == ("NW405", "CenterLoss")
    assert "model" not in d.fix.split("#")[0] and "m = " not in d.fix
    assert "assert torch.isfinite(self.centers).all()" in d.fix
    assert "in CenterLoss" in d.fix


# --------------------------------------- 3. a submodule given its parent's input, backward


class RadialFeat(nn.Module):
    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        return torch.cat([xy, torch.sqrt((xy**2).sum(-1, keepdim=True))], -1)


class PINN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = RadialFeat()
        self.mlp = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.feat(xy))


def test_a_nan_gradient_of_a_shared_input_is_born_in_the_inner_module() -> None:
    """sqrt's backward at the origin in ``feat`` made the NaN gradient of the coordinates,
    which the PINN passed on to it unchanged: the input's gradient is recorded for the
    outermost module, and the PINN was blamed ("born in the backward of PINN")."""
    torch.manual_seed(0)
    model = PINN()
    xy = torch.tensor([[0.0, 0.0], [0.5, -0.5], [1.0, 0.2]], requires_grad=True)
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        u = model(xy)
        g = torch.autograd.grad(u.sum(), xy, create_graph=True)[0]
        (g**2).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert (a.path, a.consumer) == ("feat", "feat")
    # the sqrt's: +inf from a gradient that was not 0, NaN from 0, and the record holds NaN
    assert a.summary.startswith("non-finite gradient born in the backward of feat:")
    assert "(then NaN) [" in a.summary


# ------------------------------------------------------------- 4. a double backward's pass


def test_a_double_backward_nan_born_in_the_loss_code_is_the_loss_codes() -> None:
    """``loss.backward()`` over the graph ``autograd.grad(create_graph=True)`` built: the
    NaN of sqrt's backward at 0 reached a Linear's output gradient with no module output
    gradient of that pass before it. It was blamed on the last Linear ("born in the backward
    of 2: the gradient of its output was finite"), a record of the autograd.grad pass."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.zeros(5, 2, requires_grad=True)
    with nanwatch.watch(m, on_anomaly="record", postmortem=False) as nw:
        u = m(x)
        g = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        torch.sqrt((g**2).sum(-1) * 0).sum().backward()
        nw.step()
    a = nw.first_anomaly
    assert (a.path, a.origin) == (LOSS_PATH, "after-output")
    assert "double backward" in a.summary
    assert "born in the backward of 2" not in a.summary
    assert a.op is not None and a.op.node == "SqrtBackward0"
