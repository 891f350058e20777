"""What the engine would otherwise train differently from plain torch, silently: each is refused with
what to change, at wrap when it can be seen there, else at the optimizer step where it matters.

Found by training the engine beside torch AdamW on the kinds of loops users write (fp32 on the CPU,
evictions forced): before these checks each case trained on without an error and drifted from torch
by 0.02 to 0.5 in the parameters.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import elixir_ray
from elixir_ray import wrap
from elixir_ray.engine import manual_plan
from engine_models import Routed, Toy, batches


def _wrapped(module, optimizer, data, **kwargs):
    sample = (data[0],)
    return wrap(module, optimizer, sample_inputs=sample, plan=manual_plan(module, sample, chunk_size=1024, n_blocks=2), device="cpu",
                **kwargs)


def test_an_optimizer_that_has_stepped_is_refused_at_wrap():
    """Its AdamW moments and step counts would be dropped: bias correction would start again."""
    torch.manual_seed(0)
    module, data = Toy(), batches(2, 4)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(data[0]).backward()
    opt.step()
    with pytest.raises(ValueError, match=r"already has state for \d+ parameter\(s\).*Wrap a new optimizer"):
        _wrapped(module, opt, data)


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")  # torch's own
def test_a_parameter_listed_twice_is_refused_at_wrap():
    torch.manual_seed(0)
    module, data = Toy(), batches(2, 4)
    params = list(module.parameters())
    opt = torch.optim.AdamW([{"params": params + params[:1]}])
    with pytest.raises(ValueError, match="listed twice in the optimizer's param groups"):
        _wrapped(module, opt, data)


@pytest.mark.parametrize("change", ["float64", "mixed"])
def test_parameters_of_another_dtype_are_refused_at_wrap(change):
    torch.manual_seed(0)
    module, data = Toy(), batches(2, 4)
    if change == "float64":
        module.double()
    else:
        module.l1.double()
    with pytest.raises(ValueError, match=r"float64.*Convert the module first \(module.float\(\)\)"):
        _wrapped(module, torch.optim.AdamW(module.parameters()), data)


@pytest.mark.parametrize("flag", ["amsgrad", "differentiable"])
def test_flags_the_engine_would_ignore_are_refused_with_what_to_pass(flag):
    torch.manual_seed(0)
    module, data = Toy(), batches(2, 4)
    with pytest.raises(TypeError, match=rf"AdamW\({flag}=True\): pass {flag}=False \(the default\)"):
        _wrapped(module, torch.optim.AdamW(module.parameters(), **{flag: True}), data)


def _one_step(model, opt, batch):
    model(batch).backward()
    opt.step()


@pytest.mark.parametrize("change", ["unfreeze", "add_group", "maximize"])
def test_changes_after_wrap_that_torch_would_honour_are_refused_at_the_step(change):
    torch.manual_seed(0)
    module, data = Toy(), batches(3, 4)
    module.l1.weight.requires_grad_(False)
    trainable = [p for p in module.parameters() if p.requires_grad]
    base = torch.optim.AdamW(trainable[:-1], lr=1e-2)
    model, opt = _wrapped(module, base, data)
    _one_step(model, opt, data[0])
    opt.zero_grad()
    if change == "unfreeze":
        module.l1.weight.requires_grad_(True)
        message = "'l1.weight' was frozen .* at wrap and is trainable now"
    elif change == "add_group":
        base.add_param_group({"params": trainable[-1:]})
        message = "has 2 param groups, but it had 1 at wrap"
    else:
        base.param_groups[0]["maximize"] = True
        message = "maximize=True was set on a param group after wrap"
    with pytest.raises(RuntimeError, match=message):
        _one_step(model, opt, data[1])
    with pytest.raises(RuntimeError, match="cannot take a param group after wrap"):
        opt.add_param_group({"params": []})


def test_kept_zero_gradients_of_a_parameter_unused_in_a_step_are_refused():
    """torch keeps a zero .grad after zero_grad(set_to_none=False), so AdamW still moves a parameter that
    got no gradient (momentum, weight decay); the engine updates only parameters with a gradient."""
    torch.manual_seed(0)
    module = Routed()
    data = batches(3, 8, seed=6)
    data[0][0, :4] = data[0][0, :4] // 2 * 2  # every expert in the first step
    data[1][0, :4] = torch.tensor([2, 1, 1, 1])  # expert 0 only in the second
    data[2] = data[0].clone()
    reference = copy.deepcopy(module)
    model, opt = _wrapped(module, torch.optim.AdamW(module.parameters(), lr=1e-2), data)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    # every parameter used: kept zero gradients change nothing, and the engine trains like torch
    _one_step(model, opt, data[0])
    opt.zero_grad(set_to_none=False)
    _one_step(reference, ref_opt, data[0])
    ref_opt.zero_grad(set_to_none=False)
    _one_step(model, opt, data[2])
    _one_step(reference, ref_opt, data[2])
    ref_state = reference.state_dict()
    assert max((v - ref_state[k]).abs().max().item() for k, v in model.state_dict().items()) < 1e-5
    opt.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match=r"'experts\.1\..*' got no gradient in this step but kept a zero one"):
        _one_step(model, opt, data[1])


def test_a_parameter_frozen_after_keeping_a_zero_gradient_is_refused_as_torch_still_moves_it():
    """Frozen mid-run after zero_grad(set_to_none=False): torch's AdamW keeps stepping it (its .grad is a
    zero tensor, not None); the engine silently stopped, 8e-3 away from torch after one step."""
    torch.manual_seed(0)
    module, data = Toy(), batches(3, 4, seed=3)
    model, opt = _wrapped(module, torch.optim.AdamW(module.parameters(), lr=1e-2), data)
    _one_step(model, opt, data[0])
    opt.zero_grad(set_to_none=False)
    model.module.l3.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"'l3.weight' got no gradient in this step \(it was frozen since\) but "
                                           r"kept a zero one"):
        _one_step(model, opt, data[1])


def test_a_tensor_learning_rate_changed_in_place_after_backward_is_refused():
    """A scheduler edits a tensor lr in place: the same object, so the value is what is compared."""
    torch.manual_seed(0)
    module, data = Toy(), batches(2, 4)
    base = torch.optim.AdamW(module.parameters(), lr=torch.tensor(1e-2))
    model, opt = _wrapped(module, base, data, accumulation_steps=1)
    model(data[0]).backward()  # the host chunks' updates start here, with lr 1e-2
    base.param_groups[0]["lr"].fill_(5e-3)
    with pytest.raises(RuntimeError, match="changed between backward"):
        opt.step()


def test_stepping_the_original_optimizer_is_refused():
    """It would find no gradients (they live in chunks) and silently do nothing."""
    torch.manual_seed(0)
    module, data = Toy(), batches(2, 4)
    base = torch.optim.AdamW(module.parameters(), lr=1e-2)
    model, opt = _wrapped(module, base, data)
    scheduler = torch.optim.lr_scheduler.LambdaLR(base, lambda step: 0.5)  # schedulers keep working on it
    model(data[0]).backward()
    with pytest.raises(RuntimeError, match="step the optimizer wrap returned"):
        base.step()
    opt.step()
    scheduler.step()
    assert base.param_groups[0]["lr"] == pytest.approx(5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calling_the_module_given_to_wrap_names_the_model_to_call(dtype):
    """Its parameters are chunk views only the wrapped call fetches: in bf16 the call failed deep in
    torch on a dtype mismatch, in fp32 it could read chunks the pool had evicted. The wrapped model
    still works afterwards, including a checkpointed Toy whose regions recompute in backward."""
    torch.manual_seed(0)
    module, data = Toy(ckpt="reentrant"), batches(2, 4)
    model, opt = _wrapped(module, torch.optim.AdamW(module.parameters(), lr=1e-2), data, dtype=dtype)
    with pytest.raises(RuntimeError, match=r"the Toy given to elixir_ray.wrap was called directly: call the model "
                                           r"wrap returned"):
        module(data[0])
    with pytest.raises(RuntimeError, match=r"a part of the Toy given to elixir_ray.wrap ran outside the wrapped "
                                           r"model \(Linear 'l1'"):
        model.l1(torch.randn(2, 32))  # a submodule, read through the wrapped model: refused as the module is
    model(data[1]).backward()
    opt.step()
    with torch.no_grad():
        assert torch.isfinite(model(data[0]))


def test_reading_an_evicted_parameter_outside_the_model_is_an_error_that_names_it():
    """After a step every chunk's compute copy is freed: `print(p)` or `p.norm()` read through a null
    pointer and killed the process with a segfault. Now each read is refused, naming the parameter
    and where the weights are; what reads no data (or converts to the device and dtype it has) still
    works, and so does training afterwards."""
    torch.manual_seed(0)
    module, data = Toy(), batches(3, 4)
    reference = copy.deepcopy(module)
    model, opt = _wrapped(module, torch.optim.AdamW(module.parameters(), lr=1e-2), data)
    model(data[0]).backward()
    opt.step()
    opt.zero_grad()
    weight = module.l1.weight
    reads = [lambda: repr(weight), lambda: weight.norm(), lambda: weight.data, lambda: weight.detach(),
             lambda: weight + 1, lambda: torch.cat([weight, weight]), lambda: module.state_dict(),
             lambda: copy.deepcopy(module), lambda: module.to(torch.float64)]
    for read in reads:
        with pytest.raises(RuntimeError, match=r"parameter (l1|emb).weight was read .* while its chunk has no copy "
                                               r"on the device.*model.state_dict\(\)"):
            read()
    assert isinstance(weight, torch.nn.Parameter)
    assert (weight.shape, weight.dtype, weight.requires_grad, weight.numel(), weight.grad) == \
        ((64, 32), torch.float32, True, 64 * 32, None)
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in reference.parameters())
    assert model.to("cpu") is model and model.float() is model  # conversions to what it is already
    # new tensors shaped like it, and its shape on meta, read no data (an EMA started beside a weight)
    assert torch.zeros_like(weight).shape == (64, 32) and weight.new_zeros(2, 3).shape == (2, 3)
    assert torch.empty_like(weight, device="meta").shape == weight.to("meta").shape == (64, 32)
    assert torch.numel(weight) == 64 * 32 and torch.is_floating_point(weight)
    assert model.state_dict()["l1.weight"].shape == (64, 32)
    model(data[1]).backward()  # training goes on: the refusals changed nothing
    opt.step()
    with torch.no_grad():
        assert torch.isfinite(model(data[2]))


def test_sample_inputs_given_as_a_bare_tensor_or_short_of_a_keyword_argument_say_what_the_trace_takes():
    """tuple(tensor) split the batch into one input per row ("forward() takes 2 positional arguments
    but 9 were given"), and a keyword-only input failed with the module's own message."""
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 1)

        def forward(self, x, *, mask):
            return (self.l(x) * mask).sum()

    module, x = Masked(), torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"sample_inputs must be a tuple .* shape \(4, 8\): pass sample_inputs=\(batch,\)"):
        wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=x, device_memory="64MiB", device="cpu")
    with pytest.raises(TypeError, match=r"keyword-only argument: 'mask': the trace calls Masked with 1 positional "
                                        r"input\(s\). Give sample_inputs every input forward needs: a tuple of its "
                                        r"positional inputs, or a dict of its keyword inputs"):
        wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device_memory="64MiB", device="cpu")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'batch'.*with keyword inputs batch, x\..*a "
                                        r"dict that forward takes as one input goes in a tuple"):
        wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs={"x": x, "batch": x}, device_memory="64MiB",
             device="cpu")
    with pytest.raises(TypeError, match=r"its keys must be argument names, got 0"):
        wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs={0: x}, device_memory="64MiB", device="cpu")
    mask = torch.ones(4, 1)
    model, opt = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs={"x": x, "mask": mask},
                      device_memory="64MiB", device="cpu")
    model(x, mask=mask).backward()
    opt.step()


