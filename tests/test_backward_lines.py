"""A backward op is named by the forward line that created its autograd node (and the
``backward()`` call that ran it), never by nanwatch's own frames or its launcher's."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch import _frames
from nanwatch.ops import OpChecker
from nanwatch.records import LOSS_PATH, AnomalyKind, Phase

HERE = os.path.basename(__file__)


def _line(fn: Callable[..., Any], marker: str) -> str:
    """``test_backward_lines.py:N`` of the line of ``fn`` that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{HERE}:{start + offset}"


def _focal_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    p = torch.softmax(model(x), -1).gather(1, y[:, None]).squeeze(1)
    loss = (-((1 - p) ** 0.5) * torch.log(p.clamp_min(1e-12))).mean()  # focal
    loss.backward()  # the backward call


def _saturated_linear() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.mul_(100)  # softmax saturates: p == 1 exactly for most rows
    return model, torch.randn(32, 4), torch.randint(0, 3, (32,))


def test_forensic_names_the_forward_line_of_a_backward_op_in_loss_code() -> None:
    model, x, y = _saturated_linear()
    with nanwatch.watch(model, mode="forensic", on_anomaly="record") as nw:
        _focal_step(model, x, y)
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD and a.origin == "after-output"
    op = a.op
    assert op is not None and op.phase is Phase.BACKWARD and op.node == "PowBackward0"
    assert op.path == LOSS_PATH  # the loss code's node, not the Linear's
    assert op.source is not None and op.source.endswith(_line(_focal_step, "# focal"))
    assert op.code is not None and "** 0.5" in op.code
    assert op.backward_at is not None
    assert op.backward_at.endswith(_line(_focal_step, "# the backward call"))
    assert "use mode='forensic'" not in a.summary  # it is forensic: the op is named
    assert f"in the backward of {op.source}" in a.summary


class _Distance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))  # the sqrt


def test_forensic_names_the_forward_line_in_a_modules_code() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    dist = _Distance()
    with nanwatch.watch(model, dist, mode="forensic", on_anomaly="record") as nw:
        h = model(torch.randn(2, 3))
        dist(h, h.detach()).sum().backward()  # identical vectors: sqrt at 0
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD
    op = a.op
    assert op is not None and op.node == "SqrtBackward0" and op.path == a.path
    assert op.source is not None and op.source.endswith(_line(_Distance.forward, "# the sqrt"))
    assert op.backward_at is not None and op.backward_at.endswith(
        _line(test_forensic_names_the_forward_line_in_a_modules_code, "sqrt at 0")
    )
    assert not torch.is_anomaly_enabled()


def test_a_raise_from_inside_backward_adds_no_anomaly_mode_warning() -> None:
    """Anomaly mode would say "Error detected in AddmmBackward0" with the Linear's forward
    stack: the node whose hook raised, not where the value was born."""
    import warnings

    model, x, y = _saturated_linear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (
            pytest.raises(nanwatch.AnomalyError, match="in the backward of ") as info,
            nanwatch.watch(model, mode="forensic", postmortem=False),
        ):
            _focal_step(model, x, y)
    assert info.value.anomaly is not None and info.value.anomaly.op is not None
    assert not [w for w in caught if "Error detected in" in str(w.message)]
    assert not torch.is_anomaly_enabled()


@pytest.mark.cpu_path(
    reason="a raise inside backward; the accelerator path raises once the value is read"
)
def test_forensic_mode_keeps_anomaly_mode_on_after_a_caught_anomaly() -> None:
    model, x, y = _saturated_linear()
    with nanwatch.watch(model, mode="forensic", postmortem=False) as nw:
        with contextlib.suppress(nanwatch.AnomalyError):
            _focal_step(model, x, y)
        nw.step()
        assert torch.is_anomaly_enabled()  # the next step's nodes keep their lines
    assert not torch.is_anomaly_enabled()


def test_without_anomaly_mode_a_backward_op_names_the_backward_call() -> None:
    x = torch.zeros(3, requires_grad=True)
    y = torch.sqrt(x * 1).sum()
    with OpChecker() as chk:
        y.backward()  # here
    ev = chk.first()
    here = _line(test_without_anomaly_mode_a_backward_op_names_the_backward_call, "# here")
    assert ev is not None and ev.phase is Phase.BACKWARD
    assert ev.source is not None and ev.source.endswith(here)
    assert ev.backward_at == ev.source and ev.code == "y.backward()  # here"
    assert ev.at == f"in SqrtBackward0, backward() at {ev.source}"


