"""nanwatch on a real CUDA device: statistics stay on the GPU until the step's end, the
first non-finite value is still found where it was born, a device-side assert leaves a
post-mortem without touching the dead context, and healthy mixed-precision training
stays quiet. Skipped where no GPU is present (CI); run on a GPU machine with
``pytest -m cuda``."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.records import AnomalyKind, Phase
from nanwatch.report import Report

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _syncs(fn: Callable[[], Any]) -> list[str]:
    """The host synchronizations ``fn`` makes (CUDA's sync debug mode), one message each."""
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (the mode's own "prototype feature" notice is not a sync)
    seen = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    return seen


def _busy() -> None:
    """Queue about 100 ms of GPU work ahead of what follows: the forward's statistics have
    not landed when backward begins, as in a step the GPU bounds. (25 ms was once too
    little on an H100 shared with two other processes: the host fell that far behind.)"""
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.Linear(64, 10)).cuda()  # fmt: skip


def test_a_watched_step_leaves_statistics_on_the_gpu_until_the_step_ends() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    criterion = nn.CrossEntropyLoss()

    def train() -> None:
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def forward_backward() -> None:
        _busy()
        criterion(model(x), y).backward()

    def update() -> None:
        opt.step()
        opt.zero_grad()

    with nanwatch.watch(model, criterion, guards=False) as nw:
        for _ in range(2):  # warm-up: lazy CUDA initialization syncs once
            train()
            nw.step()
        during = _syncs(forward_backward)
        before_update = _syncs(update)
        at_end = _syncs(nw.step)
        # a forward the GPU has already run is read when backward begins: one copy, on
        # nanwatch's side stream, which waits for nothing the GPU still has to do
        loss = criterion(model(x), y)
        torch.cuda.synchronize()
        landed = _syncs(loss.backward)
        update()
        nw.step()
    assert during == []  # every statistic stayed on the device
    assert len(landed) == 1
    # a copy each, on nanwatch's side stream after an event: the forward's statistics
    # (before the update), what backward made (then, or at the end if it had not landed),
    # the new weights (at the end); never one sync per statistic
    assert len(before_update) + len(at_end) <= 3
    trace = nw.history[-1]
    assert trace.anomaly is None and not [d for d in trace.diagnoses if d.severity == "error"]
    assert trace.grad_norm is not None and math.isfinite(trace.grad_norm)
    out = [r for r in trace.records if r.path == "4" and r.phase is Phase.FORWARD]
    assert out and out[0].stat is not None and math.isfinite(out[0].stat.max)
    assert out[0].device.startswith("cuda")


def test_float64_statistics_on_the_gpu_are_read_in_float64() -> None:
    """1e300 is finite in float64; a read through float32 would make it inf."""
    model = nn.Linear(4, 4).cuda().double()
    with torch.no_grad():
        model.weight.fill_(1e299)
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(torch.ones(2, 4, device="cuda", dtype=torch.float64)).sum().backward()
        trace = nw.step()
    assert nw.first_anomaly is None
    out = next(r for r in trace.records if r.phase is Phase.FORWARD and r.role == "output")
    assert out.stat is not None and out.stat.max == pytest.approx(4e299)


def test_float16_overflow_on_the_gpu_is_found_where_it_was_born() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).cuda().half()
    with torch.no_grad():
        model[2].weight.fill_(3000.0)  # 64 inputs of up to ~5 times 3000 > 65504
    x = torch.rand(8, 16, device="cuda").half() * 4
    with nanwatch.watch(model, on_anomaly="record") as nw:
        model(x).float().mean().backward()
        trace = nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.FORWARD
    assert a.path == "2" and a.record.phase is Phase.FORWARD and a.record.dtype == "float16"
    assert trace.diagnoses and trace.diagnoses[0].code == "NW101"
    assert any("65504" in e or "float16" in e for e in trace.diagnoses[0].evidence)