def test_a_step_whose_output_holds_no_loss_is_refused_at_wrap_naming_loss_fn():
    """Traced without a loss, the step had no backward: a plan without gradients or their order."""
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.l(x)
            return y.pow(2).mean(), y

    module, x = Pair(), torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"Pair's forward returned a tuple, and the trace runs one backward from the "
                                        r"step's loss: pass loss_fn="):
        wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device_memory="64MiB", device="cpu")
    with pytest.raises(TypeError, match=r"loss_fn returned a tuple, not the step.s loss tensor"):
        wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device_memory="64MiB", device="cpu",
             loss_fn=lambda out: out[1:])
    model, opt = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device_memory="64MiB",
                      device="cpu", loss_fn=lambda out: out[0])
    assert model.plan.predicted_step_seconds > 0
    loss, _ = model(x)
    loss.backward()
    opt.step()


_CPU = elixir_ray.HardwareProfile(device="cpu", h2d_gbps=10.0, d2h_gbps=10.0, cpu_adam_params_per_s=5e8,
                                  device_adam_params_per_s=5e8, matmul_tflops=0.1, cpu_threads=2)


class _NanoGPTLike(torch.nn.Module):
    """nanoGPT's forward: (logits, loss) with targets, (logits, None) without."""

    def __init__(self, vocab: int = 256, d: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.emb(idx))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def test_a_loss_that_is_not_a_scalar_is_refused_naming_its_shape_before_the_module_is_touched():
    """loss_fn=lambda out: out[0] on nanoGPT took its [8, 64, 256] logits for the loss: the trace ran
    backward from them (as from their sum) and wrap planned and trained on that."""
    torch.manual_seed(0)
    module = _NanoGPTLike()
    idx = torch.randint(0, 256, (8, 64))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    opt = torch.optim.AdamW(module.parameters())
    with pytest.raises(TypeError, match=r"^loss_fn returned a tensor of shape \[8, 64, 256\], not a scalar loss; "
                                        r"out\[1\] is a scalar tensor: loss_fn=lambda out: out\[1\]$"):
        wrap(module, opt, sample_inputs=(idx, idx), device_memory="64MiB", device="cpu", loss_fn=lambda out: out[0])
    with pytest.raises(TypeError, match=r"^loss_fn returned a tensor of shape \[8, 64, 256\], not a scalar loss: "
                                        r"reduce it"):  # no targets: no element is a scalar
        wrap(module, opt, sample_inputs=(idx,), device_memory="64MiB", device="cpu", loss_fn=lambda out: out[0])
    with pytest.raises(TypeError, match=r"shape \[8, 64, 256\], not a scalar loss"):  # the planner traces alike
        elixir_ray.plan(module, (idx, idx), device_memory="64MiB", loss_fn=lambda out: out[0], hardware=_CPU)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert module.head.weight.untyped_storage().nbytes() > 0 and not opt.state

    class HalfReduced(torch.nn.Module):  # a ModelOutput-like dict whose loss kept its batch dimension
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            return {"loss": self.l(x).pow(2).mean(1)}

    half = HalfReduced()
    with pytest.raises(TypeError, match=r"HalfReduced's forward returned a loss of shape \[4\], not a scalar"):
        wrap(half, torch.optim.AdamW(half.parameters()), sample_inputs=(torch.randn(4, 8),), device_memory="64MiB",
             device="cpu")
    model, opt = wrap(module, opt, sample_inputs=(idx, idx), device_memory="64MiB", device="cpu",
                      loss_fn=lambda out: out[1])
    model(idx, idx)[1].backward()
    opt.step()


