"""Comm over real gloo groups: a collective returns only when gloo has let go of its tensors.

Otherwise a gloo thread can be the last owner of a temporary's Python object and free it while
the interpreter exits, which aborts the rank (see elixir_ray/engine/comm.py).
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from elixir_ray.engine.comm import Comm

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import spawn_ranks, store_url  # noqa: E402

ROUNDS = 200


def _rank_main(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    __import__("torch._dynamo")  # as a traced forward does: from here on torch holds the group to the end
    comm = Comm(dist.group.WORLD, torch.device("cpu"))
    still_held, sums = 0, []
    for i in range(ROUNDS):
        shard = torch.full((8,), float(rank + i))
        gathered = torch.empty(8 * world)
        comm.all_gather(gathered, shard)
        still_held += shard._use_count() > 1 or gathered._use_count() > 1
        full = torch.arange(8 * world, dtype=torch.float32) + rank
        mean = torch.empty(8)
        comm.reduce_scatter_mean(mean, full)
        still_held += full._use_count() > 1 or mean._use_count() > 1
        one = torch.tensor([float(rank)])
        comm.all_reduce_mean(one)
        still_held += one._use_count() > 1
        sums.append((gathered.sum().item(), mean.sum().item(), one.item()))
    text = comm.broadcast_text("plan" if rank == 0 else None)
    torch.save({"still_held": still_held, "sums": sums, "text": text}, f"{out}.{rank}")
    dist.destroy_process_group()  # and exit at once, right after the last collective


@pytest.mark.slow
def test_gloo_collectives_return_after_gloo_lets_go_of_their_tensors(tmp_path):
    out = str(tmp_path / "rank")
    spawn_ranks(_rank_main, (2, store_url(tmp_path), out), 2)
    for rank in range(2):
        result = torch.load(f"{out}.{rank}")
        # without the wait, a few of every hundred calls returned with gloo still holding a tensor
        assert result["still_held"] == 0
        for i, (gathered, mean, one) in enumerate(result["sums"]):
            assert gathered == 8 * (2 * i + 1)  # rank 0's shard of i, rank 1's of i + 1
            assert mean == sum(range(8 * rank, 8 * rank + 8)) + 8 * 0.5  # this rank's part of the ranks' mean
            assert one == 0.5
        assert result["text"] == "plan"
