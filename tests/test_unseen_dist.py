"""Multi-process training: exceptions that cross a process boundary (DataLoader workers,
pools), ranks under torchrun and mp.spawn, SIGTERM from a launcher, a peer rank's death."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import nanwatch
from nanwatch import cli, postmortem
from nanwatch.errors import AnomalyError, ConfigError, GuardError, guard_error_class
from nanwatch.postmortem import classify

ROOT = Path(__file__).resolve().parent.parent

#: what gloo says on a rank whose peer died (torch 2.x, transport/tcp/pair.cc)
_GLOO_PEER = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:45803. This is typically caused by a remote worker crashing. Check the logs "
    "of the remote worker before reporting an error."
)
#: and NCCL (ProcessGroupNCCL's error text for ncclRemoteError)
_NCCL_PEER = (
    "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network "
    "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network "
    "error or a remote process exiting prematurely."
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, crit: nn.Module) -> None:
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    crit(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# ------------------------------------------------------------- 1. pickling errors
def test_guard_error_of_torchs_type_pickles_by_reference_into_a_fresh_process() -> None:
    cls = guard_error_class(IndexError)
    data = pickle.dumps(cls)
    assert pickle.loads(data) is cls
    code = (
        "import pickle, sys\n"
        "cls = pickle.loads(sys.stdin.buffer.read())\n"
        "import nanwatch\n"
        "print(cls.__module__, cls.__qualname__, issubclass(cls, nanwatch.GuardError),"
        " issubclass(cls, IndexError), cls.torch_error_type.__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=data, capture_output=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split() == ["nanwatch", "GuardError", "True", "True", "IndexError"]


def test_guard_error_instance_still_pickles_with_its_type_and_attributes() -> None:
    err = guard_error_class(IndexError)("label 3 of 3", check="index-range", values=(3,))
    copy_ = pickle.loads(pickle.dumps(err))
    assert type(copy_) is type(err)
    assert (str(copy_), copy_.check, copy_.values) == ("label 3 of 3", "index-range", (3,))
    assert pickle.loads(pickle.dumps(GuardError)) is GuardError


class _OneHotLabels(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """One-hot targets made in the Dataset; label 3 of 3 classes is stopped the way
    nanwatch's guard stops it (a GuardError that is torch's IndexError too)."""

    def __init__(self) -> None:
        self.x = torch.randn(16, 8)
        self.y = torch.randint(0, 3, (16,))
        self.y[13] = 3

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        label = int(self.y[i])
        if label >= 3:
            raise guard_error_class(IndexError)(
                f"F.one_hot: label {label} is outside 0..2", check="index-range"
            )
        return self.x[i], F.one_hot(self.y[i], num_classes=3).float()


def test_guard_error_raised_in_a_dataloader_worker_reaches_the_training_loop() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    # timeout: the old failure was a hang (the worker could not send the error at all)
    loader = DataLoader(_OneHotLabels(), batch_size=4, num_workers=2, timeout=120)
    steps = 0
    with pytest.raises(GuardError, match=r"label 3 is outside 0\.\.2") as info:
        for x, y in loader:
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps += 1
    assert isinstance(info.value, IndexError)  # `except IndexError:` still catches it
    assert steps < 4


def test_anomaly_error_round_trips_through_pickle() -> None:
    err = AnomalyError("NaN in fc1", anomaly=None, diagnoses=["d1", "d2"])
    copy_ = pickle.loads(pickle.dumps(err))
    assert type(copy_) is AnomalyError
    assert (str(copy_), copy_.anomaly, copy_.diagnoses, copy_.diagnosis) == (
        "NaN in fc1",
        None,
        ["d1", "d2"],
        "d1",
    )


def test_config_error_round_trips_through_pickle() -> None:
    err = ConfigError("mode", "fast", "`mode` can be sentinel, watch, forensic, got 'fast'")
    copy_ = pickle.loads(pickle.dumps(err))
    assert (copy_.name, copy_.value, str(copy_)) == ("mode", "fast", str(err))


# ------------------------------------------------------------- 2. end-of-run per rank
_NAN_SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = nn.CrossEntropyLoss()
for step in range(3):
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    if step == 1:
        x[0, 0] = float("nan")
    crit(model(x), y).backward()
    opt.step()
    opt.zero_grad()
"""


def test_run_under_a_launcher_writes_the_end_of_run_report_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text(_NAN_SCRIPT)
    reports = tmp_path / "reports"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = cli.main(["run", "--on-anomaly", "record", "--report-dir", str(reports), str(script)])
    assert code == 0
    assert sorted(p.name for p in reports.iterdir()) == ["train-rank1.html", "train-rank1.json"]


def test_run_without_a_launcher_keeps_the_plain_report_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text(_NAN_SCRIPT)
    reports = tmp_path / "reports"
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = cli.main(["run", "--on-anomaly", "record", "--report-dir", str(reports), str(script)])
    assert code == 0
    assert sorted(p.name for p in reports.iterdir()) == ["train.html", "train.json"]


# ------------------------------------------------------------- 3. SIGTERM, distributed
def test_no_sigterm_handler_is_installed_in_a_launched_distributed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = _mlp()
    before = signal.getsignal(signal.SIGTERM)
    with nanwatch.watch(model, report_dir=str(tmp_path)):
        # the default action must stay: a rank blocked in a collective ends at once
        assert signal.getsignal(signal.SIGTERM) is before
        model(torch.randn(2, 8)).sum().backward()
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_sigterm_handler_is_still_installed_in_a_single_process_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    with nanwatch.watch(_mlp(), report_dir=str(tmp_path)):
        assert isinstance(signal.getsignal(signal.SIGTERM), postmortem._SigtermHandler)
    assert signal.getsignal(signal.SIGTERM) is before