def test_a_tuple_output_without_loss_fn_names_its_scalar_element_or_says_there_is_none():
    module = _NanoGPTLike()
    idx = torch.randint(0, 256, (2, 8))
    opt = torch.optim.AdamW(module.parameters())
    with pytest.raises(TypeError, match=r"_NanoGPTLike's forward returned a tuple, and the trace runs one backward "
                                        r"from the step's loss: pass loss_fn=lambda out: out\[1\] \(out\[1\] is the "
                                        r"tuple's one scalar tensor\)"):
        wrap(module, opt, sample_inputs=(idx, idx), device_memory="64MiB", device="cpu")
    with pytest.raises(TypeError, match=r"pass loss_fn=, a function that computes the loss from it \(none of the "
                                        r"tuple's 2 elements is a scalar tensor\)") as refused:
        wrap(module, opt, sample_inputs=(idx,), device_memory="64MiB", device="cpu")
    assert "out[0]" not in str(refused.value)


def test_a_forward_after_the_backward_that_started_the_updates_is_refused_until_the_step():
    """With accumulation_steps=N the N-th backward starts host chunks' updates: a forward before the
    step (a validation loss) computed with some weights old and some new, silently."""
    torch.manual_seed(0)
    module, data = Toy(), batches(3, 4)
    model, opt = _wrapped(module, torch.optim.AdamW(module.parameters(), lr=1e-2), data, accumulation_steps=2)
    model(data[0]).backward()
    with torch.no_grad():
        model(data[2])  # after the first of two backwards nothing is updated yet: allowed
    model(data[1]).backward()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"cannot run the model between backward\(\) and "
                                                            r"optimizer.step\(\) with accumulation_steps=2.*Run it "
                                                            r"before that backward or after optimizer.step\(\)"):
        model(data[2])
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        assert torch.isfinite(model(data[2]))


