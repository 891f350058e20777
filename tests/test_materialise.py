"""A module built on the meta device, materialised one module at a time, against `module.apply(init_fn)`
on the same module built eagerly: the same weights, and the random generators left where apply leaves them."""

import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from elixir_ray import wrap
from elixir_ray.engine import manual_plan


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).pow(2).mean()


def _linear(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.5)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


def parent_rescales_child(m):  # as Hugging Face GPT-2 rescales c_proj from its attention block
    _linear(m)
    if isinstance(m, Block):
        nn.init.uniform_(m.b.weight, -0.1, 0.1)


def root_scales_everything(m):  # an init that loops over the whole model's parameters at the root
    _linear(m)
    if isinstance(m, Net):
        for p in m.parameters():
            p.mul_(0.5)


def draws_on_the_cpu_then_copies(m):  # random numbers drawn apart from the weight, then copied in
    if isinstance(m, nn.Linear):
        m.weight.copy_(torch.randn(m.weight.shape))
        nn.init.zeros_(m.bias)


def pythons_and_numpys_generators(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=random.choice([0.01, 0.1, 1.0]) * float(np.random.rand() + 0.5))
        nn.init.zeros_(m.bias)


def needs_values(m):  # cannot run on meta tensors: its block keeps the weights below it until it has run
    _linear(m)
    if isinstance(m, Block):
        m.b.weight.div_(m.a.weight.abs().max().item())


def _reference_and_engine(init_fn):
    with torch.device("meta"):
        meta = Net()
    ref = copy.deepcopy(meta).to_empty(device="cpu")
    x = torch.randn(4, 8)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    with torch.no_grad():
        ref.apply(init_fn)
    after_ref = (torch.randn(3), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    model, _ = wrap(meta, torch.optim.AdamW(meta.parameters()), sample_inputs=(x,), device="cpu",
                    plan=manual_plan(meta, (x,), chunk_size=128, n_blocks=2), init_fn=init_fn)
    after_engine = (torch.randn(3), random.random(), np.random.rand())
    return ref, model, after_ref, after_engine


@pytest.mark.parametrize("init_fn", [parent_rescales_child, root_scales_everything, draws_on_the_cpu_then_copies,
                                     pythons_and_numpys_generators, needs_values], ids=lambda f: f.__name__)
def test_a_meta_module_starts_with_the_weights_and_the_generators_apply_leaves(init_fn):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "init_fn.* could not run on meta tensors")
        ref, model, after_ref, after_engine = _reference_and_engine(init_fn)
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(state[key], value), key
    assert torch.equal(after_engine[0], after_ref[0]) and after_engine[1:] == after_ref[1:]


def test_an_init_that_cannot_run_on_meta_tensors_says_what_it_keeps_on_the_host():
    with pytest.warns(UserWarning, match=r"init_fn\(Block\) could not run on meta tensors \(.*\), so which weights "
                                         r"below it it changes is unknown: they are kept on the host until it has run") \
            as caught:
        _reference_and_engine(needs_values)
    assert {w.filename for w in caught} == {__file__}  # the line that wrapped, not one inside elixir_ray


def test_real_weights_beside_meta_ones_are_copied_as_given_and_the_callers_tensors_left_alone():
    """A block with a real gain and a meta child: its init_fn runs (it rescales the child), but the
    real gain it also resets is kept as the caller built it, and the caller's tensor is not written."""
    class Gained(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.full((8,), 3.0))
            self.proj = nn.Linear(8, 8, device="meta")

        def forward(self, x):
            return (self.proj(x) * self.gain).pow(2).mean()

    def init_fn(m):
        _linear(m)
        if isinstance(m, Gained):
            nn.init.ones_(m.gain)
            m.proj.weight.mul_(0.5)

    module = Gained()
    callers = module.gain.data
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    model, _ = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device="cpu",
                    plan=manual_plan(module, (x,), chunk_size=64, n_blocks=2), init_fn=init_fn)
    assert torch.equal(model.state_dict()["gain"], torch.full((8,), 3.0))
    assert torch.equal(callers, torch.full((8,), 3.0))
    torch.manual_seed(0)
    expected = torch.empty(8, 8)
    nn.init.normal_(expected, std=0.5)
    assert torch.equal(model.state_dict()["proj.weight"], expected * 0.5)  # the child still rescaled


def test_every_module_is_called_as_apply_calls_it_so_the_draws_line_up():
    """init_fn runs on modules with no meta weights too (a Dropout whose rate it draws, a layer built
    with real weights): apply draws there, so skipping them would shift every later draw. What it
    does to real weights is dropped."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.real = nn.Linear(8, 8)  # real weights, as the caller built them
            self.drop = nn.Dropout(0.0)
            self.late = nn.Linear(8, 8, device="meta")

        def forward(self, x):
            return self.late(self.drop(self.real(x))).pow(2).mean()

    def init_fn(m):
        _linear(m)
        if isinstance(m, nn.Dropout):
            m.p = float(torch.rand(())) * 0.1

    module = Mixed()
    real = {k: v.clone() for k, v in module.real.state_dict().items()}
    ref = copy.deepcopy(module).to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        ref.apply(init_fn)
    after_ref = torch.randn(3)
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    model, _ = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device="cpu",
                    plan=manual_plan(module, (x,), chunk_size=64, n_blocks=2), init_fn=init_fn)
    assert torch.equal(torch.randn(3), after_ref)
    state = model.state_dict()
    assert torch.equal(state["late.weight"], ref.late.weight) and module.drop.p == ref.drop.p > 0
    assert all(torch.equal(state[f"real.{k}"], v) for k, v in real.items())


def test_a_weight_registered_under_two_names_is_initialised_through_either():
    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Linear(8, 8, bias=False, device="meta")
            self.w = self.c.weight  # the same parameter, also the root's own

        def forward(self, x):
            return self.c(x).pow(2).mean()

    def init_fn(m):
        _linear(m)
        if isinstance(m, Aliased):
            m.c.weight.mul_(0.0)

    module = Aliased()
    x = torch.randn(4, 8)
    model, _ = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device="cpu",
                    plan=manual_plan(module, (x,), chunk_size=64, n_blocks=1), init_fn=init_fn)
    assert torch.equal(model.state_dict()["w"], torch.zeros(8, 8))


def test_real_buffers_are_kept_as_given():
    norm = nn.BatchNorm1d(8)
    norm.weight = nn.Parameter(torch.empty(8, device="meta"))
    norm.running_mean.fill_(5.0)
    callers = norm.running_mean
    x = torch.randn(4, 8)
    model, _ = wrap(norm, torch.optim.AdamW(norm.parameters()), sample_inputs=(x,), device="cpu",
                    plan=manual_plan(norm, (x,), chunk_size=64, n_blocks=1), init_fn=lambda m: m.reset_parameters())
    assert torch.equal(callers, torch.full((8,), 5.0))
    assert torch.equal(model.state_dict()["running_mean"], torch.full((8,), 5.0))
    assert torch.equal(model.state_dict()["weight"], torch.ones(8))
