"""The habits of torch training loops, through the engine, against plain torch on CPU in fp32.

Each case was found by a user walkthrough in which it trained on silently wrong or failed with an
unhelpful error: `model.zero_grad()` cleared nothing (gradients piled up across steps, 0.03 off
torch after three), the optimizer had no state_dict, a transposed weight loaded in flat order,
and a scheduler on the optimizer passed in warned of a step before any.
"""

import copy
import dataclasses
import os
import sys
import warnings

import pytest
import torch

from elixir_ray import wrap
from elixir_ray.engine import manual_plan

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import Toy, batches, param_groups  # noqa: E402


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _pair(seed: int = 0):
    """A wrapped Toy (evictions every step) and a plain copy, each with its AdamW over two groups."""
    torch.manual_seed(seed)
    module = Toy()
    reference = copy.deepcopy(module)
    sample = (batches(1, 4)[0],)
    base = torch.optim.AdamW(param_groups(module), lr=1e-2)
    model, opt = wrap(module, base, sample_inputs=sample, plan=manual_plan(module, sample, chunk_size=1024, n_blocks=2), device="cpu")
    return model, opt, base, reference, torch.optim.AdamW(param_groups(reference), lr=1e-2)


def _optim_diff(a: dict, b: dict) -> float:
    assert a["state"].keys() == b["state"].keys()
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    return max(_max_diff(a["state"][i], b["state"][i]) for i in b["state"])


@pytest.mark.parametrize("zeroing", ["model", "original optimizer", "original module"])
def test_zeroing_gradients_through_the_model_or_the_optimizer_passed_in_trains_like_torch(zeroing):
    model, opt, base, reference, ref_opt = _pair()
    zero = {"model": model.zero_grad, "original optimizer": base.zero_grad,
            "original module": model.module.zero_grad}[zeroing]  # nn.Module's cleared nothing: 0.02 off torch
    for batch in batches(4, 4, seed=3):
        zero()
        reference.zero_grad()
        model(batch).backward()
        reference(batch).backward()
        opt.step()
        ref_opt.step()
    assert _max_diff(model.state_dict(), reference.state_dict()) <= 1e-5


def test_reading_grad_after_backward_warns_once_that_clip_grad_norm_clips_nothing():
    """nanoGPT's loop clips with torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0): the engine
    keeps gradients in chunks, so it saw no .grad and clipped nothing, silently. Any parameter's
    .grad read while the engine holds gradients (resident or not) warns, once, and so does setting
    one; a loop that reads none, or reads before a backward or after zero_grad, is not warned."""
    model, opt, base, reference, ref_opt = _pair()
    first, second, third = batches(3, 4, seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # before the one warning: any would fail here
        assert all(p.grad is None for p in model.parameters())  # before any backward
        loss = model(first)
        loss.backward(retain_graph=True)
        loss.backward()  # its hooks read .grad as gradients arrive, with the first backward's held
        model(second).backward()  # accumulated
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())  # after zero_grad
        model(third).backward()
        model.module.to("cpu").float()  # nn.Module._apply reads .grad to convert it, not to find gradients
    resident = [p for p in model.parameters() if p.untyped_storage().nbytes() > 0]
    assert resident, "the pool holds no chunk after backward: nothing shows the resident parameters are seen"
    with pytest.warns(UserWarning, match=r"^the .grad of parameter \S+ was read after backward\(\), but elixir_ray "
                                         r"keeps gradients in its chunks, so .grad is None: torch.nn.utils."
                                         r"clip_grad_norm_ clips nothing, .* max_grad_norm=") as seen:
        resident[0].grad
    assert len(seen) == 1 and seen[0].filename == __file__  # at the line that read it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once for the wrapped model
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    model, opt, base, reference, ref_opt = _pair()
    model(first).backward()
    with pytest.warns(UserWarning, match="clip_grad_norm_ clips nothing") as seen:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert seen[0].filename == __file__  # the call's line, not torch's that read
    with pytest.warns(UserWarning, match=r"^the .grad of parameter \S+ was set after backward\(\), but elixir_ray "
                                         r"keeps gradients in its chunks: setting .grad \(p.grad = None\) neither "
                                         r"clears nor changes them"):
        for p in model.parameters():
            p.grad = None