def test_a_module_wrapped_twice_is_refused_saying_so():
    """The second wrap's trace called the wrapped module and got the "called directly" refusal."""
    torch.manual_seed(0)
    module, data = Toy(), batches(2, 4)
    _wrapped(module, torch.optim.AdamW(module.parameters()), data)
    with pytest.raises(ValueError, match=r"this Toy was already given to elixir_ray.wrap.*copy.deepcopy\(module\)"):
        _wrapped(module, torch.optim.AdamW(module.parameters()), data)
    with pytest.raises(ValueError, match=r"this Sequential \(its 0\) was already given to elixir_ray.wrap"):
        outer = torch.nn.Sequential(module)
        wrap(outer, torch.optim.AdamW(outer.parameters()), sample_inputs=(data[0],), device_memory="64MiB",
             device="cpu")


class _Scale(torch.nn.Module):  # meta weights and a meta buffer, no reset_parameters
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.register_buffer("shift", torch.zeros(n))

    def forward(self, x):
        return x * self.weight + self.shift


def test_a_meta_module_that_nothing_initialises_is_refused_naming_init_fn():
    """Without reset_parameters its weights kept whatever memory they were given (NaN losses)."""
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(8, 8), _Scale(8))
    x = torch.randn(4, 8)

    def loss(out):
        return out.square().mean()

    with pytest.raises(ValueError, match=r"Sequential is on the meta device, and 1 of its modules hold meta weights or "
                                         r"buffers but have no reset_parameters\(\) to initialise them: 1 \(_Scale: "
                                         r"weight, buffer shift\). Pass init_fn="):
        wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device_memory="64MiB", device="cpu",
             loss_fn=loss)

    def init(mod):
        if isinstance(mod, _Scale):
            torch.nn.init.ones_(mod.weight)
            torch.nn.init.zeros_(mod.shift)
        elif isinstance(mod, torch.nn.Linear):
            mod.reset_parameters()

    model, _ = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(x,), device_memory="64MiB",
                    device="cpu", loss_fn=loss, init_fn=init)
    state = model.state_dict()
    assert torch.equal(state["1.weight"], torch.ones(8)) and torch.equal(state["1.shift"], torch.zeros(8))
    assert torch.isfinite(model(x)).all()


