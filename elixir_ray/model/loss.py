"""The GPT's loss, computed a slice of rows at a time, so that its fp32 logits never exist whole.

`F.cross_entropy(head(h).float(), targets)` on a 50k vocabulary at micro-batch 8 and 1024 tokens
holds 412M logits: 0.8 GB in bf16, 1.6 GB more for their fp32 copy and as much for the
log-softmax kept for backward, whose gradient then takes 1.6 GB again. Those are the largest
activations of a checkpointed GPT step, and on a small GPU every byte of them is a byte of
optimizer state that must live on the host instead. Here the head's matmul runs on a slice of
rows at a time (at most SLICE_LOGITS logits), and since the loss is the last node of the graph,
each slice's gradients are computed at once from its logits: the hidden states' (rows x d, in
the compute dtype) and its share of the head weight's (vocab x d, summed in fp32). Backward only
scales them. The same three matmuls as the plain loss, and for memory one weight-sized gradient
instead of four logit-sized tensors (gpt-4b: 0.9 GB against 4 to 5 GB). The values are those of
`F.cross_entropy(logits.float(), targets)` with `logits` computed in the compute dtype (as
autocast would compute them), up to the order of fp32 sums; a double backward recomputes all the
logits through F.cross_entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# logits computed at once, at most (128 MiB in fp32): a slice takes as many rows as this allows
SLICE_LOGITS = 1 << 25
IGNORE_INDEX = -100  # F.cross_entropy's default: a target that counts for nothing (padding)


def rows_per_slice(rows: int, vocab: int) -> int:
    """Rows whose logits are computed at once: as many as SLICE_LOGITS allows, at least one."""
    return max(1, min(rows, SLICE_LOGITS // max(vocab, 1)))


class _SlicedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `h @ weight.T` against `targets` (rows with IGNORE_INDEX count for
    nothing), `h` (rows, d) and `weight` (vocab, d) cast as `amp` (autocast's device type and
    dtype, or None) casts a matmul's operands.

    The loss is the graph's last node, so its gradients are known in forward but for the factor
    backward brings (1 for `loss.backward()`): `want_grads` (grad mode was on; `needs_input_grad`
    says for which of `h` and `weight`) computes them there, slice by slice, while each slice's
    logits exist, and backward scales them. Keeps those gradients (the weight's in its own
    dtype), and `h` and `weight` for a double backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, amp, want_grads):
        hc, wc = autocast_operand(h, amp), autocast_operand(weight, amp)
        rows, vocab = hc.shape[0], wc.shape[0]
        valid = targets != IGNORE_INDEX
        target = torch.where(valid, targets, 0)
        _check_targets(target, vocab)
        count = valid.sum()
        share = valid / count  # each row's share of the mean (0 for the ignored)
        need_h, need_w = want_grads and ctx.needs_input_grad[0], want_grads and ctx.needs_input_grad[1]
        gh = torch.empty(hc.shape, dtype=hc.dtype, device=hc.device) if need_h else None
        gw = torch.zeros(wc.shape, dtype=torch.float32, device=wc.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hc.device)
        step = rows_per_slice(rows, vocab)
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            logits = torch.matmul(hc[lo:hi], wc.t()).float()
            picked = logits.gather(1, target[lo:hi, None])
            # the log-sum-exp in place, op by op: torch's logsumexp would take a temporary of the
            # logits' size that the planner's trace does not see
            top = logits.amax(dim=1, keepdim=True)
            p = logits.sub_(top).exp_()
            z = p.sum(dim=1, keepdim=True)
            total += ((top + z.log() - picked).squeeze(1) * share[lo:hi]).sum()
            if need_h or need_w:  # softmax less one at the target, times the row's share
                p.div_(z)
                p.scatter_add_(1, target[lo:hi, None], torch.full_like(picked, -1.0))
                g_logits = p.mul_(share[lo:hi, None]).to(hc.dtype)  # as autograd casts the gradient of `.float()` back
                if need_h:
                    gh[lo:hi] = torch.matmul(g_logits, wc)
                if need_w:
                    gw += torch.matmul(g_logits.t(), hc[lo:hi])
        # autograd casts each gradient to the dtype of what it is for (autocast's casts, undone)
        ctx.amp = amp
        ctx.save_for_backward(h, weight, target, valid, gh, None if gw is None else gw.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad):
        h, weight, target, valid, gh, gw = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph (a gradient penalty): gradients differentiable to the end
            return _differentiable_backward(ctx.amp, h, weight, target, valid, grad, need_h, need_w)
        return ((gh * grad.to(gh.dtype)) if need_h else None), ((gw * grad.to(gw.dtype)) if need_w else None), \
            None, None, None


def _differentiable_backward(amp, h, weight, target, valid, grad, need_h, need_w):
    """The gradients with their own graph (`create_graph=True`), from all the logits at once
    through F.cross_entropy: the gradients computed in forward are constants to autograd, which
    a second derivative must not take them for. Memory as without slicing; only a gradient penalty pays it."""
    wanted = [t for t, need in ((h, need_h), (weight, need_w)) if need]
    logits = torch.matmul(autocast_operand(h, amp), autocast_operand(weight, amp).t()).float()
    loss = F.cross_entropy(logits, torch.where(valid, target, IGNORE_INDEX), ignore_index=IGNORE_INDEX)
    found = iter(torch.autograd.grad(loss, wanted, grad, create_graph=True))
    return (next(found) if need_h else None), (next(found) if need_w else None), None, None, None


def _check_targets(target: torch.Tensor, vocab: int) -> None:
    """Refuse a target outside [0, vocab) (other than IGNORE_INDEX), which no slice would pick: on
    the CPU at once, on a GPU by a device-side assert as F.cross_entropy's (no sync, so the host
    keeps running ahead of the device)."""
    kind = target.device.type
    if kind == "meta":
        return
    ok = ((target >= 0) & (target < vocab)).all()
    if kind == "cpu":
        if not bool(ok):
            bad = target[(target < 0) | (target >= vocab)][0].item()
            raise IndexError(f"target {bad} is outside the vocabulary of {vocab} tokens "
                             f"(and not the ignored index {IGNORE_INDEX})")
    else:
        torch._assert_async(ok, f"a target is outside the vocabulary of {vocab} tokens")


def autocast_operand(t: torch.Tensor, amp) -> torch.Tensor:
    """What autocast (`amp`: its device type and dtype, or None) does to a matmul's operand:
    floating tensors other than float64 go to its dtype."""
    if amp is None or t.dtype == amp[1] or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(amp[1])


def sliced_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, amp=None) -> torch.Tensor:
    """Mean cross-entropy of the logits `h @ weight.T` (h: (..., d), weight: (vocab, d), targets:
    h's leading shape, IGNORE_INDEX for rows that count for nothing), a slice of rows at a time."""
    # grad mode as the caller had it (forward runs without it); which input needs a gradient, forward reads itself
    return _SlicedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), amp,
                                     torch.is_grad_enabled())


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same loss from all the logits at once (the head module's output, or a Hugging Face
    model's), through F.cross_entropy in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