def test_the_optimizer_state_dict_is_torchs_and_a_run_resumes_from_either_side():
    model, opt, base, reference, ref_opt = _pair()
    schedule, ref_schedule = (torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (base, ref_opt))
    data = batches(6, 4, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" included
        for batch in data[:3]:
            model(batch).backward()
            reference(batch).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            schedule.step()
            ref_schedule.step()
    saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
    assert _optim_diff(saved, ref_saved) <= 1e-6
    assert [g["lr"] for g in saved["param_groups"]] == [g["lr"] for g in ref_saved["param_groups"]] == [5e-3, 5e-3]
    assert _optim_diff(base.state_dict(), ref_saved) <= 1e-6  # the optimizer passed in answers the same

    # engine -> plain torch, and plain torch -> a fresh engine (through the optimizer passed in)
    plain = copy.deepcopy(reference)
    plain.load_state_dict(model.state_dict())
    plain_opt = torch.optim.AdamW(param_groups(plain), lr=1.0)
    plain_opt.load_state_dict(saved)
    resumed, resumed_opt, resumed_base, _, _ = _pair(seed=1)
    resumed.load_state_dict(reference.state_dict())
    resumed_base.load_state_dict(ref_saved)
    assert [g["lr"] for g in resumed_opt.param_groups] == [5e-3, 5e-3]  # hyper-parameters come with the state
    for batch in data[3:]:
        for m, o in ((plain, plain_opt), (resumed, resumed_opt), (reference, ref_opt)):
            m(batch).backward()
            o.step()
            o.zero_grad()
    assert _max_diff(plain.state_dict(), reference.state_dict()) <= 1e-5
    assert _max_diff(resumed.state_dict(), reference.state_dict()) <= 1e-5
    assert _optim_diff(resumed_opt.state_dict(), ref_opt.state_dict()) <= 1e-5


def test_reading_the_optimizers_per_parameter_state_says_where_to_find_it():
    model, opt, _, _, _ = _pair()
    assert not hasattr(opt, "state")
    with pytest.raises(AttributeError, match=r"state_dict\(\)\['state'\]"):
        opt.state[next(model.parameters())]
    with pytest.raises(AttributeError, match="load_state_dict"):
        opt.state = {}


def test_an_optimizer_state_dict_that_does_not_fit_is_refused_before_anything_changes():
    model, opt, base, reference, ref_opt = _pair()
    batch = batches(1, 4, seed=3)[0]
    model(batch).backward()
    opt.step()
    before = opt.state_dict()
    one_group = {"state": {}, "param_groups": [{"params": list(range(9)), "lr": 1.0}]}
    with pytest.raises(ValueError, match="1 parameter groups, the optimizer has 2"):
        opt.load_state_dict(one_group)
    wrong = copy.deepcopy(before)
    first = next(iter(wrong["state"]))
    wrong["state"][first]["exp_avg"] = wrong["state"][first]["exp_avg"].reshape(-1)[:3]
    with pytest.raises(ValueError, match=f"exp_avg of parameter {first} in the loaded state has shape"):
        opt.load_state_dict(wrong)
    assert _optim_diff(opt.state_dict(), before) == 0.0
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-2]


