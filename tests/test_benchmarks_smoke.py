"""The benchmark harness (benchmarks/, issue 8) still runs, in its quickest setting.

No timing is asserted: CI machines are noisy and a benchmark is not a unit test. What is
asserted is what a user of the harness would notice: every variant produces a ratio (or
says why it was skipped), the results file holds the table and the targets, nothing stays
attached to the model, and the torch.compile and GPU paths run.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks import gallery_device, gpu, hook_cost, long_run, run
from benchmarks._timing import minor_faults
from benchmarks.variants import VARIANTS, DebugUnderflowOverflow, make_runners
from benchmarks.workloads import build
from nanwatch import scenarios

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One thread: a busy CI machine slows two-thread kernels many times over."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_quick_run_gives_every_variant_a_ratio_and_writes_the_results(tmp_path: Path) -> None:
    out_file = tmp_path / "RESULTS.md"
    out = run.main(["--quick", "--results", str(out_file)])

    assert [r.name for r in out.results] == ["W1", "W2", "W3"]
    for r in out.results:
        assert set(r.cells) | set(r.skipped) == set(VARIANTS), r.name
        assert r.cells["unwatched"].ratio == 1.0
        assert r.cells["f-unwatched"].ratio == 1.0
        for key, cell in r.cells.items():
            assert cell.n >= 1, key
            assert cell.ms > 0 and math.isfinite(cell.ratio), key
            if minor_faults() is not None:  # counted wherever getrusage is there
                assert cell.faults >= 0, key
        # the nanwatch modes and detect_anomaly never need an optional dependency
        for key in ("sentinel", "watch", "watch-every10", "forensic", "detect_anomaly"):
            assert key in r.cells, (r.name, key)
        assert r.memory.get("watch", 0) > 0
        per_step, records = r.recorder["watch"]
        assert per_step > 0 and records > 0  # the flight recorder keeps each step

    text = out_file.read_text()
    assert out.path == out_file
    assert "| nanwatch watch |" in text
    assert "sentinel <= x1.02" in text and "watch <= x1.10" in text
    assert "python benchmarks/run.py --quick" in text
    assert "Not measured" in text  # no --gpu: says so instead of inventing numbers
    assert "- malloc: default" in text


def test_steady_malloc_is_recorded_with_the_page_faults_of_each_variant(tmp_path: Path) -> None:
    # mallopt is process-wide and permanent: a child process keeps this one's malloc as it is
    out_file = tmp_path / "R.md"
    root = Path(run.__file__).resolve().parent.parent
    argv = ["--quick", "--malloc", "steady", "--results", str(out_file)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *argv],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = out_file.read_text()
    malloc = next(line for line in text.splitlines() if line.startswith("- malloc: "))
    assert malloc.startswith("- malloc: steady"), malloc
    if run._glibc() is not None:  # glibc takes the settings; elsewhere the line says NOT
        assert "NOT" not in malloc and "M_MMAP_THRESHOLD 128 MiB" in malloc, malloc
    assert "python benchmarks/run.py --quick --malloc steady" in text  # the command to reproduce
    if minor_faults() is None:  # no getrusage here: said, not invented
        assert "not counted here" in text
        return
    table = text.split("Minor page faults per timed step", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "variant" not in line]
    names = {row.split(" | ")[0].lstrip("| ") for row in rows}
    assert {"unwatched", "nanwatch sentinel", "nanwatch watch"} <= names, table
    for row in rows:
        for cell in row.strip("|").split(" | ")[1:]:
            if cell.strip() != "—":
                assert float(cell.replace(",", "")) >= 0, row


def test_quick_run_without_results_option_writes_nothing(tmp_path: Path) -> None:
    before = run.RESULTS.read_text() if run.RESULTS.exists() else None
    out = run.main(["--quick", "--workloads", "W1", "--variants", "unwatched,sentinel"])
    assert out.path is None
    after = run.RESULTS.read_text() if run.RESULTS.exists() else None
    assert after == before
    assert set(out.results[0].cells) == {"unwatched", "sentinel"}


def test_a_variant_without_its_baseline_is_skipped_with_the_reason() -> None:
    out = run.main(["--quick", "--workloads", "W1", "--variants", "watch", "--no-memory"])
    assert out.results[0].cells == {}
    assert "baseline" in out.results[0].skipped["watch"]


def test_unknown_variant_is_refused_with_the_choices() -> None:
    with pytest.raises(SystemExit, match="unknown variant nope; choose from unwatched"):
        run.main(["--quick", "--variants", "nope"])


def test_runners_leave_nothing_attached() -> None:
    w = build("W2", quick=True)
    for r in make_runners().values():
        if r.unavailable() is not None:
            continue
        r.attach(w)
        r.step(w)
        r.detach()
        for m in w.model.modules():
            assert not m._forward_hooks and not m._forward_pre_hooks, (r.key, m)
    assert not torch.is_anomaly_enabled()


def test_debug_underflow_overflow_hooks_are_removed() -> None:
    pytest.importorskip("transformers")
    w = build("W1", quick=True)
    r = DebugUnderflowOverflow()
    r.attach(w)
    assert any(m._forward_hooks for m in w.model.modules())
    r.step(w)
    r.detach()
    assert not any(m._forward_hooks for m in w.model.modules())


def test_compile_path_runs_with_the_eager_backend() -> None:
    opts = run.Options(quick=True, steps=1)
    res = run.measure_compile("W1", opts, backend="eager", rounds=1)
    assert res.refused.startswith("ConfigError")  # nanwatch refuses a compiled module
    assert res.breaks_plain == 0
    assert res.breaks_watched == 0  # the hooks step aside while dynamo compiles: no break
    assert "compiled" in res.cells
    assert set(res.cells) | set(res.errors) == {
        "compiled",
        "compiled+loss-watch",
        "compiled+orig-watch",
    }


def test_gpu_decoder_code_path_runs_on_cpu_at_toy_size() -> None:
    out = gpu.run(
        batch=2, seq=8, rounds=1, steps=1, device="cpu", vocab=32, d_model=16, layers=1, heads=2
    )
    assert "not a GPU measurement" in out["device"]
    assert set(out["cells"]) == {"bf16", "fp16+GradScaler"}
    for cells in out["cells"].values():
        assert {"unwatched", "sentinel", "watch", "watch-every10", "detect_anomaly"} <= set(cells)
    out["peak_gib"] = 0.0
    md = gpu.markdown({2: out}, "python -m benchmarks.gpu --batches 2")
    assert "## Batch 2" in md and "| watch | x" in md
    assert re.search(r"- bf16: sentinel x\d\.\d{3} vs x1\.01 (met|MISSED)", md), md
    assert "vs detect_anomaly" in md


def test_the_gpu_benchmark_refuses_to_run_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu.main(["--batches", "2"])


def test_hook_cost_quick_reports_per_module_microseconds(tmp_path: Path) -> None:
    md = hook_cost.main(["--quick", "--out", str(tmp_path / "HOOK_COST.md")])
    assert (tmp_path / "HOOK_COST.md").read_text() == md
    assert "µs/module" in md and "| nanwatch watch |" in md
    assert "forward hook" in md and "gradient hook" in md
    assert "watcher.py" in md  # the profile names nanwatch's own functions
    # each of W3's guards is measured: its embedding's and its loss's, once a step each
    assert re.search(r"\| embed \(Embedding\) \| \(2, 8\) int64 \| 1 \| \d+\.\d \|", md), md
    assert re.search(r"\| CrossEntropyLoss \(CrossEntropyLoss\) \| .* \| 1 \| \d+\.\d \|", md)


def test_a_failed_sentinel_target_is_explained_with_its_gradient_norm_floor() -> None:
    # the issue asks for the profile that shows why a target is out of reach: sentinel's
    # split times the gradients' norms alone (a read of every gradient) and its parts
    from nanwatch import watcher

    hot_l2 = watcher.l2
    sp = hook_cost.split("W1", True, 1, mode="sentinel")
    assert watcher.l2 is hot_l2  # the probe is put back
    assert sp.mode == "sentinel" and sp.grads == 16  # 8 Linear layers: weight and bias
    assert sp.grad_elements == 8 * (64 * 64 + 64)
    assert all(ms > 0 for ms in sp.grad_norm_ms)
    assert {"_check_grads", "_evaluate", "l2"} <= set(sp.parts)
    result = run.WorkloadResult("W1", "", 18, sentinel_split=sp)
    (why,) = run.why_markdown([result])
    assert why.startswith("- W1, `sentinel`: ") and "16 parameter gradients" in why
    assert "gradient norms (every parameter gradient, once)" in why


@pytest.mark.cpu_path(reason="checks that Watcher.attach is put back, which the plugin replaces")
def test_the_gallery_on_a_device_says_where_it_differs() -> None:
    rows = gallery_device.run("cpu", "watch", accelerator_path=True)
    assert len(rows) == len(scenarios.names())
    assert all(r["mismatch"] == [] and r["faults"] == [] for r in rows), rows
    from nanwatch.watcher import Watcher

    assert Watcher.attach.__name__ == "attach"  # put back


def test_long_run_measures_every_case_and_mode() -> None:
    out = long_run.main(["--quick"])
    assert [(g.case, g.mode) for g in out] == [
        (c, m) for c in ("plain", "dead", "nan") for m in ("watch", "sentinel")
    ]
    assert all(g.first_ms > 0 and g.last_ms > 0 and math.isfinite(g.growth) for g in out)
