from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from elixir_ray.model.gpt import GPT, GPTConfig, build_gpt
from elixir_ray.model.sizes import MODEL_SIZES, gpt_param_count


@pytest.mark.parametrize("size", list(MODEL_SIZES))
def test_named_sizes_build_on_meta(size):
    model = build_gpt(MODEL_SIZES[size], device="meta")
    assert model.num_parameters() == gpt_param_count(**MODEL_SIZES[size])
    assert model.head.weight is model.wte.weight


def test_headline_sizes():
    billions = {s: gpt_param_count(**MODEL_SIZES[s]) / 1e9 for s in ("gpt-1.5b", "gpt-4b", "gpt-10b")}
    assert billions["gpt-1.5b"] == pytest.approx(1.56, abs=0.01)
    assert billions["gpt-4b"] == pytest.approx(4.24, abs=0.01)
    assert billions["gpt-10b"] >= 10.0
    assert 0.5e6 < gpt_param_count(**MODEL_SIZES["tiny"]) < 1.5e6


@pytest.mark.parametrize("mode", [True, "full", "selective"])
def test_activation_checkpointing_gives_same_loss_and_grads(mode):
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=50, seq_len=16)
    plain = GPT(cfg)
    ckpt = GPT(GPTConfig(**{**cfg.__dict__, "activation_checkpointing": mode}))
    ckpt.load_state_dict(plain.state_dict())
    batch = torch.randint(0, 50, (3, 17))
    l1, l2 = plain(batch), ckpt(batch)
    l1.backward()
    l2.backward()
    assert torch.allclose(l1, l2)
    for (n, p1), p2 in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6), n


def _assert_grads_close(got: dict, want: dict, **tol) -> None:
    """Per parameter name: the same gradient within `tol`, or None in both."""
    for name, g in want.items():
        if g is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(got[name], g, **tol, msg=lambda m, name=name: f"{name}: {m}")


class _CountsOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode) -> Counter:
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_layers=3, n_heads=2, vocab_size=50, seq_len=16, activation_checkpointing=mode))
    loss = model(torch.randint(0, 50, (2, 17)))
    with _CountsOps() as ops:
        loss.backward()
    return ops.counts


def test_selective_checkpointing_recomputes_norms_and_activations_but_no_matmul():
    kept, whole, selective = _backward_ops("none"), _backward_ops("full"), _backward_ops("selective")
    # whole blocks: qkv, proj and up again in each (recomputation stops before the down projection,
    # whose output nothing saved)
    assert whole["addmm"] - kept["addmm"] >= 3 * 3
    assert selective["addmm"] == kept["addmm"]  # selective: the matmuls' outputs were kept
    assert selective["mm"] == kept["mm"]  # and their gradients take the same matmuls
    assert kept["gelu"] == 0 and selective["gelu"] == whole["gelu"] == 3  # the GELU is recomputed
    assert selective["native_layer_norm"] == whole["native_layer_norm"] == 2 * 3