def test_a_tied_weight_that_another_holder_resets_is_initialised():
    """The embedding holding it has no reset_parameters, but the head it is tied to does."""
    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(16, 8))

        def forward(self, ids):
            return self.weight[ids]

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.head = Table(), torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.table.weight

        def forward(self, ids):
            return self.head(self.table(ids)).square().mean()

    with torch.device("meta"):
        module = Tied()
    model, _ = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(torch.randint(0, 16, (2, 4)),),
                    device_memory="64MiB", device="cpu")
    weight = model.state_dict()["table.weight"]
    assert torch.isfinite(weight).all() and 0 < weight.abs().max() <= 8 ** -0.5  # Linear's kaiming bound


def test_a_memory_margin_beside_a_given_plan_is_refused():
    """The margin is the plan search's: with a plan given it would silently do nothing."""
    torch.manual_seed(0)
    module, data = Toy(), batches(1, 4)
    plan = manual_plan(module, (data[0],), chunk_size=4096, n_blocks=2)
    with pytest.raises(ValueError, match="memory_margin is the plan search's, and a plan was given"):
        wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(data[0],), device="cpu", plan=plan,
             memory_margin=0.1)


@pytest.mark.parametrize("change", ["layer", "weight", "adapter", "same"])
def test_a_parameter_replaced_or_added_after_wrap_is_refused_at_the_next_forward(change):
    """Its new parameter is in no chunk: it would be used without the engine and never updated (a
    Hugging Face resize_token_embeddings or an adapter injected after wrap does this). The check
    compares each module's own tables with those at wrap: a layer replaced, a parameter replaced
    in place and a layer added inside another are seen; a layer set again to itself changes nothing."""
    torch.manual_seed(0)
    module, data = Toy(), batches(3, 4)
    model, opt = _wrapped(module, torch.optim.AdamW(module.parameters(), lr=1e-2), data)
    model(data[0]).backward()
    opt.step()
    opt.zero_grad()
    if change == "layer":
        module.l2 = torch.nn.Linear(64, 32)
        name = r"l2.weight' of shape \(32, 64\)"
    elif change == "weight":
        module.l1.weight = torch.nn.Parameter(torch.zeros(64, 32))
        name = "l1.weight'"
    elif change == "adapter":
        module.l3.adapter = torch.nn.Linear(2, 2, bias=False)
        name = "l3.adapter.weight'"
    else:
        module.l2 = module.l2
        for batch in data[1:]:
            model(batch).backward()
            opt.step()
            opt.zero_grad()
        return
    with pytest.raises(RuntimeError, match=rf"parameter '{name}.* was added to the module after wrap"):
        model(data[1])
