"""Which DTensor placements keep quantization groups whole, and where each rank's part of a tensor lies.

A parameter of two or more dims keeps its quantized moments as ``(rows, cols)`` with groups of 32
consecutive values of one row (flashdist.quant.codes), decided from the GLOBAL shape. A rank computes on its
local tensor viewed as ``(local_rows, local_cols)``, counting groups from the start of its local row. That
is exactly the global step when every piece of a row the rank holds starts on a group boundary and ends on
one or at the row's end: the local groups are then global groups, the same values in the same order.

- Sharding dim 0 (FSDP2's ``Shard(0)``, ``ColwiseParallel``, experts of a 3-D parameter, ``_StridedShard(0)``
  of FSDP2 over tensor parallelism) hands out whole rows: always exact.
- Sharding one dim ``d >= 1`` (``RowwiseParallel``'s ``Shard(1)``, a ``shard_placement_fn``) hands out a
  piece of every row: exact when each piece starts on a multiple of 32 values (``torch.chunk`` sizes:
  ``ceil(cols / tp) % 32 == 0`` for ``Shard(1)`` of a 2-D weight) AND the rank's groups are the DTensor
  shard of the global scales ``(rows, groups)`` under the same placements on dim 1, so that
  ``torch.distributed.checkpoint`` and ``full_tensor`` see the global scales. Otherwise refused.
- Sharding two dims inside a row, and ``Partial`` parameters, are refused.

The rule is checked for every mesh coordinate (not only this rank's), so every rank refuses together.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 over tensor parallelism

_ALL_OFFSETS = 1  # torch's _StridedShardOffsetMode.ALL: every index the shard holds, not only the first


def is_shard(placement) -> bool:
    """``Shard(d)`` or ``_StridedShard(d)``: the placement hands each rank a part of tensor dim ``d``."""
    return isinstance(placement, (Shard, _StridedShard))


def dim_indices(size: int, shardings: list[tuple[int, object, int]], coordinate) -> torch.Tensor:
    """Global indices along one tensor dim of ``size`` held at mesh ``coordinate``, for that dim's
    ``shardings`` ``(mesh_dim, placement, mesh_dim_size)`` applied in mesh-dim order, as DTensor does
    (torch.chunk sizes; ``_StridedShard`` first splits into ``split_factor`` pieces)."""
    index = torch.arange(size)
    for mesh_dim, placement, n in shardings:
        rank = coordinate[mesh_dim]
        if isinstance(placement, _StridedShard):
            _, offsets = placement.local_shard_size_and_offset(len(index), n, rank, _ALL_OFFSETS)
            index = index[torch.tensor(offsets, dtype=torch.long)]
        else:
            length, offset = Shard.local_shard_size_and_offset(len(index), n, rank)
            index = index[offset:offset + length]
    return index


def shardings_of(dim: int, ndim: int, mesh_shape, placements) -> list[tuple[int, object, int]]:
    return [(m, pl, mesh_shape[m]) for m, pl in enumerate(placements) if is_shard(pl) and pl.dim % ndim == dim]


def _on_dim1(placement):
    """The placement of the scales ``(rows, groups)`` that matches a parameter's placement on a dim >= 1."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(1, split_factor=placement.split_factor)
    return Shard(1)


def scale_placements(placements, ndim: int) -> tuple:
    """Placements of the scales ``(rows, groups)`` of a parameter of ``ndim`` dims placed by ``placements``:
    dim 0 as the parameter's, a shard of a dim inside the row becomes a shard of dim 1."""
    return tuple(_on_dim1(pl) if is_shard(pl) and pl.dim % ndim else pl for pl in placements)