def test_selective_blocks_rerun_no_matmul_with_checkpoint_early_stop_off():
    """Selective blocks recompute in their own autograd Functions, not through
    torch.utils.checkpoint, so its early-stop setting changes nothing (with torch's checkpoint,
    turning it off reran the matmuls)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    kept = _backward_ops("none")
    with set_checkpoint_early_stop(False):
        selective = _backward_ops("selective")
    assert selective["addmm"] == kept["addmm"] and selective["mm"] == kept["mm"]


@pytest.mark.parametrize("dtype, autocast, frozen", [
    (torch.float32, None, False), (torch.float32, torch.bfloat16, False), (torch.bfloat16, None, False),
    (torch.float64, None, False), (torch.float32, None, True), (torch.float32, torch.bfloat16, True)])
def test_selective_blocks_give_the_loss_and_gradients_of_plain_ones(dtype, autocast, frozen):
    """Every block selective against none: the same loss and gradients, in the model's dtype and
    under CPU autocast (whose casts the pieces' backward differentiates as autograd does), also
    with some parameters frozen (the embeddings too, so no block's input needs a gradient)."""
    def step(mode):
        torch.manual_seed(0)
        model = GPT(GPTConfig(d_model=32, n_layers=3, n_heads=2, vocab_size=50, seq_len=16,
                              activation_checkpointing=mode)).to(dtype)
        if frozen:
            for p in (model.wte.weight, model.wpe.weight, *(p for b in model.blocks for p in
                      (b.ln1.weight, b.attn.qkv.bias, b.mlp.up.weight, b.mlp.down.weight))):
                p.requires_grad_(False)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(torch.randint(0, 50, (3, 17)))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    (plain_loss, plain), (loss, grads) = step("none"), step("selective")
    low = dtype == torch.bfloat16 or autocast is not None
    tol = dict(rtol=2e-2, atol=1e-3) if low else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, plain_loss, **tol)
    _assert_grads_close(grads, plain, **tol)


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("where", ["forward hook", "full backward hook", "pre-hook returning an input"])
def test_checkpointed_blocks_with_hooks_on_their_layers_train_like_plain_ones(where, mode):
    """A hook that changes a layer's result (an adapter added by a forward hook, a pre-hook that
    returns a changed input) or needs its autograd (a full backward hook) gets it: such blocks
    take torch's checkpointed pieces, so the adapter's own weight gets its gradient and every
    gradient upstream of it is that of the plain model; the backward hook fires as often."""
    def step(mode):
        torch.manual_seed(0)
        model = GPT(GPTConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=50, seq_len=16,
                              activation_checkpointing=mode))
        adapter = torch.nn.Parameter(torch.randn(32, 96) * 0.1)
        fired = []
        for b in model.blocks:
            if where == "forward hook":
                b.attn.qkv.register_forward_hook(lambda m, inp, out: out + inp[0] @ adapter)
            elif where == "full backward hook":
                b.mlp.up.register_full_backward_hook(lambda m, gi, go: fired.append(1))
            else:
                b.ln2.register_forward_pre_hook(lambda m, args: (args[0] * 1.5,))
        loss = model(torch.randint(0, 50, (3, 17)))
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return loss.detach(), grads, adapter.grad, len(fired)

    plain_loss, plain, plain_adapter, plain_fired = step("none")
    loss, grads, adapter, fired = step(mode)
    torch.testing.assert_close(loss, plain_loss)
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    if where == "forward hook":
        assert plain_adapter is not None
        torch.testing.assert_close(adapter, plain_adapter, rtol=1e-5, atol=1e-6)
    assert fired == plain_fired == (2 if where == "full backward hook" else 0)


def test_a_double_backward_through_selective_blocks():
    """Without autocast a gradient penalty through selective blocks is that of plain ones (the
    pieces' backward is differentiable); under autocast, whose recomputation differentiates
    detached inputs, it is refused rather than silently dropping second-order terms."""
    def penalty(mode, autocast):
        torch.manual_seed(0)
        model = GPT(GPTConfig(d_model=16, n_layers=2, n_heads=2, vocab_size=30, seq_len=8,
                              activation_checkpointing=mode)).double()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(torch.randint(0, 30, (2, 9)))
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            sum(g.square().sum() for g in grads).backward()
        return [p.grad for p in model.parameters()]

    for got, want in zip(penalty("selective", False), penalty("none", False)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    with pytest.raises(RuntimeError, match="double backward .* under autocast is not supported"):
        penalty("selective", True)


def _whole_blocks_taken(model, batch):
    """How many blocks a step of `model` recomputed through `_WholeBlock` (not torch's checkpoint)."""
    from elixir_ray.model import gpt as gpt_module
    apply, taken = gpt_module._WholeBlock.apply, []

    def counted(*args):
        taken.append(1)
        return apply(*args)

    gpt_module._WholeBlock.apply = counted
    try:
        loss = model(batch)
    finally:
        gpt_module._WholeBlock.apply = apply
    return loss, len(taken)


@pytest.mark.parametrize("dtype, autocast, frozen", [
    (torch.float32, None, False), (torch.float32, torch.bfloat16, False), (torch.float64, None, False),
    (torch.float32, None, True), (torch.float32, torch.bfloat16, True)])
def test_whole_recomputed_blocks_give_the_loss_and_gradients_of_plain_ones(dtype, autocast, frozen):
    """Blocks recomputed whole go through `_WholeBlock` and give the loss and gradients of kept
    ones, under CPU autocast too, and with the embeddings frozen (no block's input needs a
    gradient: torch's reentrant checkpoint would give its parameters none)."""
    def step(mode):
        torch.manual_seed(0)
        model = GPT(GPTConfig(d_model=32, n_layers=3, n_heads=2, vocab_size=50, seq_len=16,
                              activation_checkpointing=mode)).to(dtype)
        if frozen:
            for p in (model.wte.weight, model.wpe.weight, model.blocks[1].attn.qkv.weight):
                p.requires_grad_(False)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss, taken = _whole_blocks_taken(model, torch.randint(0, 50, (3, 17)))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, taken

    (plain_loss, plain, _), (loss, grads, taken) = step("none"), step("full")
    assert taken == 3
    tol = dict(rtol=2e-2, atol=1e-3) if autocast is not None else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, plain_loss, **tol)
    _assert_grads_close(grads, plain, **tol)


