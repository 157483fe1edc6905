"""nanwatch run around a script that watches its model itself: the script's own watcher
alone watches and reports while it is attached (one report per problem, with the
script's options), and nanwatch run's global watcher takes over again after it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import cli
from nanwatch.errors import AnomalyError, NanwatchError

_WATCHED = (
    "import torch, nanwatch\n"
    "m = torch.nn.Linear(3, 1)\n"
    "with nanwatch.watch(m, {options}) as nw:\n"
    "    for it in range(3):\n"
    "        x = torch.ones(4, 3)\n"
    "        if it == 2:\n"
    "            x[1, 0] = float('nan')\n"
    "        m(x).pow(2).mean().backward()\n"
    "        nw.step()\n"
    "{after}"
)


def _script(tmp_path: Path, options: str, after: str = "") -> str:
    path = tmp_path / "train.py"
    path.write_text(_WATCHED.format(options=options, after=after))
    return str(path)


def _jsons(d: Path) -> list[Path]:
    return sorted(d.glob("*.json")) if d.exists() else []


def test_a_warning_of_the_scripts_own_watcher_is_said_once_under_run(tmp_path: Path) -> None:
    mine, cli_dir = tmp_path / "mine", tmp_path / "cli"
    script = _script(tmp_path, f"on_anomaly='warn', report_dir={str(mine)!r}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = cli.main(["run", "--on-anomaly", "warn", "--report-dir", str(cli_dir), script])
    assert code == 0
    said = [str(w.message) for w in caught if "NaN" in str(w.message)]
    assert len(said) == 1, said
    assert "step 2" in said[0]  # the script's own step, not the global watcher's count
    assert "print(nw.report)" in said[0]  # the script's watcher spoke: it holds nw


def test_the_scripts_on_anomaly_record_is_kept_under_run(tmp_path: Path) -> None:
    out = tmp_path / "seen.txt"
    after = f"open({str(out)!r}, 'w').write(str(nw.first_anomaly.step))\n"
    script = _script(tmp_path, "on_anomaly='record', postmortem=False", after)
    # nanwatch run's default is raise: its watcher stood aside, the script's recorded
    assert cli.main(["run", "--report-dir", str(tmp_path / "cli"), script]) == 0
    assert out.read_text() == "2"


def test_the_scripts_anomaly_error_is_its_own_and_reported_once(tmp_path: Path) -> None:
    mine, cli_dir = tmp_path / "mine", tmp_path / "cli"
    script = _script(tmp_path, f"report_dir={str(mine)!r}")
    with pytest.raises(AnomalyError) as info:
        cli.main(["run", "--report-dir", str(cli_dir), script])
    assert "step 2" in str(info.value)
    assert "print(nw.report)" in str(info.value)  # raised by the script's watcher
    assert len(_jsons(mine)) == 1
    assert _jsons(cli_dir) == []


def test_a_crash_inside_the_scripts_watcher_gets_one_post_mortem(tmp_path: Path) -> None:
    mine, cli_dir = tmp_path / "mine", tmp_path / "cli"
    path = tmp_path / "crash.py"
    path.write_text(
        "import torch, nanwatch\n"
        "m = torch.nn.Linear(3, 1)\n"
        f"with nanwatch.watch(m, report_dir={str(mine)!r}) as nw:\n"
        "    m(torch.ones(2, 3)).sum().backward()\n"
        "    nw.step()\n"
        "    raise RuntimeError('user boom')\n"
    )
    with pytest.raises(RuntimeError, match="user boom"):  # unchanged
        cli.main(["run", "--report-dir", str(cli_dir), str(path)])
    assert len(_jsons(mine)) == 1
    assert _jsons(cli_dir) == []


def test_run_watches_again_after_the_scripts_watcher_and_still_writes_its_post_mortem(
    tmp_path: Path,
) -> None:
    cli_dir = tmp_path / "cli"
    after = (
        "x = torch.ones(4, 3)\n"
        "x[0, 1] = float('inf')\n"
        "m(x - x).sum().backward()\n"  # NaN after the script's watcher detached
        "print('not reached')\n"
    )
    script = _script(tmp_path, "on_anomaly='record', postmortem=False", after)
    with pytest.raises(AnomalyError) as info:
        cli.main(["run", "--report-dir", str(cli_dir), script])
    assert "full report: in" in str(info.value)  # nanwatch run's watcher raised it
    assert len(_jsons(cli_dir)) == 1


def test_watch_all_stands_aside_while_a_watcher_of_named_modules_is_attached() -> None:
    m = nn.Linear(2, 2)
    with nanwatch.watch_all(on_anomaly="record", postmortem=False) as everything:
        with nanwatch.watch(m, on_anomaly="record", postmortem=False) as mine:
            m(torch.full((1, 2), float("nan"))).sum().backward()
            mine.step()
            assert not everything.attached
        assert everything.attached
        assert everything.module_paths == []  # it saw nothing of the watched block
        assert mine.first_anomaly is not None
        m(torch.ones(1, 2))
        assert everything.module_paths == ["Linear"]
    assert everything.first_anomaly is None


def test_a_global_watcher_detached_while_standing_aside_leaves_no_hook() -> None:
    before = dict(torch.nn.modules.module._global_forward_pre_hooks)
    m = nn.Linear(2, 2)
    everything = nanwatch.watch_all(on_anomaly="record", postmortem=False).attach()
    mine = nanwatch.watch(m, on_anomaly="record", postmortem=False).attach()
    again = nanwatch.watch_all(postmortem=False).attach()  # stands aside at once
    try:
        assert not again.attached
        with pytest.raises(NanwatchError):
            again.attach()  # standing aside is attached: a second attach is an error
        everything.detach()  # while it stands aside
        again.detach()
        assert dict(torch.nn.modules.module._global_forward_pre_hooks) == before
    finally:
        again.detach()
        everything.detach()
        mine.detach()
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == before