def test_load_state_dict_checks_shapes_and_reports_keys_as_torch_does():
    model, opt, base, reference, ref_opt = _pair()
    before = model.state_dict()
    transposed = dict(reference.state_dict())
    transposed["l1.weight"] = transposed["l1.weight"].t().contiguous()  # same size, wrong shape
    with pytest.raises(RuntimeError, match=r"size mismatch in load_state_dict \(1 key\(s\)\): l1.weight: \[32, 64\] "
                                           r"for \[64, 32\]"):
        model.load_state_dict(transposed)
    assert _max_diff(model.state_dict(), before) == 0.0  # nothing was written

    partial = {k: v for k, v in reference.state_dict().items() if k != "ln.bias"}
    partial["extra"] = torch.zeros(1)
    missing, unexpected = model.load_state_dict(partial, strict=False)
    assert (missing, unexpected) == (["ln.bias"], ["extra"])
    with pytest.raises(RuntimeError, match=r"missing keys \['ln.bias'\], unexpected keys \['extra'\]; nothing was "
                                           r"loaded"):  # torch's type: `except RuntimeError` catches both
        model.load_state_dict(partial)
    prefixed = {f"module.{k}": v for k, v in reference.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"keys start with 'module.', as model.named_parameters\(\) names them"):
        model.load_state_dict(prefixed)
    assert list(model.state_dict(prefix="net.")) == [f"net.{k}" for k in reference.state_dict()]
    with pytest.raises(ValueError, match="assign=False"):
        model.load_state_dict(reference.state_dict(), assign=True)


def test_seeding_then_wrapping_with_a_searched_plan_draws_the_random_numbers_plain_torch_draws():
    """Planning measures rates and times the model's kernels, dropout included: it drew from the
    global generator, so a seeded run's dropout masks differed from plain torch's after wrap."""
    class Dropped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.drop = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1), torch.nn.Dropout(0.5)

        def forward(self, x):
            return self.b(self.drop(torch.relu(self.a(x)))).pow(2).mean()

    torch.manual_seed(0)
    module, x = Dropped(), torch.randn(8, 16)
    reference = copy.deepcopy(module)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    model, opt = wrap(module, torch.optim.AdamW(module.parameters(), lr=1e-2), sample_inputs=(x,),
                      device_memory="64MiB", device="cpu")

    def three_steps(m, o) -> list[float]:
        losses = []
        for _ in range(3):
            loss = m(x)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        return losses

    losses = three_steps(model, opt)
    torch.manual_seed(1)
    assert losses == pytest.approx(three_steps(reference, ref_opt), abs=1e-6)


def test_a_scheduler_built_on_the_optimizer_wrap_returns_works_like_one_on_plain_adamw():
    """It was refused by torch ("ChunkedAdam is not an Optimizer")."""
    model, opt, base, reference, ref_opt = _pair()
    schedules = [torch.optim.lr_scheduler.OneCycleLR(o, 0.05, total_steps=6) for o in (opt, ref_opt)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in batches(5, 4, seed=3):
            for m, o, s in ((model, opt, schedules[0]), (reference, ref_opt, schedules[1])):
                m(batch).backward()
                o.step()
                o.zero_grad()
                s.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups])
    assert _max_diff(model.state_dict(), reference.state_dict()) <= 1e-5


def test_loading_state_between_a_backward_that_started_updates_and_the_step_is_refused():
    """With accumulation_steps=1 the updates start during the backward, from the state then: a load
    in between was half overwritten and the step applied nothing on top of it (0.04 off torch)."""
    torch.manual_seed(0)
    module = Toy()
    sample = (batches(1, 4)[0],)
    model, opt = wrap(module, torch.optim.AdamW(param_groups(module), lr=1e-2), sample_inputs=sample,
                      plan=manual_plan(module, sample, chunk_size=1024, n_blocks=2), device="cpu", accumulation_steps=1)
    batch = batches(1, 4, seed=3)[0]
    model(batch).backward()
    opt.step()
    saved, weights = opt.state_dict(), model.state_dict()
    model(batch).backward()
    for load in (lambda: opt.load_state_dict(saved), lambda: model.load_state_dict(weights)):
        with pytest.raises(RuntimeError, match=r"between backward\(\) and optimizer.step\(\) with accumulation_steps=1"):
            load()
    opt.step()
    opt.load_state_dict(saved)  # after the step it is taken
    model.load_state_dict(weights)
    assert _optim_diff(opt.state_dict(), saved) == 0.0



