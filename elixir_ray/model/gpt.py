"""A GPT-2 family decoder: tied embeddings, pre-LayerNorm blocks, `scaled_dot_product_attention`.

`GPT.forward(batch)` takes token windows of length seq_len + 1 and returns the mean next-token
loss, so that a training step is `loss = model(batch); loss.backward()` whatever wraps the model.
Build it under `torch.device("meta")` to get the shape of a huge model without memory;
`init_gpt_weights` then initialises any submodule on its own (the engine materialises chunk by chunk).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _module_hooks  # its every-module hook registries
from torch.utils.checkpoint import checkpoint

from elixir_ray.model.loss import autocast_operand as _cast
from elixir_ray.model.loss import logits_cross_entropy, sliced_cross_entropy

# per block, what backward recomputes instead of keeping: nothing; the norms and the GELU (whose
# outputs are 6 of the 16 hidden-size units a block saves per token, for a few memory-bound
# kernels); or the whole block (its forward again, matmuls included: a third more compute)
CHECKPOINT_MODES = ("none", "selective", "full")

_GELU = "tanh"  # the MLP's GELU approximation (a selective block's backward recomputes the same)


def checkpoint_mode(value) -> str:
    """A block's mode from a mask entry: True is "full", False "none", or one of CHECKPOINT_MODES."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in CHECKPOINT_MODES:
        raise ValueError(f"activation checkpointing mode {value!r} is not one of {', '.join(CHECKPOINT_MODES)} "
                         f"(or True / False)")
    return value