def test_a_nan_born_in_backward_on_the_gpu_is_found_in_backward() -> None:
    class Distance(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return ((a - b) ** 2).sum(-1).sqrt()  # d/dx sqrt at 0 is inf

    model = nn.Linear(8, 8).cuda()
    dist = Distance()
    x = torch.randn(4, 8, device="cuda")
    with nanwatch.watch(model, dist, on_anomaly="record") as nw:
        e = model(x)
        dist(e, e.detach()).mean().backward()  # distance 0: NaN gradient
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD
    assert a.path == "Distance"


def test_healthy_bf16_autocast_transformer_training_stays_quiet() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, norm_first=True)
    model = nn.Sequential(nn.Embedding(100, 64), nn.TransformerEncoder(layer, 2),
                          nn.Linear(64, 100)).cuda()  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    with nanwatch.watch(model, criterion) as nw:
        for _ in range(5):
            ids = torch.randint(0, 100, (8, 16), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
    assert nw.first_anomaly is None
    assert all(d.severity != "error" for t in nw.history for d in t.diagnoses)
    assert {r.dtype for r in nw.history[-1].records} >= {"bfloat16", "float32"}


def test_fp16_with_grad_scaler_skipped_steps_are_not_anomalies() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)  # first steps overflow: skipped
    criterion = nn.CrossEntropyLoss()
    with nanwatch.watch(model, criterion, scaler=scaler) as nw:
        for _ in range(6):
            x = torch.randn(16, 32, device="cuda")
            y = torch.randint(0, 10, (16,), device="cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    assert scaler.get_scale() < 2.0**40  # it did skip and back off
    assert all(d.severity != "error" for t in nw.history for d in t.diagnoses)


def test_a_device_side_assert_leaves_a_post_mortem_and_the_users_error(tmp_path: Path) -> None:
    """guards=False lets the bad target reach the kernel: CUDA's assert kills the context.
    The user's RuntimeError comes out unchanged and the report is written without
    touching the GPU."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            import nanwatch

            model = nn.Linear(8, 5).cuda()
            criterion = nn.CrossEntropyLoss()
            x = torch.randn(16, 8, device="cuda")
            y = torch.randint(0, 5, (16,), device="cuda")
            y[3] = 255
            with nanwatch.watch(model, criterion, guards=False, report_dir=".") as nw:
                for _ in range(3):
                    loss = criterion(model(x), y)
                    loss.backward()
                    print("loss", loss.item())
                    nw.step()
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "Assertion `t >= 0 && t < n_classes` failed" in proc.stderr  # the kernel's own
    # the user's own exception (torch.AcceleratorError, a RuntimeError, in torch >= 2.8).
    # Which call first meets the dead context is up to timing: the next kernel launch says
    # "device-side assert triggered", a cuBLAS call (the Linear's backward) says
    # CUBLAS_STATUS_EXECUTION_FAILED (seen on an H100 with torch 2.11)
    pattern = (
        r"^(torch\.AcceleratorError|RuntimeError): CUDA error: "
        r"(device-side assert|CUBLAS_STATUS_EXECUTION_FAILED)"
    )
    found = re.search(pattern, proc.stderr, re.MULTILINE)
    assert "Traceback" in proc.stderr and found, proc.stderr[-2000:]
    assert "post-mortem report written" in proc.stderr
    reports = sorted(tmp_path.glob("nanwatch-*.json"))
    assert len(reports) == 1
    report = Report.load(reports[0])
    assert report.error is not None and report.error["device_lost"]
    expected = "cuda-device-assert" if "device-side" in found[2] else "cuda-error"
    assert report.error["class"] == expected


def test_guards_stop_the_bad_target_before_the_kernel_and_the_gpu_lives_on() -> None:
    model = nn.Linear(8, 5).cuda()
    criterion = nn.CrossEntropyLoss()
    x = torch.randn(16, 8, device="cuda")
    y = torch.randint(0, 5, (16,), device="cuda")
    y[3] = 255
    with pytest.raises(nanwatch.GuardError, match="255"), nanwatch.watch(model, criterion):
        criterion(model(x), y)
    y[3] = 0
    assert math.isfinite(criterion(model(x), y).item())  # the context is alive


def test_a_hand_written_losss_nan_gradient_is_named_without_a_sync_per_node() -> None:
    model = _mlp()
    x1 = torch.randn(8, 32, device="cuda")

    def step(x2: torch.Tensor) -> None:
        d = torch.sqrt(((model(x1) - model(x2)) ** 2).sum(-1))  # a distance by hand
        (d - 1.0).pow(2).mean().backward()

    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            step(torch.randn(8, 32, device="cuda"))
            nw.step()
        x2 = torch.randn(8, 32, device="cuda")
        _busy()
        assert _syncs(lambda: step(x2)) == []
        nw.step()
        assert nw.first_anomaly is None
        same = x1.clone()
        same[:4] += 1.0  # rows 4..7: the same sample twice, a distance of 0
        step(same)
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.path == "(loss)"
    assert a.op is not None and a.op.op == "aten.sqrt"
    assert nw.history[-1].diagnoses[0].code == "NW112"


@pytest.mark.parametrize("backward_in_block", [True, False], ids=["step", "forward"])
def test_a_step_run_on_a_stream_of_its_own_is_read_after_that_stream(
    backward_in_block: bool,
) -> None:
    """The forward (and backward) in ``with torch.cuda.stream(s)``, the rest after the
    block, on the default stream. ``forward``: the backward and the gradient norms, on the
    default stream, wait for ``s``; without that wait they used statistics and gradients
    ``s`` had not computed yet (``s`` is held 100 ms behind the host here; seen failing on
    an H100 with the wait off). ``step``: everything nanwatch enqueues during backward is
    on ``s`` itself and ordered by it, with or without the wait: it checks that a step
    wholly on a stream of its own is read right, and the update's case below is the one
    whose read at ``nw.step()`` needs the wait."""
    model = _mlp()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    outputs: list[torch.Tensor] = []
    norms: list[float] = []
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            with torch.cuda.stream(side):
                _busy()
                x = torch.randn(16, 32, device="cuda")
                if step == 2:
                    x[3, 5] = float("nan")
                out = model(x)
                outputs.append(out.detach())
                loss = out.square().mean()
                if backward_in_block:
                    loss.backward()
            if not backward_in_block:
                loss.backward()
            nw.step()
            torch.cuda.synchronize()
            norms.append(
                torch.linalg.vector_norm(
                    torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
                ).item()
            )
            model.zero_grad()
    a = nw.first_anomaly
    assert a is not None and a.step == 2 and a.kind.value == "input", a.summary
    for step in (0, 1):  # the healthy steps were read as they were, not as garbage
        trace = nw.history[step]
        assert trace.anomaly is None
        rec = next(r for r in trace.records if r.path == "4" and r.phase is Phase.FORWARD)
        assert rec.stat is not None
        assert rec.stat.max == pytest.approx(outputs[step].max().item(), rel=1e-6)
        assert rec.stat.min == pytest.approx(outputs[step].min().item(), rel=1e-6)
        assert trace.grad_norm == pytest.approx(norms[step], rel=1e-4)


def test_an_update_on_a_stream_of_its_own_is_weighed_after_that_stream() -> None:
    """Forward, backward and ``optimizer.step()`` all in ``with torch.cuda.stream(s)``, and
    ``nw.step()`` after the block, on the default stream. watch weighs the weights the
    update wrote at ``nw.step()``: that read waits for ``s``, or it weighs the weights as
    they were before an update ``s`` has not run yet, and a learning rate of inf goes
    unseen (the run's last step: no next forward reads them)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    weights: list[bool] = []
    with nanwatch.watch(model, on_anomaly="record", postmortem=False) as nw:
        for step in range(3):
            with torch.cuda.stream(side):
                model(torch.randn(16, 32, device="cuda")).square().mean().backward()
                if step == 2:
                    for group in opt.param_groups:
                        group["lr"] = float("inf")
                _busy()  # the update runs 100 ms after the host has moved on
                opt.step()
                opt.zero_grad()
            nw.step()
            torch.cuda.synchronize()
            weights.append(all(bool(p.isfinite().all()) for p in model.parameters()))
    assert weights == [True, True, False]  # the update of step 2 made them non-finite
    a = nw.first_anomaly
    assert a is not None and a.step == 2 and a.kind is AnomalyKind.PARAMETER, (
        a.summary if a else nw.history[-1].records
    )


class _Pool(nn.Module):
    """Attention pooling whose padding mask is made on the default device."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(8, 1)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pad = torch.arange(x.shape[1])[None, :] >= lengths[:, None]  # no device= given
        scores = self.score(x).squeeze(-1).masked_fill(pad, float("-inf"))
        return self.out((torch.softmax(scores, dim=-1)[..., None] * x).sum(1))


@pytest.mark.parametrize("mode", ["watch", "sentinel"])
def test_a_late_replay_makes_its_tensors_on_the_default_device(mode: str) -> None:
    """torch.set_default_device("cuda") is a TorchFunctionMode, out of force while its own
    handler runs ``loss.backward()``, where the forward is read: its replay still makes the
    mask on the GPU, and names the softmax of the fully masked row."""
    torch.manual_seed(0)
    torch.set_default_device("cuda")
    try:
        model = _Pool()
        with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
            lengths = torch.tensor([5, 0, 2])  # an empty sequence
            F.cross_entropy(
                model(torch.randn(3, 5, 8), lengths), torch.tensor([0, 1, 2])
            ).backward()
            nw.step()
    finally:
        torch.set_default_device(None)
    a = nw.first_anomaly
    assert a is not None and not nw.faults
    assert a.op is not None and a.op.op.startswith("aten._softmax"), a.summary
    assert nw.history[0].diagnoses[0].code == "NW402"


def test_errors_are_diagnosed_under_a_default_device_of_cuda() -> None:
    """torch.set_default_device("cuda") is a TorchFunctionMode: the post-mortem of the
    user's error still reads the step (its pinned buffer is made on the host)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), nn.Linear(16, 1)).cuda()
    criterion = nn.MSELoss()
    torch.set_default_device("cuda")
    try:
        x, y = torch.randn(64, 8), torch.randn(64)
        nw = nanwatch.watch(model, criterion, postmortem=False)
        with pytest.raises(nanwatch.GuardError), nw:
            criterion(model(x), y)  # (64, 1) against (64): broadcast
        nw2 = nanwatch.watch(model, postmortem=False)
        with pytest.raises(RuntimeError, match="inplace"), nw2:
            h = model[1](model[0](x))
            h.mul_(2)
            model[2](h).sum().backward()
    finally:
        torch.set_default_device(None)  # no mode left on the stack
    assert nw.faults == [] and nw2.faults == []
    assert [d.code for t in nw.history for d in t.diagnoses][:1] == ["NW506"]
    assert "NW403" in [d.code for t in nw2.history for d in t.diagnoses]


def test_lightning_on_the_gpu_finds_the_bad_batch(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from nanwatch.callbacks import NanWatchCallback

    from tests._lightning_models import submodule_model_class

    cb = NanWatchCallback(on_anomaly="warn")
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_epochs=1, limit_train_batches=5, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path, callbacks=[cb],
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="nanwatch: step 2"):
        trainer.fit(submodule_model_class("lightning.pytorch")())
    nw = cb.watcher
    assert nw is not None and not nw.attached
    a = nw.first_anomaly
    assert a is not None and a.step == 2 and a.record.device.startswith("cuda")
    top = next(t for t in nw.history if t.step == 2).diagnoses[0]
    assert top.code == "NW401"


@pytest.mark.parametrize("loss_kind", ["module", "functional"])
def test_a_training_step_captured_in_a_cuda_graph_is_not_broken_by_the_hooks(
    loss_kind: str,
) -> None:
    """torch.cuda.graph forbids any host read while it captures: the guards' reads (and the
    loss code's checks) step aside, the capture succeeds, the replays train, and nanwatch
    says once that it cannot see them. The recipe is PyTorch's whole-network capture."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return criterion(out, y) if loss_kind == "module" else F.cross_entropy(out, y)

    x = torch.randn(16, 32, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    with nanwatch.watch(model, criterion) as nw:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                loss_of(x, y).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        captured = pytest.warns(RuntimeWarning, match="CUDA graph is being captured")
        with captured, torch.cuda.graph(graph):
            loss = loss_of(x, y)
            loss.backward()
            opt.step()
        graph.replay()  # the capture ran no kernel: the first replay computes the loss
        first = loss.item()
        for _ in range(5):
            graph.replay()
            nw.step()
        assert 0 < loss.item() < first  # the replays trained
    assert nw.first_anomaly is None


def test_compile_with_cuda_graphs_runs_under_watch() -> None:
    """torch.compile(mode="reduce-overhead") records CUDA graphs of the compiled model; the
    watched eager hooks must neither break it nor fail."""
    model = _mlp()
    compiled = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    x = torch.randn(16, 32, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not watched under torch.compile" is expected
        with nanwatch.watch(model, criterion) as nw:
            for _ in range(5):
                loss = criterion(compiled(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                nw.step()
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