def test_autograd_grad_and_a_double_backward_through_whole_recomputed_blocks():
    """torch.autograd.grad through blocks recomputed whole returns the plain model's gradients and
    leaves .grad alone (torch's reentrant checkpoint refuses it); a gradient penalty through them
    (create_graph) is that of plain blocks."""
    def grads(mode):
        torch.manual_seed(0)
        model = GPT(GPTConfig(d_model=16, n_layers=2, n_heads=2, vocab_size=30, seq_len=8,
                              activation_checkpointing=mode)).double()
        batch = torch.randint(0, 30, (2, 9))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            loss, taken = _whole_blocks_taken(model, batch)
            first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            assert all(p.grad is None for p in model.parameters())
            penalty = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            sum(g.square().sum() for g in penalty).backward()
        return first, [p.grad for p in model.parameters()], taken

    plain_first, plain_second, _ = grads("none")
    first, second, taken = grads("full")
    assert taken == 2
    for got, want in zip(first, plain_first):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    for got, want in zip(second, plain_second):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def test_blocks_with_dropout_or_hooks_recompute_through_torchs_checkpoint():
    """`_WholeBlock` replays no random state and runs its forward without autograd: blocks with
    dropout, or with a hook that could change a layer's result, take torch's checkpoint."""
    batch = torch.randint(0, 50, (2, 17))
    cfg = dict(d_model=32, n_layers=2, n_heads=2, vocab_size=50, seq_len=16, activation_checkpointing="full")
    assert _whole_blocks_taken(GPT(GPTConfig(**cfg)), batch)[1] == 2
    assert _whole_blocks_taken(GPT(GPTConfig(**cfg, dropout=0.1)), batch)[1] == 0
    hooked = GPT(GPTConfig(**cfg))
    hooked.blocks[1].mlp.up.register_forward_hook(lambda m, inp, out: out * 2)
    assert _whole_blocks_taken(hooked, batch)[1] == 1

    class Adapted(torch.nn.Module):  # a layer replaced by one with a weight of its own beside the old
        def __init__(self, base):
            super().__init__()
            self.base, self.extra = base, torch.nn.Parameter(torch.zeros(base.out_features))

        def forward(self, h):
            return self.base(h) + self.extra

    torch.manual_seed(0)
    plain = GPT(GPTConfig(**{**cfg, "activation_checkpointing": "none"}))
    adapted = GPT(GPTConfig(**cfg))
    adapted.load_state_dict(plain.state_dict())
    for model in (plain, adapted):
        model.blocks[0].mlp.up = Adapted(model.blocks[0].mlp.up)
    loss, taken = _whole_blocks_taken(adapted, batch)
    assert taken == 1  # the other block
    loss.backward()
    plain(batch).backward()
    torch.testing.assert_close(adapted.blocks[0].mlp.up.extra.grad, plain.blocks[0].mlp.up.extra.grad)


def _plain_and_full(change=None, **extra):
    """The same GPT kept and recomputed whole (equal weights), each changed by `change(model)`."""
    cfg = dict(d_model=32, n_layers=2, n_heads=2, vocab_size=50, seq_len=16, **extra)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**cfg))
    full = GPT(GPTConfig(**cfg, activation_checkpointing="full"))
    full.load_state_dict(plain.state_dict())
    if change is not None:
        change(plain)
        change(full)
    return plain, full


