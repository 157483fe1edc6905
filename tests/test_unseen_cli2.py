"""``nanwatch run`` with processes the script starts (``mp.spawn`` ranks, a
``multiprocessing.Process``), and the user's line when the NaN is made inside an installed
package (a Hugging Face model computing its own loss)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch

import nanwatch
from nanwatch import _frames, cli

ROOT = Path(__file__).resolve().parent.parent


def _nanwatch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "nanwatch", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=180,
        check=False,
        env=env,
    )


# ------------------------------------------------------------ processes the script starts

_SPAWN_DDP = """
import datetime, os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank, world, port):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(4):
            x, y = torch.randn(4, 4), torch.randn(4, 1)
            if rank == 1 and step == 2:
                x[1, 3] = float("nan")
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, int(sys.argv[1])), nprocs=2, join=True)
    print("spawn returned")
"""


def _reports(folder: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def test_run_watches_each_mp_spawn_rank_and_the_bad_rank_reports_the_cause(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train_ddp.py"
    script.write_text(_SPAWN_DDP)
    port = str(20000 + os.getpid() % 20000)
    out = _nanwatch("run", "--report-dir", "rep", script.name, port, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text  # the rank's AnomalyError fails mp.spawn, as it would
    assert "spawn returned" not in text
    names = sorted(p.name for p in (tmp_path / "rep").glob("*.json"))
    bad = [n for n in names if "-rank1-step2" in n]
    assert bad, names  # rank 1 wrote its own post-mortem, named with its rank
    report = json.loads((tmp_path / "rep" / bad[0]).read_text())
    assert "NW401" in json.dumps(report)  # NaN in the input data, of rank 1's batch
    # the parent ran no model: mp.spawn's error adds no report of its own
    assert all("-rank0-step0" not in n for n in names), names
    assert "ProcessRaisedException (nanwatch anomaly)" not in text


_PLAIN_PROCESSES = """
import multiprocessing as mp
import torch


def train(tag):
    torch.set_num_threads(1)
    model = torch.nn.Linear(3, 1)
    x = torch.ones(2, 3)
    x[0, 0] = float("inf") if tag == "a" else 1.0
    model(x).sum().backward()


class Trainer(mp.get_context("fork").Process):
    def run(self):
        torch.set_num_threads(1)
        model = torch.nn.Linear(3, 1)
        model(torch.full((2, 3), float("nan"))).sum().backward()


if __name__ == "__main__":
    procs = [mp.get_context("spawn").Process(target=train, args=("a",), name="spawned"),
             Trainer(name="forked")]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print("exit codes", [p.exitcode for p in procs])
"""


@pytest.mark.skipif(sys.platform == "win32", reason="fork start method")
def test_run_watches_a_multiprocessing_process_of_spawn_and_fork(tmp_path: Path) -> None:
    script = tmp_path / "workers.py"
    script.write_text(_PLAIN_PROCESSES)
    out = _nanwatch(
        "run", "--on-anomaly", "record", "--report-dir", "rep", script.name, cwd=tmp_path
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "exit codes [0, 0]" in text
    names = sorted(p.name for p in (tmp_path / "rep").glob("*.json"))
    # each child's end-of-run report, named with the process (no rank: no process group)
    assert names == ["workers-forked.json", "workers-spawned.json"], (names, text)
    spawned = (tmp_path / "rep" / "workers-spawned.json").read_text()
    forked = (tmp_path / "rep" / "workers-forked.json").read_text()
    assert '"inf"' in spawned.lower() or "inf in the input" in spawned.lower()
    assert "nan" in forked.lower()


def _user_target() -> None:  # a function of the script's own: watched in its process
    return None


def test_children_watched_wraps_user_targets_only_and_leaves_no_patch(tmp_path: Path) -> None:
    import multiprocessing.pool

    from torch.utils.data._utils.worker import _worker_loop

    original = BaseProcess.start
    options = {"on_anomaly": "record", "report_dir": str(tmp_path)}
    with cli._children_watched(options, "train.py"):
        assert BaseProcess.start is not original
        user = multiprocessing.Process(target=_user_target)
        restore = cli._wrap_process(user, options, "train.py")
        assert isinstance(user._target, cli._Watched)  # type: ignore[attr-defined]
        restore()
        assert user._target is _user_target  # type: ignore[attr-defined]
        for target in (multiprocessing.pool.worker, _worker_loop):  # a Pool's, a DataLoader's
            proc = multiprocessing.Process(target=target)
            assert cli._wrap_process(proc, options, "train.py") is cli._nothing
            assert proc._target is target  # type: ignore[attr-defined]
    assert BaseProcess.start is original


# ------------------------------------------------------ a NaN made inside an installed package

_LIBRARY_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class TinyClassifier(nn.Module):
    """A model that computes its own loss from the labels it is given, as HF models do."""

    def __init__(self, num_labels=3):
        super().__init__()
        self.num_labels = num_labels
        self.head = nn.Linear(4, num_labels)

    def forward(self, x, labels=None):
        logits = self.head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return loss, logits
'''


@pytest.fixture
def installed_library(tmp_path: Path) -> Iterator[str]:
    """A package installed in a ``site-packages`` folder; removed from the import system
    afterwards."""
    site = tmp_path / "env" / "lib" / "site-packages"
    pkg = site / "nw_fakelib_cli2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(_LIBRARY_MODEL))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield "nw_fakelib_cli2"
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("nw_fakelib_cli2", None)


def test_a_frame_of_an_installed_package_is_not_the_users_line(tmp_path: Path) -> None:
    purelib = sysconfig.get_paths()["purelib"]
    assert _frames.is_internal(os.path.join(purelib, "transformers", "modeling_bert.py"))
    assert _frames.is_internal("/opt/conda/lib/python3.11/site-packages/timm/layers/x.py")
    assert _frames.is_internal("/usr/lib/python3/dist-packages/somelib/model.py")
    assert not _frames.is_internal(str(tmp_path / "project" / "src" / "mymodel.py"))
    assert not _frames.is_internal(__file__)


def test_nan_made_inside_an_installed_model_names_the_users_call(
    installed_library: str, tmp_path: Path
) -> None:
    lib = importlib.import_module(installed_library)
    torch.manual_seed(0)
    model = lib.TinyClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    here = Path(__file__).name
    rep = str(tmp_path / "rep")
    with pytest.raises(nanwatch.AnomalyError) as info, nanwatch.watch(model, report_dir=rep) as nw:
        for step in range(3):
            x = torch.randn(4, 4)
            labels = torch.randint(0, 3, (4,)) if step < 2 else torch.full((4,), -100)
            opt.zero_grad()
            loss, _ = model(x, labels)  # the user's line
            loss.backward()
            opt.step()
            nw.step()
    d = info.value.diagnosis
    assert d.code == "NW113", d
    assert d.source is not None and d.source.rpartition(":")[0].endswith(here), d.source
    line = int(d.source.rsplit(":", 1)[1])
    assert "loss, _ = model(x, labels)" in Path(__file__).read_text().splitlines()[line - 1]
    assert "site-packages" not in d.fix
    assert "self.num_labels" not in d.fix  # the library's own names: not in the user's code
    assert "if not (labels != -100).any():" in d.fix  # the user's own names: skip the batch
