"""The fix for an id past an embedding table's last row builds the table again under the
user's own name for it: the table itself when the line calls it, the path down to it
when the line calls the model that holds it (not the model's name: ``m = nn.Embedding``
would replace the whole model)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.errors import GuardError


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleDict({"tok": nn.Embedding(50, 4)})
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.body["tok"](ids)).mean(1)


def _fix_of(err: pytest.ExceptionInfo[GuardError]) -> str:
    assert err.value.code == "NW513", err.value
    return err.value.fix.splitlines()[0].split("  #")[0]


def test_a_table_inside_a_sequential_is_named_by_its_index() -> None:
    m = nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(32, 1))
    ids = torch.randint(0, 100, (4, 4))
    ids[1, 2] = 100
    watched = nanwatch.watch(m, on_anomaly="raise", postmortem=False)
    with pytest.raises(GuardError) as err, watched:
        m(ids)
    assert _fix_of(err) == "m[0] = nn.Embedding(101, 8)"


def test_a_table_called_in_a_forward_through_a_container_is_named_as_called() -> None:
    model = _Encoder()
    ids = torch.randint(0, 50, (2, 3))
    ids[0, 0] = 57
    with (
        pytest.raises(GuardError) as err,
        nanwatch.watch(model, on_anomaly="raise", postmortem=False),
    ):
        model(ids)
    assert _fix_of(err) == 'self.body["tok"] = nn.Embedding(58, 4)', err.value


def test_a_table_called_by_its_own_name_keeps_that_name() -> None:
    table = nn.Embedding(10, 3)
    ids = torch.tensor([[1, 10]])
    with (
        pytest.raises(GuardError) as err,
        nanwatch.watch(table, on_anomaly="raise", postmortem=False),
    ):
        table(ids)
    assert _fix_of(err) == "table = nn.Embedding(11, 3)"


def test_a_table_nested_in_the_called_model_is_named_by_its_path() -> None:
    net = nn.Sequential(nn.Sequential(nn.Embedding(20, 4)), nn.Flatten(), nn.Linear(8, 1))
    ids = torch.tensor([[3, 25]])
    with (
        pytest.raises(GuardError) as err,
        nanwatch.watch(net, on_anomaly="raise", postmortem=False),
    ):
        net(ids)
    assert _fix_of(err) == "net[0][0] = nn.Embedding(21, 4)"


# ------------------------------------------------- clip_grad_norm_ with max_norm <= 0: NW309
class _Cfg:
    max_grad_norm = 0.0  # "0: no clipping" in the trainer this config came from


def _clip_run(mode: str, bound: float, *, from_config: bool) -> list[tuple[str, str, str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = _Cfg()
    cfg.max_grad_norm = bound
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            loss = (model(torch.randn(32, 8)) - 1).pow(2).mean()
            loss.backward()
            if from_config:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.0)
            opt.step()
            opt.zero_grad()
            nw.step()
    return [(d.code, d.severity, d.fix) for d in nw.report.diagnoses]


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_clipping_to_a_max_norm_of_zero_is_said_with_the_guard_the_loop_needs(mode: str) -> None:
    found = [d for d in _clip_run(mode, 0.0, from_config=True) if d[0] == "NW309"]
    assert found, _clip_run(mode, 0.0, from_config=True)
    _, severity, fix = found[0]
    assert severity == "warning"
    assert fix.splitlines() == [
        "if cfg.max_grad_norm > 0:   # 0 or less: no clipping (clip_grad_norm_ has no 'off' value)",
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)",
    ]


def test_a_literal_zero_max_norm_gets_a_positive_bound() -> None:
    found = [d for d in _clip_run("sentinel", 0.0, from_config=False) if d[0] == "NW309"]
    assert found[0][2].startswith(
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)   #"
    ), found


def test_a_negative_max_norm_is_an_error() -> None:
    found = [d for d in _clip_run("watch", -1.0, from_config=True) if d[0] == "NW309"]
    assert found and found[0][1] == "error", found


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_positive_max_norm_is_silent(mode: str) -> None:
    assert _clip_run(mode, 1.0, from_config=True) == []


# ------------------------------- clip_grad_norm_ before scaler.unscale_(optimizer): NW310
def _amp_run(mode: str, *, unscale: bool, enabled: bool = True) -> list[tuple[str, list[str], str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=enabled)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = (model(torch.randn(32, 8)) - 1).float().pow(2).mean()
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    return [(d.code, d.evidence, d.fix) for d in nw.report.diagnoses]


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_clipping_scaled_gradients_asks_for_unscale_first(mode: str) -> None:
    found = [d for d in _amp_run(mode, unscale=False) if d[0] == "NW310"]
    assert found, _amp_run(mode, unscale=False)
    _, evidence, fix = found[0]
    assert "still multiplied by the GradScaler's scale, 65536" in evidence[0], evidence
    assert "1.53e-05 (max_norm / scale)" in evidence[1], evidence
    assert fix.splitlines() == [
        "scaler.unscale_(opt)   # the real gradients: clip_grad_norm_ compares their norm",
        "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
    ]


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_clipping_after_unscale_or_without_a_scale_is_silent(mode: str) -> None:
    assert _amp_run(mode, unscale=True) == []
    assert _amp_run(mode, unscale=False, enabled=False) == []


# ------------------------------- zero_grad() between backward() and step(): NW311
def _order_run(mode: str, order: str) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt: torch.optim.Optimizer
    if order == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            if order == "lbfgs":
                opt.step(closure)
                opt.zero_grad()  # after the step: the next closure's backward gives them
                nw.step()
                continue
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            if order == "between":
                opt.zero_grad()
            elif order == "partial":
                model[0].weight.grad = None  # a weight frozen for this step, by hand
            opt.step()
            if order != "between":
                opt.zero_grad()
            nw.step()
    return [d.code for d in nw.report.diagnoses]


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_zero_grad_between_backward_and_step_is_said(mode: str) -> None:
    assert "NW311" in _order_run(mode, "between")


@pytest.mark.parametrize("order", ["usual", "partial", "lbfgs"])
@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_gradients_present_or_reset_after_the_step_are_silent(mode: str, order: str) -> None:
    assert "NW311" not in _order_run(mode, order)


# ------------------- backward on the loss, not on scaler.scale(loss), under scaler.step(): NW314
def _scale_run(mode: str, how: str) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    crit = nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with nanwatch.watch(model, crit, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(3):
            for _ in range(2 if how == "accumulate" else 1):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = crit(model(torch.randn(32, 8)).float(), torch.ones(32, 1))
                if how == "discarded":
                    scaler.scale(loss)
                    loss.backward()
                else:
                    scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            nw.step()
    return [d.code for d in nw.report.diagnoses]


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_backward_on_the_unscaled_loss_under_scaler_step_is_said(mode: str) -> None:
    # scaler.scale(loss) made, its result dropped (a scaler that never scaled anything
    # raises in torch itself)
    assert "NW314" in _scale_run(mode, "discarded")


@pytest.mark.parametrize("how", ["usual", "accumulate"])
@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_backward_on_the_scaled_loss_is_silent(mode: str, how: str) -> None:
    assert _scale_run(mode, how) == []


# ------------------------ an optimizer built on another instance of the model: NW315
def _foreign_run(mode: str, how: str) -> list[str]:
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    critic = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    c_opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    if how == "copied":
        model = copy.deepcopy(model)  # e.g. a wrapper that copies: opt holds the old tensors
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for i in range(8):
            x = torch.randn(32, 8)
            if how == "critic" and i % 5:
                # WGAN-style critic steps: the generator (watched) gets gradients through
                # the non-detached fake and is not stepped
                critic(model(x)).mean().backward()
                c_opt.step()
                c_opt.zero_grad(set_to_none=False)
                model.zero_grad(set_to_none=False)
            else:
                (model(x) - 1).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            nw.step()
    return [d.code for d in nw.report.diagnoses]


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_an_optimizer_of_another_instance_of_the_model_is_said(mode: str) -> None:
    assert "NW315" in _foreign_run(mode, "copied")


@pytest.mark.parametrize("how", ["usual", "critic"])
@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_the_model_s_own_optimizer_or_another_model_s_is_silent(mode: str, how: str) -> None:
    assert "NW315" not in _foreign_run(mode, how)


# ------------- the forward under no_grad, the loss made to require grad by hand: NW209
@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_loss_made_to_require_grad_after_a_no_grad_forward_is_said(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch.watch(model, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for _ in range(2):
            with torch.no_grad():
                out = model(torch.randn(32, 8))
            loss = (out - 1).pow(2).mean().requires_grad_()
            loss.backward()
            opt.step()
            opt.zero_grad()
            nw.step()
        with torch.no_grad():  # an evaluation afterwards: no backward, nothing said
            model(torch.randn(4, 8))
    found = [d for d in nw.report.diagnoses if d.code == "NW209"]
    assert found and "torch.no_grad()" in found[0].evidence[1], nw.report.diagnoses