def _assert_same_grads(plain, full):
    for (name, p), q in zip(plain.named_parameters(), full.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_blocks_whole_recomputation_does_not_know_take_torchs_checkpoint(monkeypatch):
    """What `_WholeBlock` would get wrong goes through torch's checkpoint, with the plain model's
    gradients: a parameter tied to another of the same block (passed twice, counted twice), a
    subclass computing otherwise (here a ReLU MLP, or a forward replaced on an instance), a
    dropout replaced by nn.Identity, a method patched on a class."""
    from elixir_ray.model import gpt as gpt_module

    class ReluMLP(gpt_module.MLP):
        def project(self, u):
            return self.down(torch.relu(u))

    def tie(model):
        block = model.blocks[0]
        block.ln2.weight, block.ln2.bias = block.ln1.weight, block.ln1.bias

    def relu(model):
        old = model.blocks[0].mlp
        new = ReluMLP(model.cfg)
        new.load_state_dict(old.state_dict())
        model.blocks[0].mlp = new

    def instance_forward(model):
        block = model.blocks[0]
        block.forward = lambda x, selective=False: x + block.attn(block.ln1(x))  # no MLP

    def identity_dropout(model):
        for block in model.blocks:
            block.mlp.drop = torch.nn.Identity()

    def class_patch(model):  # on the class: every block (a library's monkeypatch)
        monkeypatch.setattr(gpt_module.MLP, "project", ReluMLP.project)

    batch = torch.randint(0, 50, (2, 17))
    for change, whole in ((tie, 1), (relu, 1), (instance_forward, 1), (identity_dropout, 0), (class_patch, 0)):
        plain, full = _plain_and_full(change)
        loss, taken = _whole_blocks_taken(full, batch)
        assert taken == whole, change.__name__
        loss.backward()
        plain(batch).backward()
        _assert_same_grads(plain, full)


def test_whole_recomputed_blocks_under_functional_call_and_an_autocast_only_in_backward():
    """torch.func.functional_call's tensors are not the block's parameters, which its backward
    reruns with: such a forward takes torch's checkpoint, and autograd.grad reaches them. A
    backward called inside an autocast that the forward ran without recomputes without it, and
    runs the backward's own kernels under it, as autograd does for kept blocks (bit for bit)."""
    batch = torch.randint(0, 50, (2, 17))
    plain, full = _plain_and_full()
    wanted = {}
    for model in (plain, full):
        params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        loss = torch.func.functional_call(model, params, (batch,))
        wanted[model] = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    for name, g in wanted[plain].items():
        torch.testing.assert_close(wanted[full][name], g, rtol=1e-5, atol=1e-6)
    # given nn.Parameters (another model's, say), the forward is recomputed with them, after
    # functional_call has put the block's own back
    for model in (plain, full):
        params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
        loss = torch.func.functional_call(model, params, (batch,))
        wanted[model] = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    for name, g in wanted[plain].items():
        torch.testing.assert_close(wanted[full][name], g, rtol=1e-5, atol=1e-6)
    assert all(p is q for p, q in zip(full.blocks[0].own_parameters(), full.blocks[0].parameters()))

    plain, full = _plain_and_full()
    for model in (plain, full):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autocast("cpu", enabled=False):
                loss, taken = _whole_blocks_taken(model, batch)
            loss.backward()
        assert taken == (2 if model is full else 0)
    for p, q in zip(plain.parameters(), full.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_partial_backward_leaves_nothing_behind_in_a_selective_block():
    """A gradient of only a linear's bias runs that linear's backward but not the norm's before
    it: the output gradient it leaves for the weight's gradient is one slot, overwritten, not a
    pile that grows with each such call (and the full backward after is still exact)."""
    torch.manual_seed(0)
    cfg = dict(d_model=16, n_layers=1, n_heads=2, vocab_size=30, seq_len=8)
    model, plain = GPT(GPTConfig(**cfg, activation_checkpointing="selective")), GPT(GPTConfig(**cfg))
    plain.load_state_dict(model.state_dict())
    batch = torch.randint(0, 30, (2, 9))
    boxes = []
    from elixir_ray.model import gpt as gpt_module
    apply = gpt_module._Linear.apply

    def keep_box(h, linear, weight, bias, box):
        boxes.append(box)
        return apply(h, linear, weight, bias, box)

    gpt_module._Linear.apply = keep_box
    try:
        loss = model(batch)
    finally:
        gpt_module._Linear.apply = apply
    qkv = model.blocks[0].attn.qkv
    for _ in range(3):
        torch.autograd.grad(loss, [qkv.bias], retain_graph=True)
    assert max(len(b) for b in boxes) <= 1
    loss.backward()
    plain(batch).backward()
    assert all(len(b) == 0 for b in boxes)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_selective_blocks_on_the_meta_device():
    """The engine's plan-time trace runs the model on meta tensors: a selective step must too."""
    model = build_gpt(dict(d_model=32, n_layers=2, n_heads=2, vocab_size=50, seq_len=16), "selective", device="meta")
    loss = model(torch.randint(0, 50, (2, 17), device="meta"))
    loss.backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())


def test_checkpointing_modes_are_checked():
    model = build_gpt(dict(d_model=32, n_layers=2, n_heads=2, vocab_size=50, seq_len=16), device="meta")
    model.set_checkpointing([True, "selective"])
    assert model.checkpointing() == ["full", "selective"]
    with pytest.raises(ValueError, match="'partial' is not one of none, selective, full"):
        model.set_checkpointing(["partial", "none"])


def test_loss_starts_near_uniform():
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=257, seq_len=16))
    loss = model(torch.randint(0, 257, (4, 17)))
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.3


