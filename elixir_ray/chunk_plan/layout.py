"""Packing parameters into chunks in first-use order, and choosing a chunk size with little waste."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Slot:
    """Where one parameter lives: chunk index, element offset and count."""

    index: int  # position in the packing order
    chunk: int
    offset: int
    numel: int


def pack(numels: list[int], chunk_size: int, world_size: int) -> tuple[list[Slot], list[int]]:
    """Greedy packing in the given order. Returns the slots and each chunk's padded size.

    A chunk's size is a multiple of world_size so that it splits into equal shards.
    """
    slots, sizes = [], []
    used = None
    for i, n in enumerate(numels):
        if used is None or used + n > sizes[-1]:
            sizes.append(max(chunk_size, n))
            used = 0
        slots.append(Slot(index=i, chunk=len(sizes) - 1, offset=used, numel=n))
        used += n
    sizes = [_round_up(s, world_size) for s in sizes]
    return slots, sizes


def waste(numels: list[int], chunk_size: int) -> int:
    _, sizes = pack(numels, chunk_size, 1)
    return sum(sizes) - sum(numels)


def choose_chunk_size(numels: list[int], target_chunks: int = 16, align: int = 64) -> int:
    """The candidate size with least waste, no smaller than the largest parameter.

    Candidates span [largest, 2 x largest] and around total/target_chunks, so that the model
    splits into enough chunks for a pool smaller than the model to be useful.
    """
    largest = max(numels)
    total = sum(numels)
    base = max(largest, total // max(1, target_chunks))
    candidates = sorted({_round_up(int(base * f), align) for f in (1.0, 1.125, 1.25, 1.5, 1.75, 2.0)}
                        | {_round_up(largest, align)})
    return min(candidates, key=lambda s: (waste(numels, s), s))


def chunk_size_candidates(numels: list[int], targets: tuple[int, ...] = (8, 16, 32, 64)) -> list[int]:
    """Least-waste chunk sizes for a few target chunk counts (fewer, larger chunks copy more
    efficiently; more, smaller ones let a small pool hold a useful share of the model)."""
    return sorted({choose_chunk_size(numels, target_chunks=t) for t in targets})


def chunk_events(events: list[tuple[int, ...]], phases: list[str], chunk_of_param: list[int],
                 grad_epochs: list[int] | None = None) -> tuple[list[tuple[int, ...]], int]:
    """The traced accesses in chunk ids, and the fewest blocks that can serve them safely.

    An access needs all its chunks at once; a recomputed region needs all of its chunks until its
    backward has run. A region ends, as in the engine, at any other access or when gradients
    arrive (`grad_epochs` changes). One more block keeps the access being served from evicting
    its own chunks.
    """
    epochs = grad_epochs if grad_epochs else [0] * len(events)
    out, widest, run, run_epoch = [], 1, set(), None
    for ev, phase, epoch in zip(events, phases, epochs):
        chunks = tuple(dict.fromkeys(chunk_of_param[i] for i in ev))
        out.append(chunks)
        widest = max(widest, len(chunks))
        if phase == "recompute":
            if epoch != run_epoch:
                run, run_epoch = set(), epoch
            run |= set(chunks)
            widest = max(widest, len(run))
        else:
            run, run_epoch = set(), None
    return out, widest + 1


def open_gradient_chunks(grad_order: list[int], chunk_of_param: list[int], ordered: bool = False) -> int:
    """The most chunks collecting gradients at once in one backward, as the engine's hooks do.

    A chunk's staging buffer is allocated at its first gradient and handed to its reduction
    when every parameter in it has one; with one rank, a chunk holding a parameter that gets no
    gradient (unused, or frozen: the trace cannot tell) keeps its buffer until backward ends.
    `ordered` (several ranks): a chunk waits only for the gradients the step's graph gives (those
    in the trace), and is reduced only after every chunk of a higher index, so one that completes
    early keeps its buffer until those have gone. Counted from the traced gradient
    order, since the planner must budget these buffers on the device.
    """
    return max(opened for opened, _ in gradient_buffer_moments(grad_order, chunk_of_param, ordered)[0])


def gradient_buffer_moments(grad_order: list[int], chunk_of_param: list[int],
                            ordered: bool = False) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """(chunks collecting gradients, chunks handed to their reduction so far) at each moment of a
    backward: moment 2k is after the first k traced gradients, moment 2k+1 as gradient k arrives
    (its chunk's buffer open, not yet handed on); and the moment each chunk was handed on (a
    device chunk's gradient keeps that buffer from then to the step). The gradient-buffer side of
    backward's memory over time, which the planner sets beside the activations alive then."""
    expected: dict[int, int] = {}
    with_grad = set(grad_order)
    for i, c in enumerate(chunk_of_param):
        if not ordered or i in with_grad:
            expected[c] = expected.get(c, 0) + 1
    seen: dict[int, int] = {}
    open_now: set[int] = set()
    complete: set[int] = set()
    handed = 0
    next_turn = max(chunk_of_param, default=-1)  # ordered: the next chunk to reduce, highest first
    moments = [(0, 0)]
    handed_at: dict[int, int] = {}
    for i in grad_order:
        c = chunk_of_param[i]
        open_now.add(c)
        seen[c] = seen.get(c, 0) + 1
        moments.append((len(open_now), handed))
        if seen[c] == expected[c]:
            if not ordered:
                open_now.discard(c)
                handed += 1
                handed_at[c] = len(moments)
            else:
                complete.add(c)
                while next_turn >= 0 and (next_turn in complete or next_turn not in expected):
                    # reduced now: from its buffer, or, with no traced gradient, from zeros (which
                    # become a device chunk's gradient, or cross like any host chunk's)
                    open_now.discard(next_turn)
                    handed += 1
                    handed_at[next_turn] = len(moments)
                    next_turn -= 1
        moments.append((len(open_now), handed))
    return moments, handed_at


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