# ------------------------------------------------------------- 4. SIGTERM mid-report
_SIGTERM_WHILE_WRITING = """
import os, signal, sys
sys.path.insert(0, {root!r})
import torch
from torch import nn
import nanwatch
from nanwatch.report import Report

real_save = Report.save
def save(self, path):  # the launcher's SIGTERM lands while the post-mortem is written
    if str(path).endswith(".json"):
        os.kill(os.getpid(), signal.SIGTERM)
    return real_save(self, path)
Report.save = save

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = nn.CrossEntropyLoss()
with nanwatch.watch(model, crit, report_dir={reports!r}):
    for step in range(3):
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        if step == 1:
            raise KeyError("missing key 'label' in sample")
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.parametrize("world_size", ["", "2"])
def test_sigterm_during_a_post_mortem_lets_it_finish_then_ends_the_process(
    tmp_path: Path, world_size: str
) -> None:
    reports = tmp_path / "reports"
    script = tmp_path / "train.py"
    script.write_text(_SIGTERM_WHILE_WRITING.format(root=str(ROOT), reports=str(reports)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if world_size:
        env.update(RANK="0", WORLD_SIZE=world_size)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == -signal.SIGTERM, out.stderr
    names = sorted(p.name for p in reports.iterdir())
    assert len(names) == 2, names  # one report, not a second one for the signal
    assert names == [names[1][: -len(".json")] + ".html", names[1]], names
    data = json.loads((reports / names[1]).read_text())
    assert data["error"]["type"] == "builtins.KeyError"
    assert (reports / names[0]).read_text().rstrip().endswith("</html>")
    assert "post-mortem report written" in out.stderr
    assert str(reports / names[1]) in out.stderr


# ------------------------------------------------------------- 5. rank after teardown
def test_post_mortem_after_destroy_process_group_keeps_the_rank(tmp_path: Path) -> None:
    store = dist.HashStore()
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    try:
        with pytest.raises(KeyError), nanwatch.watch(model, crit, report_dir=str(tmp_path)):
            try:
                _train_step(model, opt, crit)
                raise KeyError("label")
            finally:
                dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (path,) = tmp_path.glob("*.json")
    env = json.loads(path.read_text())["environment"]
    assert (env["rank"], env["world_size"]) == (0, 1)


def test_post_mortem_names_the_rank_the_launcher_gave_at_attach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(KeyError), nanwatch.watch(model, crit, report_dir=str(tmp_path)):
        _train_step(model, opt, crit)
        monkeypatch.delenv("RANK")  # a teardown that clears the launcher's variables
        monkeypatch.delenv("WORLD_SIZE")
        raise KeyError("label")
    (path,) = tmp_path.glob("*.json")
    assert "-rank1-" in path.name
    env = json.loads(path.read_text())["environment"]
    assert (env["rank"], env["world_size"]) == (1, 2)


def test_a_report_name_claimed_by_another_process_is_never_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    stem = "nanwatch-20260101-000000-rank0-step0"
    monkeypatch.setattr(postmortem, "report_stem", lambda report, when=None: stem)
    theirs = tmp_path / f"{stem}.json"
    theirs.write_text('{"theirs": true}')
    # the other process creates its file right after this one looked: every look says free
    monkeypatch.setattr(Path, "exists", lambda self: False)
    with pytest.raises(KeyError), nanwatch.watch(model, crit, report_dir=str(tmp_path)):
        _train_step(model, opt, crit)
        raise KeyError("label")
    monkeypatch.undo()
    assert theirs.read_text() == '{"theirs": true}'
    mine = json.loads((tmp_path / f"{stem}-2.json").read_text())
    assert mine["error"]["type"] == "builtins.KeyError"
    assert (tmp_path / f"{stem}-2.html").is_file()


# ------------------------------------------------------------- 6. a peer rank died
@pytest.mark.parametrize("message", [_GLOO_PEER, _NCCL_PEER], ids=["gloo", "nccl"])
def test_a_peers_failure_is_classified_as_such(message: str) -> None:
    info = classify(RuntimeError(message))
    assert info["class"] == "peer-failure"
    assert info["advice"] == (
        "A peer rank failed first and broke its connection to this one, so this error is a "
        "consequence: that rank's own report (one file per rank in the report directory, "
        "-rank<r>- in its name) names the cause."
    )


def test_post_mortem_of_a_rank_whose_peer_died_says_so(tmp_path: Path) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(RuntimeError), nanwatch.watch(model, crit, report_dir=str(tmp_path)):
        _train_step(model, opt, crit)
        raise RuntimeError(_GLOO_PEER)  # what DDP's all-reduce raises in backward
    report = nanwatch.Report.load(next(tmp_path.glob("*.json")))
    assert report.error is not None and report.error["class"] == "peer-failure"
    assert report.headline.startswith("RuntimeError (a peer rank failed first)")


def test_an_unrelated_runtime_error_is_not_a_peer_failure() -> None:
    assert classify(RuntimeError("the data file was closed by the reader"))["class"] == "other"