def test_a_hugging_face_models_loss_scores_the_pairs_the_gpts_loss_scores():
    """model.hf: seq_len tokens in, the next token scored at each position, -100 targets skipped:
    what the model's own loss gives over the whole window of seq_len+1 tokens."""
    transformers = pytest.importorskip("transformers")
    from elixir_ray.model.hf import build_hf, hf_loss

    torch.manual_seed(0)
    model = build_hf(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, vocab_size=50, max_position_embeddings=32), checkpointing=False)
    assert isinstance(model, transformers.LlamaForCausalLM) and model.training
    model.apply(model._init_weights)
    window = torch.randint(0, 50, (3, 17))
    assert hf_loss(model, window).item() == pytest.approx(model(input_ids=window, labels=window).loss.item(), abs=1e-6)
    targets = window[:, 1:].clone()
    targets[1:] = -100  # padding rows, as evaluation pads its last batch
    assert hf_loss(model, window[:, :-1], targets).item() == pytest.approx(hf_loss(model, window[:1]).item(), abs=1e-6)


def _head_problem(dtype=torch.float32):
    torch.manual_seed(0)
    h = torch.randn(3, 7, 16, dtype=dtype, requires_grad=True)
    weight = (torch.randn(41, 16, dtype=dtype) * 0.3).requires_grad_()
    targets = torch.randint(0, 41, (3, 7))
    targets[1, 2:] = -100  # padding, as evaluation pads its last batch
    return h, weight, targets


@pytest.mark.parametrize("slice_logits, autocast", [(1 << 25, False), (100, False), (100, True), (1, False)])
def test_the_sliced_loss_gives_cross_entropys_values_and_gradients(monkeypatch, slice_logits, autocast):
    """The head's logits a slice of rows at a time (one slice, several, one row each) give
    F.cross_entropy's loss and gradients on all the fp32 logits, -100 targets skipped, under CPU
    autocast too (where the matmuls run in bf16 and only the sums' order differs)."""
    from elixir_ray.model import loss as loss_module

    monkeypatch.setattr(loss_module, "SLICE_LOGITS", slice_logits)
    h, weight, targets = _head_problem()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = F.cross_entropy((h @ weight.t()).float().reshape(-1, 41), targets.reshape(-1))
    want_grads = torch.autograd.grad(2.5 * want, (h, weight))  # a factor from backward, scaling them
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = loss_module.sliced_cross_entropy(h, weight, targets, ("cpu", torch.bfloat16) if autocast else None)
    got_grads = torch.autograd.grad(2.5 * got, (h, weight))
    tol = dict(rtol=2e-2, atol=3e-3) if autocast else dict(rtol=1e-5, atol=1e-7)  # bf16: a few units in the last place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol)


def test_the_sliced_loss_is_twice_differentiable_and_refuses_a_target_outside_the_vocabulary(monkeypatch):
    """A gradient penalty through the sliced loss is F.cross_entropy's (the gradients its forward
    computed are no constants then), and a target outside the vocabulary is refused by name, as
    F.cross_entropy refuses it."""
    from elixir_ray.model import loss as loss_module

    monkeypatch.setattr(loss_module, "SLICE_LOGITS", 50)
    h, weight, targets = _head_problem(torch.float64)

    def penalty(loss_of):
        grads = torch.autograd.grad(loss_of(), (h, weight), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (h, weight))

    want = penalty(lambda: F.cross_entropy((h @ weight.t()).float().reshape(-1, 41), targets.reshape(-1)))
    got = penalty(lambda: loss_module.sliced_cross_entropy(h, weight, targets))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)
    targets[0, 0] = 41
    with pytest.raises(IndexError, match="target 41 is outside the vocabulary of 41 tokens"):
        loss_module.sliced_cross_entropy(h, weight, targets)


def test_the_gpts_loss_keeps_no_logits_for_backward_unless_a_hook_on_the_head_needs_them():
    """The GPT's loss keeps nothing of the logits' size for backward (the largest activation of a
    checkpointed step, at a 50k vocabulary), with the same loss and gradients as through the head
    module; a forward hook on the head (one that could change its output) takes that way instead."""
    def step(hooked):
        torch.manual_seed(0)
        model = GPT(GPTConfig(d_model=16, n_layers=2, n_heads=2, vocab_size=300, seq_len=8))
        if hooked:
            model.head.register_forward_hook(lambda module, args, out: None)
        saved = []

        def pack(t):
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(torch.randint(0, 300, (3, 9)))  # 24 rows: more logits than weights
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, max(saved)

    (loss, grads, largest), (plain_loss, plain_grads, plain_largest) = step(False), step(True)
    assert plain_largest >= 3 * 8 * 300 > largest  # the plain way keeps all the logits
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7)
    _assert_grads_close(grads, plain_grads, rtol=1e-5, atol=1e-7)