@dataclass
class GPTConfig:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 257
    seq_len: int = 128
    dropout: float = 0.0
    activation_checkpointing: bool | str = False  # every block's mode: False/"none", "selective", True/"full"
    # the loss takes the head's logits a slice of rows at a time (model/loss.py); False: all at
    # once through F.cross_entropy, as the bench results that do not record `sliced_loss` ran
    # (jobs/bench_repredict.py traces those so)
    sliced_loss: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.is_residual_projection = True
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(self.qkv(x))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Attention and the output projection, from the query-key-value projection."""
        b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(d, dim=2)
        q, k, v = (y.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.down.is_residual_projection = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.project(self.up(x)))

    def project(self, u: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(u, approximate=_GELU))


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_of(t: torch.Tensor):
    """(device type, dtype) of the autocast on for `t`'s device, or None (also on devices without
    autocast, such as meta). Reads nothing of `t` while no autocast is on anywhere: in the engine's
    forward a torch-function mode handles every tensor attribute read."""
    if _any_autocast is not None and not _any_autocast():
        return None
    device_type = t.device.type
    try:
        return (device_type, torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else None
    except RuntimeError:
        return None


# A selective block's pieces: autograd Functions that keep for backward only what the matmuls take
# (and the parameters, views that cost no memory). Each norm (or the GELU) is a `_Norm` (`_Gelu`)
# that keeps its input and recomputes its output in backward, and the matmul after it a `_Linear`
# that keeps only its weight; the weight's gradient needs that recomputed output, so the `_Linear`'s
# backward leaves its output's gradient in a one-slot list (`box`) shared with the Function before it, which
# runs next and computes it there (the weight is an input of both: autograd sums their gradients).
# Split so, each backward unpacks the parameters of one layer, as autograd's own nodes do: the
# engine fetches an evicted parameter as it is unpacked and, while recomputed chunks are pinned,
# may evict one unpacked earlier, so one node that unpacked a norm's and a matmul's weights from
# two chunks could read freed memory. The modules are called in forward as without checkpointing
# (their pre-hooks fire in the same order; a layer with hooks that could change its result takes
# the checkpointed pieces instead, `_hooks_may_change`); `amp` is the autocast the forward ran under, or
# None. Gradients go back in the dtype of what they are for: autograd casts those of another dtype
# (the matmul's, under autocast), as it would through autocast's casts.


class _Linear(torch.autograd.Function):
    """`linear(h)`, keeping only the weight; gives the gradients of `h` and of the bias."""

    @staticmethod
    def forward(ctx, h, linear, weight, bias, box):
        y = linear(h)  # the module itself, so that its forward hooks fire as without this
        ctx.box, ctx.amp = box, _autocast_of(h)
        ctx.save_for_backward(weight)
        return y

    @staticmethod
    def backward(ctx, gy):
        weight, = ctx.saved_tensors
        need_h, _, need_w, need_b, _ = ctx.needs_input_grad
        if need_w:
            ctx.box[:] = [gy]  # one slot: a partial backward that never reaches the Function before leaves no pile
        gh = gb = None
        if need_h:
            gh = torch.matmul(gy, _cast(weight, ctx.amp))
        if need_b:
            gb = gy.reshape(-1, gy.shape[-1]).sum(0)
        return gh, None, None, gb, None


def _refuse_double_backward() -> None:
    """Under autocast a selective block's backward differentiates its recomputed norm or GELU on
    detached inputs, which a double backward (create_graph=True: a gradient penalty) would get wrong
    without a word."""
    if torch.is_grad_enabled():
        raise RuntimeError("a double backward (create_graph=True) through a selectively checkpointed GPT block "
                           "under autocast is not supported: use activation checkpointing \"none\" or \"full\" for "
                           "that model, or train without autocast (the engine's dtype= needs none)")


def _weight_grad(box: list, h: torch.Tensor, amp) -> torch.Tensor:
    """The gradient of the weight of the `_Linear` that took `h`, from its output's gradient,
    which its backward left in `box`."""
    gy = box.pop()
    h = _cast(h, amp)
    return gy.reshape(-1, gy.shape[-1]).t().mm(h.reshape(-1, h.shape[-1]))


class _Norm(torch.autograd.Function):
    """`norm(x)` (a LayerNorm) feeding a `_Linear` whose weight is `weight`: keeps `x` and the norm's
    parameters, and gives the gradients of those and of `weight`. Without autocast its backward
    calls the norm's kernels itself, not autograd."""

    @staticmethod
    def forward(ctx, x, norm, norm_weight, norm_bias, weight, box):
        h = norm(x)  # the module itself, so that its forward hooks fire as without this
        ctx.box, ctx.shape, ctx.eps, ctx.amp = box, norm.normalized_shape, norm.eps, _autocast_of(x)
        ctx.save_for_backward(x, norm_weight, norm_bias)
        return h

    @staticmethod
    def backward(ctx, gh):
        x, nw, nb = ctx.saved_tensors
        need = ctx.needs_input_grad
        amp = ctx.amp
        if amp is None:
            h, mean, rstd = torch.native_layer_norm(x, ctx.shape, nw, nb, ctx.eps)
            gw = _weight_grad(ctx.box, h, None) if need[4] else None
            gx, gnw, gnb = torch.ops.aten.native_layer_norm_backward(
                gh, x, ctx.shape, mean, rstd, nw, nb, [need[0], need[2], need[3]])
            return gx, None, gnw, gnb, gw, None
        # under autocast: the norm again with the forward's autocast state, differentiated by
        # autograd (through the casts autocast put around it)
        _refuse_double_backward()
        inputs = [None if t is None else t.detach().requires_grad_(need[i]) for i, t in ((0, x), (2, nw), (3, nb))]
        with torch.enable_grad(), torch.autocast(amp[0], dtype=amp[1]):
            h = F.layer_norm(inputs[0], ctx.shape, inputs[1], inputs[2], ctx.eps)
        gw = _weight_grad(ctx.box, h.detach(), amp) if need[4] else None
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        found = iter(torch.autograd.grad(h, wanted, gh) if wanted else ())
        gx, gnw, gnb = (next(found) if t is not None and t.requires_grad else None for t in inputs)
        return gx, None, gnw, gnb, gw, None


class _Gelu(torch.autograd.Function):
    """The MLP's GELU of `u` feeding a `_Linear` whose weight is `weight`: keeps `u`, and gives
    the gradients of `u` and of `weight`."""

    @staticmethod
    def forward(ctx, u, weight, box):
        ctx.box, ctx.amp = box, _autocast_of(u)
        ctx.save_for_backward(u)
        return F.gelu(u, approximate=_GELU)

    @staticmethod
    def backward(ctx, ga):
        u, = ctx.saved_tensors
        need_u, need_w, _ = ctx.needs_input_grad
        amp = ctx.amp
        if amp is None:
            a = F.gelu(u, approximate=_GELU)
            gw = _weight_grad(ctx.box, a, None) if need_w else None
            gu = torch.ops.aten.gelu_backward(ga, u, approximate=_GELU) if need_u else None
            return gu, gw, None
        _refuse_double_backward()
        with torch.enable_grad(), torch.autocast(amp[0], dtype=amp[1]):
            leaf = u.detach().requires_grad_(need_u)
            a = F.gelu(leaf, approximate=_GELU)
        gw = _weight_grad(ctx.box, a.detach(), amp) if need_w else None
        gu = torch.autograd.grad(a, leaf, ga)[0] if need_u else None
        return gu, gw, None


