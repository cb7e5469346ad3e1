"""Caches of a model sharded over ranks by tensor parallelism (mlx-lm's `model.shard()`, `mlx.launch`).

Each rank's attention holds n_kv_heads / N heads (rank r the r-th contiguous block, as
mx.nn's all-to-sharded linears split them), and its caches hold those heads: the plan
reads the per-rank count off the model (compiler/shape.py) and its shape carries
(rank, world size). Per-head work is local. The few decisions that look across a
layer's heads are made on all of them, with `mx.distributed` collectives over the
global group (every rank runs the same steps, so the calls pair up):

- Ada-KV's and NestedKV's head budgets (heads=adakv, heads=score): the heads'
  distributions are gathered, the layer's budget split over all heads as unsharded,
  and each rank takes its heads' share;
- SqueezeAttention's layer breadth (layers=squeeze): the mean over all heads;
- a ranking shared by the heads (shared_heads=true): the mean over all heads.

Saved files carry the rank and world size; a load on another is refused (persist.py).
"""

from typing import Optional, Tuple

import mlx.core as mx

from ..errors import VeloxError


def of(plan) -> Tuple[int, ...]:
    """(rank, world size) of the plan's model, () when it is not sharded."""
    shape = getattr(plan, "shape", None)
    return tuple(getattr(shape, "shard", ()) or ())


def group(shard: Tuple[int, ...]) -> Optional["mx.distributed.Group"]:
    """The distributed group a model of `shard` ((rank, world size) or ()) is sharded over (None when not
    sharded); refuses a process whose group is not the one the plan was made for."""
    if not shard:
        return None
    problem = mismatch(shard)
    if problem:
        raise VeloxError(problem)
    return mx.distributed.init()


def here() -> Tuple[int, int]:
    """This process's (rank, world size): (0, 1) without a distributed launch."""
    if not mx.distributed.is_available():
        return 0, 1
    g = mx.distributed.init()
    return g.rank(), g.size()


def mismatch(shard: Tuple[int, ...]) -> str:
    """Why caches of `shard` ((rank, world) or () for unsharded) cannot run in this process, or ''."""
    rank, world = shard if shard else (0, 1)
    r, n = here()
    if (r, n) == (rank, world) or (not shard and n > 1):
        return ""  # an unsharded model may run replicated on every rank of a group
    return f"made on rank {rank} of a model sharded over {world} ranks; this process is rank {r} of {n}" + (
        ""
        if world == n
        else " (the world size differs: run it with the same number of ranks, e.g. mlx.launch -n %d)" % world
    )


def gather_heads(shard: Tuple[int, ...], x: mx.array) -> mx.array:
    """[H_rank, ...] -> [H, ...]: every rank's heads, in head order (x itself when not sharded)."""
    g = group(shard)
    return x if g is None else mx.distributed.all_gather(x, group=g)


def my_heads(shard: Tuple[int, ...], values: list) -> list:
    """This rank's block of a per-head list over all heads."""
    if not shard:
        return values
    per = len(values) // shard[1]
    return values[shard[0] * per : (shard[0] + 1) * per]


def mean_heads(shard: Tuple[int, ...], x: mx.array, axis: int) -> mx.array:
    """The mean of x over the layer's kv heads along `axis` (keepdims), over all ranks' heads."""
    m = mx.mean(x, axis=axis, keepdims=True)
    g = group(shard)
    return m if g is None else mx.distributed.all_sum(m, group=g) / g.size()