def test_a_frame_without_source_does_not_hide_the_next_one() -> None:
    def stack() -> list[str]:
        return traceback.format_stack()

    frames = stack()
    frozen = '  File "<frozen runpy>", line 88, in _run_code\n'
    source, code = _frames.user_line_from_traceback([frozen, frames[-2]])
    assert source is not None and source.endswith(
        _line(test_a_frame_without_source_does_not_hide_the_next_one, "frames = stack()")
    )
    assert code == "frames = stack()"


def test_launcher_frames_are_never_the_users_line() -> None:
    def inner() -> tuple[str | None, str | None]:
        return _frames.user_line()

    assert inner()[0] is not None  # this test file is user code...
    with _frames.launched_here():  # ...unless it launched the code being watched
        assert _frames.is_internal(__file__)
        assert _frames.user_line() == (None, None)
    assert not _frames.is_internal(__file__)


_SCRIPT = """\
import torch
from torch import nn

torch.manual_seed(0)
m = nn.Linear(4, 3)
with torch.no_grad():
    m.weight.mul_(100)
for step in range(2):
    x = torch.randn(32, 4)
    y = torch.randint(0, 3, (32,))
    p = torch.softmax(m(x), -1).gather(1, y[:, None]).squeeze(1)
    loss = (-(1 - p) ** 0.5 * torch.log(p.clamp_min(1e-12))).mean()
    loss.backward()
"""


def _strings(obj: Any, keys: tuple[str, ...]) -> Iterator[str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in keys and isinstance(v, str):
                yield v
            yield from _strings(v, keys)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v, keys)