def _whole_groups(index: torch.Tensor, size: int, outer: int, inner: int, cols: int,
                  group: int) -> torch.Tensor | None:
    """The global group numbers of a local row, in order, or None when a piece of the row cuts a group.

    The row is ``outer`` blocks of ``size * inner`` values; the rank holds, in each block, the values of the
    sharded dim's ``index``, each ``inner`` long. Consecutive indices make one piece."""
    if index.numel() == 0:
        return index
    breaks = torch.nonzero(index.diff() != 1).flatten() + 1
    run_starts = index[torch.cat([torch.zeros(1, dtype=torch.long), breaks])]
    run_ends = index[torch.cat([breaks - 1, torch.tensor([index.numel() - 1])])] + 1
    base = torch.arange(outer)[:, None] * (size * inner)
    starts = (base + run_starts * inner).flatten()
    ends = (base + run_ends * inner).flatten()
    if (starts % group).any() or ((ends % group != 0) & (ends != cols)).any():
        return None
    first = starts // group
    count = (ends + group - 1) // group - first
    within = torch.arange(int(count.sum())) - torch.repeat_interleave(count.cumsum(0) - count, count)
    return torch.repeat_interleave(first, count) + within


@functools.lru_cache(maxsize=4096)
def placement_problem(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
                      group: int | None) -> str | None:
    """Why a parameter of GLOBAL ``shape`` placed by ``placements`` on a mesh of ``mesh_shape`` cannot be
    stepped exactly on its local shards, or None when it can. ``group``: the values per quantization group of
    its moments (flashdist.quant.codes.GROUP), None for elementwise state (``quantize_states=False``: any
    shard is exact)."""
    for placement in placements:
        if not (isinstance(placement, Replicate) or is_shard(placement)):
            return f"{placement} is not a shard of the parameter's values (reduce it before building the optimizer)"
    ndim = len(shape)
    if group is None or ndim < 2:
        return None
    row_dims = sorted({pl.dim % ndim for pl in placements if is_shard(pl)} - {0})
    if not row_dims:
        return None
    if len(row_dims) > 1:
        return (f"it is sharded on dims {row_dims}, inside its rows of {math.prod(shape[1:])} values, on more than "
                "one dim; shard at most one dim other than 0")
    d = row_dims[0]
    size, outer, inner = shape[d], math.prod(shape[1:d]), math.prod(shape[d + 1:])
    cols = outer * size * inner
    shardings = shardings_of(d, ndim, mesh_shape, placements)
    scale_shardings = [(m, _on_dim1(pl), n) for m, pl, n in shardings]
    ngroups = (cols + group - 1) // group
    mesh_dims = [m for m, _, _ in shardings]
    for combo in itertools.product(*(range(mesh_shape[m]) for m in mesh_dims)):
        coordinate = dict(zip(mesh_dims, combo))
        index = dim_indices(size, shardings, coordinate)
        groups = _whole_groups(index, size, outer, inner, cols, group)
        if groups is None:
            contiguous = bool((index.diff() == 1).all())
            held = f"indices {int(index[0])}..{int(index[-1])}" if contiguous else f"indices {index.tolist()[:8]}"
            return (f"the rank at mesh coordinate {combo} of mesh dims {mesh_dims} holds {held} of dim {d} "
                    f"(size {size}): pieces of its rows of {cols} values that cut quantization groups of {group}")
        if not torch.equal(groups, dim_indices(ngroups, scale_shardings, coordinate)):
            return (f"the rank at mesh coordinate {combo} holds whole groups {groups.tolist()[:8]}..., which are "
                    f"not the DTensor shard of the scales ({shape[0]}, {ngroups}) on dim 1, so no checkpoint "
                    "could describe them")
    return None


def whole_group_degrees(shape: tuple[int, ...], dim: int, group: int, limit: int = 16) -> list[int]:
    """Degrees ``n <= limit`` for which ``Shard(dim)`` over ``n`` ranks keeps every group of ``shape`` whole."""
    return [n for n in range(1, limit + 1) if placement_problem(tuple(shape), (n,), (Shard(dim),), group) is None]


def local_part(full: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """The part of the unsharded ``full`` that the rank at mesh ``coordinate`` holds under ``placements``
    (what a resharding load or ``distribute_tensor`` would place there); no communication."""
    t = full
    for d in range(full.ndim):
        shardings = shardings_of(d, full.ndim, mesh_shape, placements)
        if shardings:
            index = dim_indices(full.shape[d], shardings, coordinate)
            t = t.index_select(d, index.to(t.device))
    return t