def _refused_as_torch_refuses_then_trains_alike(losses, refusal, batch, model, opt, reference, ref_opt):
    """`losses`: torch's, then the engine's, each through a forward made before its weights changed."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        losses[0].backward()
    with pytest.raises(RuntimeError, match=refusal):
        losses[1].backward()
    for m, o in ((model, opt), (reference, ref_opt)):
        o.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing of the refused backward is left to drop
            m(batch).backward()
        o.step()
    assert _max_diff(model.state_dict(), reference.state_dict()) <= 1e-6


def test_a_backward_through_a_forward_made_before_a_load_is_refused_as_torch_refuses_it():
    """torch's in-place check refuses it (a saved weight changed); the engine fetched the loaded
    weights in backward and paired them with the old activations, silently. Refused before any
    gradient arrives, a new forward then trains as torch does after the same load."""
    model, opt, base, reference, ref_opt = _pair()
    batch, weights = batches(1, 4, seed=5)[0], Toy().state_dict()
    losses = []
    for m in (reference, model):
        losses.append(m(batch))
        m.load_state_dict(weights)
    _refused_as_torch_refuses_then_trains_alike(
        losses, r"weights were loaded \(load_state_dict or load_engine_state\) after the forward this backward goes "
                r"through", batch, model, opt, reference, ref_opt)


def test_a_backward_through_a_forward_made_before_a_step_is_refused_as_torch_refuses_it():
    """A step between a forward and its backward (gradients left from an earlier backward) changes
    weights that forward saved: torch's in-place check refuses the backward; the engine fetched the
    stepped weights in backward and paired them with the old activations, silently. Refused before
    any gradient arrives, the loop then trains as torch does after the same step."""
    model, opt, base, reference, ref_opt = _pair()
    first, second = batches(2, 4, seed=6)
    losses = []
    for m, o in ((reference, ref_opt), (model, opt)):
        m(first).backward()
        losses.append(m(second))
        o.step()
    _refused_as_torch_refuses_then_trains_alike(
        losses, r"optimizer.step\(\) updated parameters that the forward this backward goes through saved for it "
                r"\('ln.bias', 'ln.weight', 'l1.weight' and \d more\)", second, model, opt, reference, ref_opt)


def test_a_step_without_gradients_or_a_load_of_the_optimizer_between_a_forward_and_its_backward_is_allowed():
    """Neither changes a weight, so torch lets the backward through; so does the engine, and the
    training matches."""
    model, opt, base, reference, ref_opt = _pair()
    batch = batches(1, 4, seed=7)[0]
    for m, o in ((reference, ref_opt), (model, opt)):
        m(batch).backward()
        o.step()
        o.zero_grad()
        saved = copy.deepcopy(o.state_dict())
        m(batch).backward()
        o.step()
        o.zero_grad()
        loss = m(batch)
        o.step()  # no gradients: changes nothing
        o.load_state_dict(saved)  # the step counts go back from 2 to 1, the weights stay
        loss.backward()
        o.step()
    assert _max_diff(model.state_dict(), reference.state_dict()) <= 1e-6
    assert _optim_diff(opt.state_dict(), ref_opt.state_dict()) <= 1e-6


def test_a_loss_term_kept_aside_by_the_forward_trains_like_torch_with_updates_started_in_backward():
    """A regulariser the forward keeps on the module instead of returning opens the backward before
    the output's gradient arrives; with accumulation_steps=1 its parameter's chunk is updated by
    then, which is this backward's own update, not a step between forward and backward."""
    class KeepsAux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.router = torch.nn.Linear(16, 16), torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):  # the aside term made last: its backward runs first
            main = self.lin(x).pow(2).mean()
            self.aux = 1e-2 * self.router.pow(2).sum()
            return main

    torch.manual_seed(0)
    module = KeepsAux()
    reference, xs = copy.deepcopy(module), [torch.randn(4, 16) for _ in range(3)]
    model, opt = wrap(module, torch.optim.AdamW(module.parameters(), lr=1e-2), sample_inputs=(xs[0],),
                      plan=manual_plan(module, (xs[0],), chunk_size=300, n_blocks=2), device="cpu", accumulation_steps=1)
    assert [[s.name for s in c.slots] for c in model.store.chunks] == [["router"], ["lin.weight", "lin.bias"]]
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x in xs:
        for m, inner, o in ((reference, reference, ref_opt), (model, module, opt)):
            (m(x) + inner.aux).backward()
            o.step()
            o.zero_grad()
    assert _max_diff(model.state_dict(), reference.state_dict()) <= 1e-6