def _then(first: nn.Module, second: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return second(first(x))


_PIECE = dict(use_reentrant=False, preserve_rng_state=False)  # the checkpointed pieces, where hooks need them

# A forward pre-hook marked so promises to return nothing and change nothing the layer computes
# (the engine's, which fetch parameters): the selective Functions may run its layer without autograd.
KEEPS_RESULT = "keeps_layer_result"


def _may_change(forward_hooks, backward_hooks, backward_pre_hooks, forward_pre_hooks) -> bool:
    return bool(forward_hooks or backward_hooks or backward_pre_hooks) or any(
        not getattr(h, KEEPS_RESULT, False) for h in forward_pre_hooks.values())


def _hooks_may_change(layers) -> bool:
    """Whether a hook could change what one of `layers` computes or needs its autograd: forward or
    backward hooks on it or on every module, or a forward pre-hook not marked `KEEPS_RESULT`."""
    g = _module_hooks
    if _may_change(g._global_forward_hooks, g._global_backward_hooks, g._global_backward_pre_hooks,
                   g._global_forward_pre_hooks):
        return True
    return any(_may_change(m._forward_hooks, m._backward_hooks, m._backward_pre_hooks, m._forward_pre_hooks)
               for m in layers)


def _autocast_states(device_type: str) -> list:
    """[(device type, on, dtype)] of autocast now, for `device_type` and the CPU: what a whole
    block's recomputation in backward must run under to compute what its forward did, off
    included (a backward called inside an autocast must not recompute under it)."""
    states = []
    for kind in dict.fromkeys((device_type, "cpu")):
        try:
            states.append((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)))
        except RuntimeError:  # a device type without autocast (meta)
            pass
    return states


def _pre_hooks_only(module: nn.Module, args: tuple) -> None:
    """Run the forward pre-hooks that calling `module` would run, without its forward: where the
    recomputation skips a module whose output backward does not need, the hooks that read (the
    engine's fetch of its chunk) see it as without. Only for hooks marked `KEEPS_RESULT`, which
    return nothing and change nothing (`Block.whole_recompute_parameters` checks)."""
    for hook in _module_hooks._global_forward_pre_hooks.values():
        hook(module, args)
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, args, {})
        else:
            hook(module, args)


def _module_tree(module: nn.Module) -> list[nn.Module]:
    """`module` and every module under it (what `modules()` gives, without its bookkeeping)."""
    out = [module]
    for child in module._modules.values():
        if child is not None:
            out += _module_tree(child)
    return out


# methods `_WholeBlock` relies on the classes' own versions of: one set on an instance computes otherwise
_REPLACEABLE = frozenset(("forward", "attend", "project", "up_to_down_projection"))


@contextlib.contextmanager
def _parameters_of_forward(block: "Block", params: tuple):
    """The block holding the parameters its forward ran with, for its recomputation: the same
    ones but where they were swapped since (`torch.func.functional_call` given `nn.Parameter`s,
    whose backward comes after it has put the block's own back)."""
    tables = block.parameter_tables()
    if all(table[key] is p for (table, key), p in zip(tables, params)):
        yield
        return
    before = [table[key] for table, key in tables]
    for (table, key), p in zip(tables, params):
        table[key] = p
    try:
        yield
    finally:
        for (table, key), p in zip(tables, before):
            table[key] = p


