"""Hunt 31f: vision, signal and generative models. A loss module's target that the user's
code made -inf (a box encoding's log(w / w_anchor) of a zero-width box, a log-duration
target of a phoneme with no frame) is told as the functional loss's is: the target, where
it was made, and a fix at that line, not a generic list of log fixes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch

torch.set_num_threads(1)


def _watch(*mods: nn.Module, mode: str) -> nanwatch.Watcher:
    return nanwatch.watch(*mods, mode=mode, on_anomaly="record", postmortem=False)


def _first(nw: nanwatch.Watcher) -> nanwatch.Diagnosis:
    return next(d for h in nw.history for d in h.diagnoses)


# ------------------------------------------------ a loss module's target made -inf by a log


def encode(gt: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Faster R-CNN's box regression targets."""
    aw, ah = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    gw, gh = gt[:, 2] - gt[:, 0], gt[:, 3] - gt[:, 1]
    dx, dy = (gt[:, 0] - anchors[:, 0]) / aw, (gt[:, 1] - anchors[:, 1]) / ah
    return torch.stack([dx, dy, torch.log(gw / aw), torch.log(gh / ah)], 1)


class BoxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.reg = nn.Linear(32, 4)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.reg(self.body(f))


def _box_run(mode: str, *, degenerate: bool) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net, crit = BoxHead(), nn.SmoothL1Loss()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    anchors = torch.tensor([[0.0, 0.0, 10.0, 10.0]]).repeat(6, 1)
    with _watch(net, crit, mode=mode) as nw:
        for step in range(3):
            gt = torch.rand(6, 4) * 5
            gt[:, 2:] = gt[:, :2] + 1 + torch.rand(6, 2) * 5
            if degenerate and step == 2:
                gt[3, 2] = gt[3, 0]  # an annotation of zero width
            loss = crit(net(torch.randn(6, 16)), encode(gt, anchors))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_box_target_of_a_loss_module_is_named_as_the_degenerate_box(mode: str) -> None:
    nw = _box_run(mode, degenerate=True)
    a = nw.first_anomaly
    assert a is not None and a.step == 2 and a.path == "SmoothL1Loss"
    d = _first(nw)
    assert (d.code, d.title, d.path) == ("NW401", "NaN or inf in the loss targets", "SmoothL1Loss")
    text = "\n".join(d.evidence)
    assert "its input (the prediction) was finite" in text
    assert "log(gw / aw), log(gh / ah): a log of a ratio" in text
    assert d.fix.splitlines()[1].startswith("valid = (gw > 0) & (gh > 0)")
    assert "torch.isfinite(encode)" not in d.fix  # a function, not the target's name
    codes = [x.code for x in nw.history[2].diagnoses]
    assert "NW110" not in codes  # no generic "log of zero" list of log_softmax fixes


def test_box_targets_of_healthy_boxes_stay_quiet() -> None:
    nw = _box_run("watch", degenerate=False)
    assert nw.first_anomaly is None
    assert not any(h.diagnoses for h in nw.history)


class DurationPredictor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv1d(16, 1, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h).squeeze(1)


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_log_duration_target_of_a_loss_module_is_fixed_at_the_loss_line(mode: str) -> None:
    torch.manual_seed(0)
    net, crit = DurationPredictor(), nn.MSELoss()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with _watch(net, crit, mode=mode) as nw:
        for step in range(3):
            h = torch.randn(2, 8, 12)
            durations = torch.randint(1, 6, (2, 12))
            if step == 2:
                durations[1, 4] = 0  # a phoneme the aligner gave no frame
            loss = crit(net(h), torch.log(durations.float()))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    d = _first(nw)
    assert (d.code, d.step, d.path) == ("NW401", 2, "MSELoss")
    assert any(
        "torch.log(durations.float()), which is -inf where durations is 0" in e for e in d.evidence
    )
    line = d.fix.splitlines()[0]
    assert line.startswith("loss = crit(net(h), torch.log1p(durations.float()))   # at ")
    assert "isfinite(torch)" not in d.fix
    # the advised line, run on the batch that failed (weights not yet updated): finite
    scope: dict[str, object] = {"torch": torch, "crit": crit, "net": DurationPredictor(), "h": h}
    scope["durations"] = durations
    exec(line.split("   #")[0], scope)
    assert torch.isfinite(scope["loss"]).all()  # type: ignore[call-overload]