def test_a_step_before_the_backward_is_refused_through_a_dataclass_output_too():
    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor

    class ReturnsDataclass(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Toy()

        def forward(self, x):
            return Out(self.inner(x))

    torch.manual_seed(0)
    module = ReturnsDataclass()
    sample, loss_fn = (batches(1, 4)[0],), (lambda out: out.loss)
    model, opt = wrap(module, torch.optim.AdamW(module.parameters(), lr=1e-2), sample_inputs=sample, device="cpu",
                      loss_fn=loss_fn, plan=manual_plan(module, sample, chunk_size=1024, n_blocks=2, loss_fn=loss_fn))
    first, second = batches(2, 4, seed=6)
    model(first).loss.backward()
    out = model(second)
    opt.step()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) updated parameters that the forward"):
        out.loss.backward()


def test_a_zero_dimensional_parameter_takes_moments_saved_with_one_element_as_torch_does():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.scale = torch.nn.Linear(8, 1), torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return (self.l(x) * self.scale).pow(2).mean()

    torch.manual_seed(0)
    module, x = Scaled(), torch.randn(4, 8)
    reference = copy.deepcopy(module)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference(x).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    saved = copy.deepcopy(ref_opt.state_dict())
    for entry in saved["state"].values():  # [1] where the parameter is 0-d: torch's own load takes it
        for kind in ("exp_avg", "exp_avg_sq"):
            if entry[kind].dim() == 0:
                entry[kind] = entry[kind].reshape(1)
    model, opt = wrap(module, torch.optim.AdamW(module.parameters(), lr=1e-2), sample_inputs=(x,),
                      plan=manual_plan(module, (x,), chunk_size=1024, n_blocks=2), device="cpu")
    model.load_state_dict(reference.state_dict())
    opt.load_state_dict(saved)
    for m, o in ((model, opt), (reference, ref_opt)):
        m(x).backward()
        o.step()
    assert _max_diff(model.state_dict(), reference.state_dict()) <= 1e-6


class _Masked(torch.nn.Module):
    """forward(x, *, mask): called with a positional batch and a keyword mask (both required)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, x, *, mask):
        h = self.emb(x[:, :-1]) * mask[:, :-1, None]
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1))


def test_sample_inputs_given_both_positionally_and_by_keyword_train_like_torch():
    """SampleInputs(args=, kwargs=) for a forward called as model(x, mask=m): traced, planned and
    trained as plain torch trains it (the mask matters: it zeroes some positions)."""
    from elixir_ray import SampleInputs
    torch.manual_seed(0)
    base = _Masked()
    ref = copy.deepcopy(base)
    data = [(torch.randint(0, 64, (4, 9)), (torch.rand(4, 9) > 0.3).float()) for _ in range(4)]
    sample = SampleInputs(args=[data[0][0]], kwargs={"mask": data[0][1]})
    model, opt = wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), sample_inputs=sample,
                      device_memory="64MiB", device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, mask in data:
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x, mask=mask).backward()
            o.step()
            o.zero_grad()
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-5), key
    other = _Masked()
    with pytest.raises(TypeError, match="SampleInputs takes args as a tuple"):
        wrap(other, torch.optim.AdamW(other.parameters()), sample_inputs=SampleInputs(args=data[0][0]))
    with pytest.raises(TypeError, match=r"or elixir_ray.SampleInputs\(args=..., kwargs=...\) for both, got set"):
        wrap(other, torch.optim.AdamW(other.parameters()), sample_inputs={data[0][0]})


class _HasNamesOfTheWrapper(torch.nn.Module):
    """Attributes named as the wrapper's own (plan, store), and a property that raises."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
        self.plan, self.store = "the module's plan", "the module's store"

    @property
    def broken(self):
        raise AttributeError("the module's own reason")

    def forward(self, x):
        return self.l(x).pow(2).mean()


