"""The places nanwatch names are shown relative to the working directory (``train.py:11``)
and their lines read back by that name through ``linecache``, which keys its cache by the
name as given: a second ``train.py`` in another directory must not be read as the first
(two scripts run by ``nanwatch run`` in one process, a test suite: the cause of a fix that
differed between a lone run and the whole suite)."""

from __future__ import annotations

import linecache
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanwatch import _frames


@pytest.fixture
def two_scripts(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "train.py").write_text("p = torch.sigmoid(model(xb))\n")
    (b / "train.py").write_text("p = model(xb)\n")
    yield a / "train.py", b / "train.py"
    linecache.cache.pop("train.py", None)


def test_the_same_relative_name_in_another_directory_reads_the_new_file(
    two_scripts: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = two_scripts
    monkeypatch.chdir(first.parent)
    assert _frames._short(str(first)) == "train.py"
    assert linecache.getline("train.py", 1) == "p = torch.sigmoid(model(xb))\n"
    monkeypatch.chdir(second.parent)
    assert _frames._short(str(second)) == "train.py"
    assert linecache.getline("train.py", 1) == "p = model(xb)\n"


def test_a_name_already_right_is_not_read_again(
    two_scripts: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _ = two_scripts
    monkeypatch.chdir(first.parent)
    _frames._short(str(first))
    entry = linecache.cache["train.py"]
    assert _frames._short(str(first)) == "train.py"
    assert linecache.cache["train.py"] is entry


def test_a_path_outside_the_working_directory_stays_absolute(
    two_scripts: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = two_scripts
    monkeypatch.chdir(first.parent)
    assert _frames._short(str(second)) == str(second)
    assert "train.py" not in linecache.cache


def test_a_fix_read_from_the_script_is_the_same_after_another_train_py(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_unseen_r3_bce_operands import _run

    other = tmp_path / "other"
    other.mkdir()
    (other / "train.py").write_text("import torch\n" * 30)
    monkeypatch.chdir(other)
    linecache.getline("train.py", 3)  # another script of that name, read first
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    try:
        found = _run(here, lr=5.0, scale=10.0)
    finally:
        linecache.cache.pop("train.py", None)
    fix = next(str(d["fix"]) for d in found if d.get("code") == "NW110")
    # before: "p = model(xb)   # first, at train.py:10 ...": the other file's line 10 showed
    # no "p = torch.sigmoid(...)", so the sigmoid was not seen on the user's line
    assert fix.startswith(
        "loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xb), yb)"
    ), fix