# ------------------------------------ a diffusion loss divides by sqrt(alpha_bar) of ~1e-33


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-9.2103 * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TinyUNet(nn.Module):
    def __init__(self, c: int = 8, tdim: int = 16) -> None:
        super().__init__()
        self.tdim = tdim
        self.inp = nn.Conv2d(1, c, 3, padding=1)
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(4, c)
        self.temb = nn.Linear(tdim, c)
        self.up = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.out = nn.Conv2d(c, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.down(self.inp(x))
        h = F.silu(self.norm(h)) + self.temb(timestep_embedding(t, self.tdim))[:, :, None, None]
        return self.out(self.up(h))


def cosine_alpha_bar(steps: int, s: float = 0.008) -> torch.Tensor:
    """Nichol & Dhariwal's schedule, without their clip of beta at 0.999: the last
    alpha_bar is cos(pi / 2) ** 2, 3.7e-33 in float64 and as such in float32."""
    x = torch.arange(steps + 1, dtype=torch.float64) / steps
    f = torch.cos((x + s) / (1 + s) * torch.pi / 2) ** 2
    return (f / f[0]).float()[1:]


class X0Loss(nn.Module):
    """The noise the net predicts, turned into a prediction of x0 and compared with it."""

    def forward(
        self, eps_pred: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, ab: torch.Tensor
    ) -> torch.Tensor:
        x0_pred = (x_t - (1 - ab).sqrt() * eps_pred) / ab.sqrt()
        return F.mse_loss(x0_pred, x0)


def _diffusion_run(crit: nn.Module, mode: str = "watch") -> nanwatch.Watcher:
    torch.manual_seed(0)
    net, steps = TinyUNet(), 50
    alpha_bar = cosine_alpha_bar(steps)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with _watch(net, crit, mode=mode) as nw:
        for step in range(3):
            x0 = torch.randn(4, 1, 8, 8)
            t = torch.tensor([3, 10, 20, steps - 1 if step == 2 else 30])
            ab = alpha_bar[t].view(-1, 1, 1, 1)
            eps = torch.randn_like(x0)
            x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
            loss = crit(net(x_t, t), x_t, x0, ab)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


def test_exploding_gradient_of_a_division_by_a_tiny_input_floors_that_input() -> None:
    nw = _diffusion_run(X0Loss())
    d = _first(nw)
    assert (d.code, d.step, d.path) == ("NW303", 2, "X0Loss")
    text = "\n".join(d.evidence)
    assert "module X0Loss (X0Loss) multiplied the gradient" in text
    assert "its input ab (input[3]) holds values from 3.75e-33 to " in text
    assert "by its sqrt up to 1.63e+16" in text
    assert "mean) ** 2" not in d.fix and "layer_norm" not in d.fix  # not a normalization
    line = d.fix.splitlines()[0]
    assert line.startswith("ab = ab.clamp_min(torch.finfo(ab.dtype).eps ** 0.5)   # first thing")

    class Floored(X0Loss):
        """The loss with the advised line first in its forward."""

        def forward(
            self, eps_pred: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, ab: torch.Tensor
        ) -> torch.Tensor:
            scope: dict[str, object] = {"torch": torch, "ab": ab}
            exec(line.split("   #")[0], scope)
            floored = scope["ab"]
            assert isinstance(floored, torch.Tensor)
            return super().forward(eps_pred, x_t, x0, floored)

    fixed = _diffusion_run(Floored())
    assert fixed.first_anomaly is None
    assert not any(h.diagnoses for h in fixed.history)


# ------------------------------------------------------- a GIoU loss of zero-size boxes

_GIOU = """
import torch
from torch import nn


def giou_loss(p, g):
    x1, y1 = torch.max(p[:, 0], g[:, 0]), torch.max(p[:, 1], g[:, 1])
    x2, y2 = torch.min(p[:, 2], g[:, 2]), torch.min(p[:, 3], g[:, 3])
    inter = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    area_p = (p[:, 2] - p[:, 0]) * (p[:, 3] - p[:, 1])
    area_g = (g[:, 2] - g[:, 0]) * (g[:, 3] - g[:, 1])
    union = area_p + area_g - inter
    iou = inter / union
    cx1, cy1 = torch.min(p[:, 0], g[:, 0]), torch.min(p[:, 1], g[:, 1])
    cx2, cy2 = torch.max(p[:, 2], g[:, 2]), torch.max(p[:, 3], g[:, 3])
    area_c = (cx2 - cx1) * (cy2 - cy1)
    giou = iou - (area_c - union) / area_c
    return (1 - giou).mean()


class GIoULoss(nn.Module):
    def forward(self, p, g):
        return giou_loss(p, g)
"""


class BoxPredictor(nn.Module):
    """Box sizes through a ReLU, from an anchor's corner: a dead ReLU gives boxes of size 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, f: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        d = F.relu(self.fc(f))
        return torch.cat([anchor[:, :2], anchor[:, :2] + d[:, 2:]], 1)


def _giou_run(source: str, tmp_path: object, mode: str = "watch") -> nanwatch.Watcher:
    import importlib.util
    import pathlib
    import uuid

    assert isinstance(tmp_path, pathlib.Path)
    file = tmp_path / f"giou_{uuid.uuid4().hex}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    net, crit = BoxPredictor(), mod.GIoULoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with _watch(net, crit, mode=mode) as nw:
        for step in range(3):
            f, anchor = torch.randn(4, 8), torch.rand(4, 4) * 5
            g = torch.cat([anchor[:, :2], anchor[:, :2] + 1 + torch.rand(4, 2)], 1)
            if step == 2:
                with torch.no_grad():
                    net.fc.bias.fill_(-100.0)  # the size head died: boxes of size 0
                g[0, 2:] = g[0, :2]  # and a ground-truth box of size 0 at the same corner
            loss = crit(net(f, anchor), g)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_giou_of_zero_size_boxes_gets_an_eps_not_a_smoothing_of_one(
    mode: str, tmp_path: object
) -> None:
    source = _GIOU
    fixes = []
    for line in ("iou = inter / union", "giou = iou - (area_c - union) / area_c"):
        d = _first(_giou_run(source, tmp_path, mode))
        assert (d.code, d.step, d.path) == ("NW111", 2, "GIoULoss")
        assert d.title == "Division by zero (0/0) in an IoU of two boxes of zero size"
        assert d.source is not None and d.source.endswith(
            f":{source.splitlines().index('    ' + line) + 1}"
        )
        assert "of box areas, a width times a height" in "\n".join(d.evidence)
        assert "+ 1)" not in d.fix  # a smoothing of 1 is not small against these areas
        fixed = d.fix.splitlines()[0].split("   #")[0]
        fixes.append(fixed)
        source = source.replace(f"    {line}\n", f"    {fixed}\n")
    assert fixes == [
        "iou = inter / (union + torch.finfo(union.dtype).eps)",
        "giou = iou - (area_c - union) / (area_c + torch.finfo(area_c.dtype).eps)",
    ]
    nw = _giou_run(source, tmp_path, mode)  # both advised lines in: quiet
    assert nw.first_anomaly is None
    assert not any(h.diagnoses for h in nw.history)


# ------------------------------------- Charbonnier's loss written without its eps


class Charbonnier(nn.Module):
    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((pred - target) ** 2).sqrt().mean()


class ResidualRefiner(nn.Module):
    """A residual net whose last conv starts at zero (EDSR-style): the identity at init."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.tail = nn.Conv2d(8, 3, 3, padding=1)
        nn.init.zeros_(self.tail.weight)
        nn.init.zeros_(self.tail.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.tail(self.body(x))


def _refine_run(crit: nn.Module, mode: str) -> nanwatch.Watcher:
    torch.manual_seed(0)
    net = ResidualRefiner()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with _watch(net, crit, mode=mode) as nw:
        for _ in range(2):
            frame = torch.rand(2, 3, 8, 8)
            target = frame.clone()  # a static frame: the clean target is the input itself
            loss = crit(net(frame), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    return nw


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_sqrt_of_a_squared_difference_gets_its_eps_on_the_users_line(mode: str) -> None:
    nw = _refine_run(Charbonnier(), mode)
    d = _first(nw)
    assert (d.code, d.step, d.path, d.op) == ("NW112", 0, "Charbonnier", "aten.sqrt")
    lines = d.fix.splitlines()
    assert lines[0].startswith("return ((pred - target) ** 2 + 1e-12).sqrt().mean()   # eps")
    assert lines[1].startswith("# or (pred - target).abs(): the same value")
    assert "vector_norm" not in d.fix and "pairwise_distance" not in d.fix  # nothing is summed

    class Fixed(nn.Module):
        def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            scope: dict[str, object] = {"pred": pred, "target": target}
            exec("def f():\n    " + lines[0].split("   #")[0], scope)
            f = scope["f"]
            assert callable(f)
            out = f()
            assert isinstance(out, torch.Tensor)
            return out

    fixed = _refine_run(Fixed(), mode)
    assert fixed.first_anomaly is None
    assert not any(h.diagnoses for h in fixed.history)


# -------------------------- a float16 timestep embedding given steps instead of fractions


class TimestepMLP(nn.Module):
    """A continuous-time diffusion model's embedding: t in [0, 1], scaled by 1000."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.dim = dim
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.SiLU(), nn.Linear(32, 8))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freqs = torch.exp(-9.2103 * torch.arange(half) / half).to(t.dtype)
        args = t[:, None] * 1000 * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], -1))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_one_batch_of_timesteps_out_of_range_is_the_batch_not_a_loop(mode: str) -> None:
    torch.manual_seed(0)
    net, crit = TimestepMLP().half(), nn.MSELoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with _watch(net, crit, mode=mode) as nw:
        for step in range(3):
            t = torch.rand(4).half()
            if step == 2:  # integer timesteps where fractions are expected
                t = torch.tensor([10.0, 200.0, 500.0, 999.0]).half()
            loss = crit(net(t).float(), torch.randn(4, 8))
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    d = _first(nw)
    assert (d.code, d.step, d.op) == ("NW101", 2, "aten.mul.Tensor")
    said = "\n".join(d.evidence)
    # a single jump at step 2 (after two batches below 1), not a growth step after step
    assert "the batch did it: input[0] of TimestepMLP holds max |x| = 999 at step 2" in said
    assert "the loop made the input" not in said and "fed back" not in said
    assert "x.data.clamp_" not in d.fix
    assert "trace them to the dataset" in d.fix