def _run(launcher: list[str], tmp_path: Path, mode: str) -> None:
    script = tmp_path / "focal.py"
    script.write_text(_SCRIPT)
    reports = tmp_path / f"reports-{mode}-{len(launcher)}"
    out = subprocess.run(
        [*launcher, "run", "--mode", mode, "--report-dir", str(reports), str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=240,
        check=False,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "nanwatch.AnomalyError" in out.stderr
    assert "Error detected in" not in out.stderr
    loss_line = next(i for i, ln in enumerate(_SCRIPT.splitlines(), 1) if "** 0.5" in ln)
    [report] = [p for p in reports.iterdir() if p.suffix == ".json"]
    data = json.loads(report.read_text())
    named = list(_strings(data, ("source", "backward_at")))
    if mode == "forensic":
        assert f"focal.py:{loss_line}" in named
    message = next(ln for ln in out.stderr.splitlines() if "nanwatch.AnomalyError" in ln)
    named += [w for w in message.replace("]", " ").split() if ".py:" in w]
    assert named  # something was named, and all of it is the script's
    for where in named:
        assert where.split(":")[0] == "focal.py", (where, message)


def test_nanwatch_run_never_names_its_own_frames(tmp_path: Path) -> None:
    # the file pip writes for `[project.scripts] nanwatch = "nanwatch.cli:main"`
    console = tmp_path / "bin-nanwatch"
    console.write_text(
        "import sys\nfrom nanwatch.cli import main\nif __name__ == '__main__':\n"
        "    sys.exit(main())\n"
    )
    for launcher in ([sys.executable, str(console)], [sys.executable, "-m", "nanwatch"]):
        _run(launcher, tmp_path, "forensic")
    _run([sys.executable, str(console)], tmp_path, "watch")


# ---------------------------------------------------------------- watch mode (the default)
@pytest.mark.cpu_path(reason="counts the NaN of the node's gradient; a device flag tells kinds")
def test_watch_mode_names_the_loss_codes_node_and_what_it_saved() -> None:
    model, x, y = _saturated_linear()
    with nanwatch.watch(model, on_anomaly="record") as nw:
        _focal_step(model, x, y)
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.kind is AnomalyKind.BACKWARD and a.origin == "after-output"
    op = a.op
    assert op is not None and op.phase is Phase.BACKWARD
    assert (op.node, op.op, op.path) == ("PowBackward0", "aten.pow", LOSS_PATH)
    assert op.scalars == {"exponent": 0.5}  # what PowBackward0 saved in forward...
    base = dict(op.inputs)["self"]  # ...and the base it was given: 1 - p, exactly 0
    assert base is not None and base.min == 0 and base.zeros
    assert op.output.has_nan and base.zeros == op.output.nan  # 0 * inf at each of them
    backward_line = _line(_focal_step, "# the backward call")
    assert op.backward_at is not None and op.backward_at.endswith(backward_line)
    # no anomaly mode: the forward line is the statement of the backward() frame whose
    # local (loss) the node was made for, and which writes the op (** 0.5)
    assert op.source is not None and op.source.endswith(_line(_focal_step, "# focal"))
    assert "mode='forensic' names the line that created it" not in a.summary
    top = nw.history[-1].diagnoses[0]
    assert top.code != "NW100"  # a diagnosis of the op, not "a non-finite value"


def test_on_accelerators_the_loss_codes_node_is_named_then_read_after_its_first_bad_gradient() -> (
    None
):
    """A full check reads each node's gradient, a sync per node there: the first anomaly
    names the node from a flag each risky node leaves on the device, with what it saved
    (kept from its hook until the flag is read: autograd frees it when the node has run),
    and the steps after it (on_anomaly="warn", "record", Lightning's "skip") check the loss
    code in full."""
    model, x, y = _saturated_linear()
    nw = nanwatch.watch(model, on_anomaly="record")
    nw._defer_cpu = True  # the accelerator path, driven on CPU
    with nw:
        for _ in range(2):
            _focal_step(model, x, y)
            nw.step()
            model.zero_grad()  # no update: the same failure again
    first, second = (t.anomaly for t in nw.history)
    assert first is not None and first.op is not None and first.op.node == "PowBackward0"
    assert first.op.scalars == {"exponent": 0.5}
    assert dict(first.op.inputs)["self"].zeros  # kept from its hook: 1 - p at 0
    assert second is not None and second.origin == "after-output"
    assert dict(second.op.inputs if second.op else [])["self"].zeros  # read: 1 - p at 0
    assert second.op is not None and second.op.node == "PowBackward0"
    assert second.op.scalars == {"exponent": 0.5}
    backward_line = _line(_focal_step, "# the backward call")
    assert second.op.backward_at is not None and second.op.backward_at.endswith(backward_line)


def test_a_healthy_loss_code_leaves_no_event_and_no_hook() -> None:
    model = nn.Linear(4, 3)
    with nanwatch.watch(model) as nw:
        for _ in range(2):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            _focal_step(model, x, y)
            assert len(nw._tensor_handles) > 1  # the output's hook and the loss nodes'
            nw.step()
    assert nw.first_anomaly is None and all(not t.ops for t in nw.history)
    assert nw._tensor_handles == []


def _zero_linear() -> nn.Linear:
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()  # every output exactly 0
    return model


@pytest.mark.cpu_path(reason="counts the CPU path's hooks; the accelerator path adds a device flag")
def test_the_loss_node_next_to_the_output_is_named_without_a_check_of_its_own() -> None:
    """Its gradient is what the output's hook measures: no second pass over it, and when
    it is the only such node it is named (what it saved was freed when it ran)."""
    model = _zero_linear()
    with nanwatch.watch(model, on_anomaly="record") as nw:
        out = model(torch.randn(2, 4))
        loss = torch.sqrt(out).mean()
        loss.backward()  # sqrt at 0
        hooks = len(nw._tensor_handles)
        nw.step()
    assert hooks == 1  # the output's own: sqrt feeds it, mean only spreads the gradient
    a = nw.first_anomaly
    assert a is not None and a.origin == "after-output"
    assert a.op is not None and a.op.node == "SqrtBackward0" and a.op.inputs == []
    here = _line(test_the_loss_node_next_to_the_output_is_named_without_a_check_of_its_own, "at 0")
    assert a.op.backward_at is not None and a.op.backward_at.endswith(here)


def test_two_loss_terms_at_the_output_each_get_a_check() -> None:
    # the output's hook sees the sum of what both send back: which one made the inf is
    # not guessed from it, each node gets a check of its own (a CIoU's w / h beside its
    # center difference)
    model = _zero_linear()
    with nanwatch.watch(model, on_anomaly="record") as nw:
        out = model(torch.randn(2, 4))
        (torch.sqrt(out).mean() + (out + 1).log().mean()).backward()
        nw.step()
    a = nw.first_anomaly
    assert a is not None and a.origin == "after-output"
    assert a.op is not None and a.op.node == "SqrtBackward0"
    assert "NW112" in [d.code for d in nw.history[-1].diagnoses]
