"""Sentinel mode and a model that changes after attach: a layer or loss module added under
a watched root is watched there too (its parameters' gradients, its guards), as in watch
mode, not found a step late through the weights its NaN gradient broke."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanwatch
from nanwatch.errors import GuardError
from nanwatch.records import Phase
from nanwatch.stats import HostRead


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(8, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return torch.stack([head(h) for head in self.heads]).sum(0)


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_head_added_after_attach_has_its_gradient_checked(mode: str) -> None:
    torch.manual_seed(0)
    net = _Heads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with nanwatch.watch(net, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for i in range(5):
            if i == 3:  # a head added mid-run (multi-task growth), with its own param group
                head = nn.Linear(8, 1)
                net.heads.append(head)
                opt.add_param_group({"params": list(head.parameters())})
                head.weight.register_hook(lambda g: g * float("nan"))
            loss = net(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
    first = nw.first_anomaly
    assert first is not None
    # the step whose backward made it, in the gradient, before the update spread it
    assert (first.step, first.record.phase) == (3, Phase.GRADIENT)
    assert first.record.role == "heads.1.weight"
    if HostRead.ready.__name__ != "_never_landed":
        # the GPU-bound path reads the gradients before the update only, when the hook has
        # long returned: it names the gradient, not the hook (a known weaker answer there)
        assert "a hook you registered on it" in first.summary


class _WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        crit = getattr(self, "criterion", None)
        return crit(out, y) if crit is not None else out.sum()


@pytest.mark.filterwarnings("ignore::nanwatch.NanwatchWarning")  # the NW501 it reports
def test_a_loss_module_added_after_attach_is_guarded_in_sentinel_mode() -> None:
    model = _WithLoss()
    # functional_guards=False: the module's own guard, not the F.cross_entropy one inside it
    with nanwatch.watch(model, mode="sentinel", functional_guards=False, postmortem=False) as nw:
        model(torch.randn(2, 4), torch.tensor([0, 1])).backward()
        nw.step()
        model.criterion = nn.CrossEntropyLoss()  # set up after the first step
        model(torch.randn(2, 4), torch.tensor([0, 1])).backward()
        nw.step()
        with pytest.raises(
            GuardError, match=r"CrossEntropyLoss\(ignore_index=-100\) with 3 classes"
        ):
            model(torch.randn(2, 4), torch.tensor([0, 3]))  # 3 classes: 3 is out of range


@pytest.mark.parametrize("mode", ["sentinel", "watch"])
def test_a_replaced_head_is_no_longer_watched_and_its_name_is_the_new_ones(mode: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    old = net[2]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with nanwatch.watch(net, mode=mode, on_anomaly="record", postmortem=False) as nw:
        for i in range(5):
            if i == 3:  # the head re-initialized by replacing it, under the same name
                net[2] = nn.Linear(8, 1)
                opt = torch.optim.SGD(net.parameters(), lr=0.1)
                net[2].bias.register_hook(lambda g: g * float("nan"))
            loss = net(torch.randn(16, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nw.step()
        # the old head is let go: no hook of nanwatch's left on it, one name per module
        assert not old._forward_hooks and not old._forward_pre_hooks
        assert sorted(nw.module_paths) == sorted(set(nw.module_paths))
    first = nw.first_anomaly
    assert first is not None and (first.step, first.record.role) == (3, "2.bias")
    if HostRead.ready.__name__ != "_never_landed":
        # the hook on the new head's bias, not the old head's (no hook): found by its name
        assert "a hook you registered on it" in first.summary


def test_a_head_put_back_after_a_swap_is_watched_once() -> None:
    # a module let go when it left the model is hooked afresh when it comes back: never twice
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    first, second = net[2], nn.Linear(8, 1)
    with nanwatch.watch(net, postmortem=False) as nw:
        for i in range(4):
            net[2] = second if i % 2 else first  # two heads in turn (an A/B swap)
            net(torch.randn(2, 4)).sum().backward()
            nw.step()
        trace = nw.history[-1]
        heads = [c for c in trace.calls if c.path == "2"]
        assert len(heads) == 1  # hooked once, not once per time it came back
        assert net[2] is second and len(second._forward_hooks) == 1
        assert not first._forward_hooks  # out of the model at the end: let go
