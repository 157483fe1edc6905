"""The package as users install it: the wheel ships nanwatch.callbacks (from the folder
callbacks/), py.typed and the console script; the editable install imports it too."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, cwd=cwd, timeout=300, check=False
    )


def test_the_editable_install_imports_the_callbacks_subpackage() -> None:
    out = _run(
        sys.executable,
        "-c",
        "import nanwatch.callbacks as c, nanwatch; print(c.__file__); "
        "print(c.NanWatchCallback.__module__)",
    )
    assert out.returncode == 0, out.stderr
    path, module = out.stdout.split()
    assert Path(path).parent.name == "callbacks"
    assert module.startswith("nanwatch.callbacks")


@pytest.mark.slow
def test_a_built_wheel_ships_callbacks_typing_and_the_command(tmp_path: Path) -> None:
    pytest.importorskip("build")
    out = _run(
        sys.executable,
        "-m",
        "build",
        "--wheel",
        "--no-isolation",
        "--outdir",
        str(tmp_path),
        str(ROOT),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("nanwatch-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        entry_points = zf.read(entry).decode()
    assert "nanwatch/callbacks/__init__.py" in names
    assert "nanwatch/callbacks/lightning.py" in names
    assert "nanwatch/py.typed" in names
    assert "nanwatch/scenarios/div_by_zero.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "callbacks/")) for n in names)
    assert "nanwatch = nanwatch.cli:main" in entry_points
    # installed from the wheel alone (into a folder first on the path), it imports
    target = tmp_path / "site"
    out = _run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--quiet",
        "--target",
        str(target),
        str(wheel),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    probe = (
        f"import sys; sys.path.insert(0, {str(target)!r}); "
        "import nanwatch, nanwatch.callbacks as c; "
        f"assert nanwatch.__file__.startswith({str(target)!r}), nanwatch.__file__; "
        "print(c.NanWatchCallback.__name__)"
    )
    out = _run(sys.executable, "-c", probe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "NanWatchCallback"
