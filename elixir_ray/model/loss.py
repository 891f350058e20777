"""The GPT's loss, computed a slice of the vocabulary at a time, so that its fp32 logits never exist whole.

`F.cross_entropy(head(h).float(), targets)` on a 50k vocabulary at micro-batch 8 and 1024 tokens
holds 412M logits: 0.8 GB in bf16, 1.6 GB more for their fp32 copy and as much for the
log-softmax kept for backward, whose gradient then takes 1.6 GB again. Those are the largest
activations of a checkpointed GPT step, and on a small GPU every byte of them is a byte of
optimizer state that must live on the host instead. Here the head's matmul runs on a slice of the
vocabulary at a time, and forward keeps only each row's log-sum-exp (4 bytes per row) and
target logit; backward computes each slice's logits again (one more matmul of the head's size,
about one per cent of a GPT step's compute) and turns them into the slice's share of the
gradients. The values are those of `F.cross_entropy(logits.float(), targets)` with `logits`
computed in the compute dtype (as autocast would compute them), up to the order of fp32 sums.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# logits computed at once, at most (128 MiB in fp32): a slice of the vocabulary this many over the rows
SLICE_LOGITS = 1 << 25
IGNORE_INDEX = -100  # F.cross_entropy's default: a target that counts for nothing (padding)


def vocab_slice(rows: int, vocab: int) -> int:
    """Columns of the vocabulary per slice for `rows` rows: as many as SLICE_LOGITS allows, at least one."""
    return max(1, min(vocab, SLICE_LOGITS // max(rows, 1)))


class _SlicedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `h @ weight.T` against `targets` (rows with IGNORE_INDEX count for
    nothing), `h` (rows, d) and `weight` (vocab, d) cast as `amp` (autocast's device type and
    dtype, or None) casts a matmul's operands. Keeps `h`, `weight`, and per row its log-sum-exp;
    gives the gradients of `h` and `weight`."""

    @staticmethod
    def forward(ctx, h, weight, targets, amp):
        hc, wc = autocast_operand(h, amp), autocast_operand(weight, amp)
        rows, vocab = hc.shape[0], wc.shape[0]
        width = vocab_slice(rows, vocab)
        valid = targets != IGNORE_INDEX
        target = torch.where(valid, targets, 0)
        lse = torch.full((rows,), float("-inf"), dtype=torch.float32, device=hc.device)
        picked = torch.zeros(rows, dtype=torch.float32, device=hc.device)
        for start in range(0, vocab, width):
            logits = torch.matmul(hc, wc[start:start + width].t()).float()
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
            inside, column = _inside(target, start, logits.shape[1])
            picked += torch.where(inside, logits.gather(1, column[:, None]).squeeze(1), 0.0)
        count = valid.sum()
        loss = torch.where(valid, lse - picked, 0.0).sum() / count
        _check_targets(target, vocab)
        ctx.amp, ctx.width = amp, width
        ctx.save_for_backward(h, weight, target, valid, lse, count)
        return loss

    @staticmethod
    def backward(ctx, grad):
        h, weight, target, valid, lse, count = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph (a gradient penalty): gradients differentiable to the end
            return _differentiable_backward(ctx.amp, h, weight, target, valid, grad, need_h, need_w)
        hc, wc = autocast_operand(h, ctx.amp), autocast_operand(weight, ctx.amp)
        vocab, width = wc.shape[0], ctx.width
        scale = torch.where(valid, grad.float() / count, 0.0)[:, None]  # each row's share of the loss
        gh = torch.zeros(hc.shape, dtype=torch.float32, device=hc.device) if need_h else None
        gw = torch.empty(wc.shape, dtype=wc.dtype, device=wc.device) if need_w else None
        for start in range(0, vocab, width):
            w = wc[start:start + width]
            logits = torch.matmul(hc, w.t()).float()
            p = torch.exp(logits - lse[:, None])  # softmax
            inside, column = _inside(target, start, logits.shape[1])
            p.scatter_add_(1, column[:, None], -inside.to(p.dtype)[:, None])  # less one at the target
            g_logits = (p * scale).to(hc.dtype)  # as autograd casts the gradient of `.float()` back
            if need_h:
                gh += torch.matmul(g_logits, w)
            if need_w:
                gw[start:start + width] = torch.matmul(g_logits.t(), hc)
        # autograd casts each to the dtype of what it is for (autocast's casts, undone)
        return (gh.to(hc.dtype) if need_h else None), gw, None, None


def _differentiable_backward(amp, h, weight, target, valid, grad, need_h, need_w):
    """The gradients with their own graph (`create_graph=True`), from all the logits at once
    through F.cross_entropy: the slices' backward treats each row's log-sum-exp as a constant,
    which a second derivative must not. Memory as without slicing; only a gradient penalty pays it."""
    wanted = [t for t, need in ((h, need_h), (weight, need_w)) if need]
    logits = torch.matmul(autocast_operand(h, amp), autocast_operand(weight, amp).t()).float()
    loss = F.cross_entropy(logits, torch.where(valid, target, IGNORE_INDEX), ignore_index=IGNORE_INDEX)
    found = iter(torch.autograd.grad(loss, wanted, grad, create_graph=True))
    return (next(found) if need_h else None), (next(found) if need_w else None), None, None


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


def _inside(target: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows' targets fall in the slice of columns [start, start + width), and their column
    there (0 for the others, masked out)."""
    inside = (target >= start) & (target < start + width)
    return inside, torch.where(inside, target - start, 0)


def autocast_operand(t: torch.Tensor, amp) -> torch.Tensor:
    """What autocast (`amp`: its device type and dtype, or None) does to a matmul's operand:
    floating tensors other than float64 go to its dtype."""
    if amp is None or t.dtype == amp[1] or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(amp[1])


def sliced_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, amp=None) -> torch.Tensor:
    """Mean cross-entropy of the logits `h @ weight.T` (h: (..., d), weight: (vocab, d), targets:
    h's leading shape, IGNORE_INDEX for rows that count for nothing), a vocabulary slice at a time."""
    return _SlicedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), amp)


def plain_cross_entropy(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same loss through the head module and F.cross_entropy on fp32 logits (all of them at once)."""
    logits = head(h)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