def test_the_wrapper_keeps_its_own_attributes_and_passes_on_the_rest():
    module = _HasNamesOfTheWrapper()
    model, _ = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(torch.randn(2, 4),),
                    device="cpu")
    assert model.plan is not module.plan and module.plan == "the module's plan"  # each keeps its own
    assert model.store is not module.store and module.store == "the module's store"
    with pytest.raises(AttributeError) as on_module:
        module.broken
    with pytest.raises(AttributeError) as on_wrapper:
        model.broken
    assert str(on_wrapper.value) == str(on_module.value)  # the error torch gives for the module itself
    model.plan = model.plan  # the wrapper's own name is set on the wrapper
    assert module.plan == "the module's plan"


def test_a_forward_that_returns_a_parameter_as_is_trains_over_several_steps():
    """The hook on an output stays on a parameter returned as is (a leaf): the count of loads it
    would carry must not refuse the backwards of later steps, which reach that parameter, after a
    load (here of the model's own state, as a restore in the loop does)."""
    class WithTemperature(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t, self.temp = Toy(), torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.t(x) * self.temp, self.temp

    torch.manual_seed(0)
    module = WithTemperature()
    reference, sample = copy.deepcopy(module), (batches(1, 4)[0],)
    loss_fn = lambda out: out[0] + 0.01 * out[1] ** 2  # noqa: E731
    model, opt = wrap(module, torch.optim.AdamW(param_groups(module), lr=1e-2), sample_inputs=sample, device="cpu",
                      loss_fn=loss_fn, plan=manual_plan(module, sample, chunk_size=1024, n_blocks=2, loss_fn=loss_fn))
    ref_opt = torch.optim.AdamW(param_groups(reference), lr=1e-2)
    for batch in batches(3, 4, seed=3):
        for m, o in ((model, opt), (reference, ref_opt)):
            loss_fn(m(batch)).backward()
            o.step()
            o.zero_grad()
            m.load_state_dict(m.state_dict())
    assert _max_diff(model.state_dict(), reference.state_dict()) <= 1e-5


@pytest.mark.filterwarnings("ignore:this training step's input 0")  # D takes the fakes, wider than the G sample
@pytest.mark.parametrize("chunk_size", [1024, 4096])  # G and D in chunks of their own, or in one chunk
def test_a_step_on_other_weights_between_a_forward_and_its_backward_trains_like_torch(chunk_size):
    """A GAN in one wrapped module: the D step updates only D, then the G loss goes back through a
    new D forward and the G forward made before that step, whose weights did not change (torch
    allows it, and so does the engine: a step refuses such a backward only where it changed a weight
    the forward saved, a load always)."""
    class GAN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.G = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
            self.D = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

        def forward(self, x, part):
            return self.G(x) if part == "G" else self.D(x).mean()

    torch.manual_seed(0)
    module = GAN()
    reference, sample, loss_fn = copy.deepcopy(module), (torch.randn(8, 8), "G"), (lambda out: out.sum())
    model, opt = wrap(module, torch.optim.AdamW(module.parameters(), lr=1e-2), sample_inputs=sample, device="cpu",
                      loss_fn=loss_fn, plan=manual_plan(module, sample, chunk_size=chunk_size, n_blocks=2, loss_fn=loss_fn))
    both = 1393  # G's 816 parameters and D's 577
    assert model.store.chunks[0].size >= both if chunk_size == 4096 else model.store.chunks[0].size < both
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        z = torch.randn(8, 8)
        for m, o in ((reference, ref_opt), (model, opt)):
            fake = m(z, "G")
            m(fake.detach(), "D").backward()
            o.step()
            o.zero_grad()
            (-m(fake, "D")).backward()
            o.step()
            o.zero_grad()
    assert _max_diff(model.state_dict(), reference.state_dict()) <= 1e-6


def test_step_hooks_run_as_torch_runs_them_and_an_ema_of_the_weights_tracks_torchs():
    """Hooks on the optimizer (an EMA of the weights, a logger) never ran: the optimizer wrap returns
    set up none of torch's step machinery, and registering one raised an AttributeError."""
    import torch.optim.optimizer as torch_optimizer

    model, opt, base, reference, ref_opt = _pair()
    calls, emas = [], []
    for optimizer, module in ((opt, model), (ref_opt, reference)):
        ema = {k: v.detach().clone() for k, v in module.state_dict().items()}

        def update_ema(o, args, kwargs, ema=ema, module=module):
            for k, v in module.state_dict().items():
                ema[k].mul_(0.9).add_(v.detach(), alpha=0.1)
        optimizer.register_step_post_hook(update_ema)
        emas.append(ema)
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt)))
    handle = torch_optimizer.register_optimizer_step_post_hook(
        lambda o, args, kwargs: calls.append(("global post", type(o).__name__)))
    try:
        for batch in batches(3, 4, seed=2):
            for m, o in ((model, opt), (reference, ref_opt)):
                m(batch).backward()
                o.step()
                o.zero_grad()
    finally:
        handle.remove()
    assert calls.count(("pre", True)) == 3 and calls.count(("global post", "ChunkedAdam")) == 3
    assert _max_diff(*emas) < 1e-5
    with pytest.raises(NotImplementedError, match="without torch's state-dict hooks"):
        opt.register_state_dict_post_hook(lambda *a: None)
    # a hook registered on the optimizer before it was wrapped runs on the wrapped one's steps
    module, sample, before = Toy(), (batches(1, 4)[0],), []
    base = torch.optim.AdamW(module.parameters(), lr=1e-2)
    base.register_step_post_hook(lambda o, args, kwargs: before.append(o))
    model, opt = wrap(module, base, sample_inputs=sample, plan=manual_plan(module, sample, chunk_size=1024, n_blocks=2), device="cpu")
    model(sample[0]).backward()
    opt.step()
    assert before == [opt]