class _WholeBlock(torch.autograd.Function):
    """A block recomputed whole: its forward without autograd, keeping only its input; in backward
    the block again with autograd, up to the MLP's down projection, differentiated by
    `torch.autograd.grad`, the down projection's gradients computed directly.

    The same results and gradients as `torch.utils.checkpoint(block, x, use_reentrant=False)`, for
    less host time: that checkpoint runs Python for each tensor the block saves, in forward and
    again in backward (on the development VM 48 such blocks took 23.5 ms of forward against 15 ms
    this way, and 50 ms of backward against 40). Like its early stop, the recomputation leaves out
    the down projection (a third of a block's matmul work), whose output backward never needs.
    Unlike torch's reentrant checkpoint, which is as cheap, the block's parameters are inputs of
    the Function, so that their gradients come back through it: `torch.autograd.grad` through the
    block works, and so does a block whose input needs no gradient (frozen embeddings). With
    create_graph (a gradient penalty) the recomputation runs on the saved input itself, so that
    the gradients it returns are differentiable back to it. Blocks with dropout or with hooks that
    could change a layer's result take torch's checkpoint instead (`Block.whole_recompute_parameters`).

    The price: a block's parameter gradients come back together, and go into .grad in the order of
    autograd's ready queue rather than layer by layer, so the chunks a block spans may collect
    gradients at once. The planner traces the model through this same code, so it budgets what
    happens (for gpt-1.5b's and gpt-4b's H100 plans the predicted peaks did not change). Accumulating
    them into .grad inside this backward instead would keep the layer order, but autograd then
    runs the parameters' post-accumulate hooks a second time, with no gradient.
    """

    @staticmethod
    def forward(ctx, x, block, *params):
        ctx.block, ctx.params, ctx.amp = block, params, _autocast_states(x.device.type)
        ctx.save_for_backward(x)
        return block(x)

    @staticmethod
    def backward(ctx, gy):
        x, = ctx.saved_tensors
        need = ctx.needs_input_grad[:1] + ctx.needs_input_grad[2:]  # x, then the parameters (the block takes none)
        block = ctx.block
        higher = torch.is_grad_enabled()  # create_graph: the gradients must lead back to x and the parameters
        inp = x if higher and need[0] else x.detach().requires_grad_(need[0])
        params = ctx.params
        down = block.mlp.down
        with torch.enable_grad(), contextlib.ExitStack() as autocasts, _parameters_of_forward(block, params):
            for kind, on, dtype in ctx.amp:
                if torch.is_autocast_enabled(kind) != on or (on and torch.get_autocast_dtype(kind) != dtype):
                    autocasts.enter_context(torch.autocast(kind, dtype=dtype, enabled=on))
            _pre_hooks_only(block, (inp,))
            x1, a = block.up_to_down_projection(inp)
            _pre_hooks_only(down, (a,))
            # what the down projection's forward would have saved: its operands as its autocast cast them
            amp = _autocast_of(a)
            weight, a_saved = _cast(down.weight, amp), _cast(a, amp)
        # its backward, as autograd's linear runs it: under the autocast (or none) that backward
        # runs in, like every other backward kernel (autograd casts the weight's gradient back to
        # the weight's dtype)
        gy_low = gy.to(weight.dtype)
        ga = torch.matmul(gy_low, weight) if a.requires_grad else None
        flat = gy_low.reshape(-1, gy.shape[-1])
        gw = flat.t().mm(a_saved.reshape(-1, a.shape[-1])) if need[11] else None
        gb = flat.sum(0) if need[12] and down.bias is not None else None
        grads = [None] * (len(params) + 1)
        grads[11], grads[12] = gw, gb
        wanted = [(i, t) for i, t in enumerate((inp, *params[:10])) if need[i] and t.requires_grad]
        outputs = [(o, g) for o, g in ((a, ga), (x1, gy)) if o.requires_grad and g is not None]
        if wanted and outputs:
            found = torch.autograd.grad([o for o, _ in outputs], [t for _, t in wanted], [g for _, g in outputs],
                                        allow_unused=True, create_graph=higher)
            for (i, _), g in zip(wanted, found):
                grads[i] = g
        return (grads[0], None, *grads[1:])


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def up_to_down_projection(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's forward up to the MLP's down projection: the residual stream after
        attention, and the GELU's output (what the down projection takes). Calls the modules as
        the block's forward does, the MLP's pre-hooks run by hand (`_WholeBlock` only; its
        dropout, which holds no parameter and is off there, is not called)."""
        x1 = x + self.attn(self.ln1(x))
        h = self.ln2(x1)
        _pre_hooks_only(self.mlp, (h,))
        return x1, F.gelu(self.mlp.up(h), approximate=_GELU)

    def parameter_tables(self) -> list[tuple[dict, str]]:
        """Where the twelve parameters of a block as `Block` builds it live, (a layer's own
        parameter table, name), in the order `_WholeBlock` takes them (KeyError where a layer was
        replaced by a module without them). Read from the modules' own tables:
        `nn.Module.__getattr__` for each would take a tenth of a small block's forward."""
        layers, attn, mlp = self._modules, self._modules["attn"]._modules, self._modules["mlp"]._modules
        out = []
        for layer in (layers["ln1"], attn["qkv"], attn["proj"], layers["ln2"], mlp["up"], mlp["down"]):
            out += ((layer._parameters, "weight"), (layer._parameters, "bias"))
        return out

    def own_parameters(self) -> list:
        """The twelve parameters, as `parameter_tables` places them."""
        return [table[key] for table, key in self.parameter_tables()]

    def whole_recompute_parameters(self) -> Optional[list[torch.Tensor]]:
        """The block's parameters in the order `_WholeBlock` takes them, or None where it would not
        compute what torch's checkpoint does. `_WholeBlock` recomputes this class's forward, layer
        by layer, so the block must be one as built here: these classes exactly (a subclass may
        compute otherwise), no method replaced on an instance or patched on a class, no dropout (whose random state it
        does not replay), twelve distinct `nn.Parameter`s and no other (not a parameter tied to
        another of the same block, whose gradient it would count twice; not tensors swapped in by
        `torch.func.functional_call`, which its backward would not see), and no hook that could
        change a layer's result or need its autograd (its forward runs without autograd).
        Checked at each forward by walking the block's own tables: a tenth of what
        `nn.Module.modules()` and `parameters()` cost, which took most of a small block's forward
        (development VM)."""
        try:
            modules = self._modules
            attn, mlp = modules["attn"], modules["mlp"]
            inner, outer = attn._modules, mlp._modules
            layers = ((self, Block), (modules["ln1"], nn.LayerNorm), (modules["ln2"], nn.LayerNorm),
                      (attn, CausalSelfAttention), (inner["qkv"], nn.Linear), (inner["proj"], nn.Linear), (mlp, MLP),
                      (outer["up"], nn.Linear), (outer["down"], nn.Linear), (outer["drop"], nn.Dropout))
            own = self.own_parameters()
        except (AttributeError, KeyError):  # a layer replaced by a module without them
            return None
        for module, cls in layers:
            if type(module) is not cls or not _REPLACEABLE.isdisjoint(vars(module)):
                return None
        if any(getattr(cls, name) is not method for cls, name, method in _METHODS):
            return None
        if attn.dropout > 0 or mlp.drop.p > 0:
            return None
        tree = _module_tree(self)
        if _hooks_may_change(tree):
            return None
        present = [p for m in tree for p in m._parameters.values() if p is not None]
        ids = {id(p) for p in own}
        if len(ids) != len(own) or len(present) != len(own) or {id(p) for p in present} != ids \
                or not all(isinstance(p, nn.Parameter) for p in own):
            return None
        return own

    def forward(self, x: torch.Tensor, selective: bool = False) -> torch.Tensor:
        """`selective`: keep for backward only what the matmuls and attention take and make, and
        recompute each norm's and the GELU's output there (the same result and gradients).

        Each of ln1, ln2 and the GELU is an autograd Function (`_Norm`, `_Gelu`) that keeps only
        its input, and the matmul after it a `_Linear` that keeps only its weight: backward
        recomputes the norm's or the GELU's output, never a matmul, whatever torch's checkpoint
        settings. The layers are called in the same order as without, inside the Functions, where
        autograd is off: so where a layer has a hook that could change its result or needs its
        autograd (a forward or backward hook, on it or on every module, or a forward pre-hook not
        marked `KEEPS_RESULT`, as the engine's are), the block runs its three pieces through
        `torch.utils.checkpoint` instead (the same results, more host time; torch's early stop keeps
        the matmuls from rerunning). Hooks on the modules `attn` and `mlp` (not on their layers) do
        not fire in this mode.
        """
        if not (selective and torch.is_grad_enabled()):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        ln1, qkv, ln2, up, down = self.ln1, self.attn.qkv, self.ln2, self.mlp.up, self.mlp.down
        if _hooks_may_change((ln1, qkv, ln2, up, down)):
            # inside the Functions the layers run without autograd: what a hook adds (an adapter) would
            # get no gradient and backward hooks would not fire; checkpoints keep both, at a host cost
            x = x + self.attn.attend(checkpoint(_then, ln1, qkv, x, **_PIECE))
            u = checkpoint(_then, ln2, up, x, **_PIECE)
            return x + self.mlp.drop(checkpoint(self.mlp.project, u, **_PIECE))
        box = []  # each _Linear's output gradient, for the weight gradient of the Function before it
        h = _Norm.apply(x, ln1, ln1.weight, ln1.bias, qkv.weight, box)
        x = x + self.attn.attend(_Linear.apply(h, qkv, qkv.weight, qkv.bias, box))
        box = []
        h = _Norm.apply(x, ln2, ln2.weight, ln2.bias, up.weight, box)
        u = _Linear.apply(h, up, up.weight, up.bias, box)
        box = []
        a = _Gelu.apply(u, down.weight, box)
        return x + self.mlp.drop(_Linear.apply(a, down, down.weight, down.bias, box))


# the methods `_WholeBlock`'s recomputation stands for, as defined: one patched on its class (a
# library's monkeypatch of nn.Linear.forward) would compute otherwise
_METHODS = tuple((cls, name, getattr(cls, name)) for cls, names in (
    (Block, ("forward", "up_to_down_projection")), (CausalSelfAttention, ("forward", "attend")),
    (MLP, ("forward", "project")), (nn.Linear, ("forward",)), (nn.LayerNorm, ("forward",)),
    (nn.Dropout, ("forward",))) for name in names)


def _embedding(num: int, dim: int) -> nn.Embedding:
    """An nn.Embedding [num, dim]. On the meta device it skips the embedding's own init, which
    `init_gpt_weights` replaces anyway: `normal_` on meta runs torch's Python reference, whose first
    call imports torch._dynamo, about 2 s of CPU before the checks `elixir-ray train` makes ahead of
    starting Ray (its refusals of a bad config come that much sooner)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = _embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = _embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings
        self._checkpointing = [checkpoint_mode(cfg.activation_checkpointing)] * cfg.n_layers
        if self.wte.weight.device.type != "meta":
            self.apply(lambda m: init_gpt_weights(m, cfg.n_layers))

    checkpointing_modes = CHECKPOINT_MODES  # what set_checkpointing takes per block (the planner reads it)

    def checkpointing(self) -> list[str]:
        """Per block, what backward recomputes instead of keeping: "none", "selective" (the layer
        norms and the GELU; matmul and attention inputs and outputs are kept) or "full" (the whole block)."""
        return list(self._checkpointing)

    def set_checkpointing(self, mask: list) -> None:
        """Per block a mode of `checkpointing_modes`, or True ("full") / False ("none")."""
        if len(mask) != len(self.blocks):
            raise ValueError(f"checkpointing mask has {len(mask)} entries, the model has {len(self.blocks)} blocks")
        self._checkpointing = [checkpoint_mode(x) for x in mask]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(idx))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final layer norm's output: what the head turns into logits."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        training = self.training and torch.is_grad_enabled()
        for block, mode in zip(self.blocks, self._checkpointing):
            if mode == "full" and training:
                params = block.whole_recompute_parameters()
                if params is not None:
                    x = _WholeBlock.apply(x, block, *params)
                else:
                    x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, selective=mode == "selective" and training)
        return self.ln_f(x)

    def forward(self, batch: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy (targets of -100 count for nothing). `batch` holds seq_len+1 tokens
        per row unless `targets` is given.

        The head's logits are computed a slice of rows at a time (`loss.sliced_cross_entropy`),
        never whole, where `slices_loss()` says so; the head's forward pre-hooks run as calling
        it would run them. Otherwise, through the head module and F.cross_entropy on all the fp32
        logits at once (the same values, more memory)."""
        if targets is None:
            batch, targets = batch[:, :-1], batch[:, 1:]
        h = self.hidden(batch)
        head = self.head
        if not self.slices_loss():
            return logits_cross_entropy(head(h), targets)
        _pre_hooks_only(head, (h,))
        return sliced_cross_entropy(h, head.weight, targets, _autocast_of(h))

    def slices_loss(self) -> bool:
        """Whether the loss takes the logits a slice of rows at a time: with `cfg.sliced_loss`,
        where the head is a plain bias-free linear layer with no hook that could change its result
        (the engine's fetching pre-hooks do not; DeepSpeed's, and a user's, may)."""
        head = self.head
        return (self.cfg.sliced_loss and type(head) is nn.Linear and head.bias is None
                and not _hooks_may_change((head,)))


def init_gpt_weights(module: nn.Module, n_layers: int) -> None:
    """GPT-2 initialisation for one module; residual projections are scaled down by depth."""
    if isinstance(module, nn.Linear):
        std = 0.02
        if getattr(module, "is_residual_projection", False):
            std = 0.02 / math.sqrt(2 * n_layers)
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def build_gpt(shape: dict, activation_checkpointing: bool | str = False, dropout: float = 0.0,
              device: str | torch.device | None = None, sliced_loss: bool = True) -> GPT:
    cfg = GPTConfig(
        d_model=shape["d_model"], n_layers=shape["n_layers"], n_heads=shape["n_heads"],
        vocab_size=shape["vocab_size"], seq_len=shape["seq_len"], dropout=dropout,
        activation_checkpointing=activation_checkpointing, sliced_loss=sliced_loss,
    )
    if device is None:
        return GPT(cfg)
    with torch.device(device):
        return GPT(cfg)