def test_another_optimizer_over_wrapped_parameters_is_refused_at_its_step():
    """AdamW for some parameters and SGD for the wrapped module's matrices: the SGD found no gradients
    (they live in the chunks) and silently trained nothing, 0.14 off torch after three steps."""
    torch.manual_seed(0)
    module = Toy()
    sample = (batches(1, 4)[0],)
    vectors = [p for p in module.parameters() if p.dim() < 2]
    matrices = [p for p in module.parameters() if p.dim() >= 2]
    model, opt = wrap(module, torch.optim.AdamW(vectors, lr=1e-2), sample_inputs=sample,
                      plan=manual_plan(module, sample, chunk_size=1024, n_blocks=2), device="cpu")
    sgd = torch.optim.SGD(matrices, lr=0.1)
    model(sample[0]).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"this SGD steps 'emb.weight', a parameter elixir_ray.wrap packed into "
                                           r"chunks"):
        sgd.step()
    unrelated = torch.nn.Linear(3, 3)  # optimizers over other parameters step as before
    plain = torch.optim.SGD(unrelated.parameters(), lr=0.1)
    unrelated(torch.ones(1, 3)).sum().backward()
    plain.step()


def test_a_grad_scaler_is_refused_with_what_to_do_instead_and_training_goes_on():
    """torch.amp.GradScaler failed inside torch ("No inf checks were recorded for this optimizer")."""
    torch.manual_seed(0)
    model, opt, _, _, _ = _pair()
    data = batches(2, 4, seed=4)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading .grad to unscale warns that it holds nothing
        scaler.scale(model(data[0])).backward()
        with pytest.raises(RuntimeError, match=r"a torch.amp.GradScaler stepped elixir_ray's optimizer: .* scales the "
                                               r"loss itself"):
            scaler.step(opt)
    opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(data[1]).backward()
    opt.step()
    assert _max_diff(before, model.state_dict()) > 0  # the next step trains
