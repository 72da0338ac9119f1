"""Whole matrices for an update that needs them (Muon's Newton-Schulz), from DTensor shards: gathered to one
owner rank, computed there, and the result sent back in shards.

Newton-Schulz mixes every value of a matrix, so a rank cannot orthogonalize its own rows. For each sharded
matrix (any ``Shard`` / ``_StridedShard`` / ``Replicate`` placements, uneven shards included: FSDP2's
``Shard(0)``, tensor parallelism's ``Shard(0)`` / ``Shard(1)``, FSDP x TP, HSDP), every rank of the
parameter's mesh sends its local part of the update to the matrix's owner (``torch.distributed.gather``),
the owner assembles the whole matrix at the global indices each rank holds (the inverse of
``placements.local_part``), runs the computation, and sends every rank its part of the result
(``torch.distributed.scatter``). The owners go round-robin over the mesh's ranks by the matrix's position
in the list, the same on every rank, so the matmul work divides over the ranks. The owner computes on the
exact whole matrix of a one-process run with the same (deterministic) function, so every rank ends with
the one-process bits, at any world size and on any mesh.

A stack of matrices orthogonalized one by one (FlashMuon's ``flatten=False``, MoE experts) that is sharded
along its stack dims only (FSDP2's ``Shard(0)`` of ``(experts, out, in)``, expert parallelism) is computed
where it is: each rank holds whole matrices, the same function gives the same bits, and nothing travels.

Communication per step: every part of the update that is not on its owner travels there once (bf16, 2 bytes
per value) and its result comes back once (2 bytes): 4 (world - 1) / world bytes per parameter per step in
all, and on each rank as many bytes sent and as many received per local parameter (2 and 2 on 2 ranks,
towards 4 and 4 on many; the owners' work and traffic going round-robin), against 2 (world - 1) bytes per
local parameter received by every rank of an all-gather to every rank (and every rank computing every
matrix). Each shard
is padded to the largest shard of its matrix (uneven FSDP2 shards: at most one row per rank), plus one
value to an even length. ``TRAFFIC`` counts the bytes a process sent and received (tested against this). The matrices
go in chunks of one per rank: all gathers of a chunk, then every owner computes at once, then all scatters;
two collectives per matrix (a bucketed all-to-all is the faster form of the same exchange).

Like the rest of ``flashdist.distributed``, this module imports no other flashdist module.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from . import placements as P


@functools.lru_cache(maxsize=4096)
def _parts(shape: tuple, mesh_shape: tuple, placements: tuple, coordinates: tuple) -> tuple:
    """Where each rank's part of a tensor of ``shape`` lies (``coordinates``: each group rank's mesh
    coordinate): per rank, an index (slices where every dim's indices are a range, as for ``Shard``; else
    broadcastable index tensors, as for some ``_StridedShard``s) with ``full[index]`` the part that
    ``placements.local_part`` gives, and the part's shape. Cached: the same for every step."""
    out = []
    for coordinate in coordinates:
        dims = []
        for d, size in enumerate(shape):
            shardings = P.shardings_of(d, len(shape), mesh_shape, placements)
            dims.append(P.dim_indices(size, shardings, coordinate) if shardings else torch.arange(size))
        part_shape = tuple(len(i) for i in dims)
        if all(len(i) < 2 or bool((i.diff() == 1).all()) for i in dims):
            index = tuple(slice(int(i[0]), int(i[0]) + len(i)) if len(i) else slice(0, 0) for i in dims)
        else:
            index = tuple(i.view([-1 if k == d else 1 for k in range(len(shape))]) for d, i in enumerate(dims))
        out.append((index, part_shape))
    return tuple(out)


_GROUPS: dict[int, tuple] = {}  # id(mesh) -> (mesh, group, coordinates): _mesh_group's answers


def _mesh_group(mesh):
    """A process group over every rank of ``mesh``, and the mesh coordinate of each of its group ranks."""
    known = _GROUPS.get(id(mesh))
    if known is not None and known[0] is mesh:
        return known[1], known[2]
    if mesh.ndim == 1:
        group = mesh.get_group(0)
    elif mesh.size() == dist.get_world_size():
        group = dist.group.WORLD
    else:
        raise ValueError(f"flashdist: orthogonalizing a matrix sharded on the {mesh.ndim}-D mesh {mesh}, which "
                         f"covers {mesh.size()} of {dist.get_world_size()} ranks, is not supported: use a mesh "
                         "over every rank (or a 1-D mesh)")
    ranks = mesh.mesh
    coordinates = {}
    for coordinate in itertools.product(*(range(n) for n in ranks.shape)):
        coordinates[dist.get_group_rank(group, int(ranks[coordinate]))] = coordinate
    ordered = tuple(coordinates[r] for r in range(len(coordinates)))
    _GROUPS[id(mesh)] = (mesh, group, ordered)
    return group, ordered


class OwnerOrthogonalize:
    """``orthogonalize=`` of ``flashdist.functional.flash_muon`` for the parameters ``params`` (DTensors or
    plain tensors, the tensors whose local parts the step's lists hold, in the same order on every rank):
    plain tensors are computed where they are, DTensor ones through their owner (the module docstring).
    ``first``: the round-robin position of ``params[0]`` (a caller with several lists continues the count).

    A call takes a chunk of matrices (``chunk``, the largest mesh size among ``params``: one matrix per
    owner): it gathers all of them, then each owner computes its own while the others compute theirs, then
    it sends all the results back."""

    def __init__(self, params: Sequence[torch.Tensor], first: int = 0, stacked: Sequence[bool] | None = None):
        self.params = list(params)
        self.first = first
        self.chunk = max([p.device_mesh.size() for p in self.params if hasattr(p, "device_mesh")] or [1])
        # stacks of matrices (``stacked[i]``: each matrix of the last two dims orthogonalized on its own) that
        # are sharded along their stack dims only (FSDP2's Shard(0) of (experts, out, in), expert parallelism):
        # every rank holds whole matrices, orthogonalized where they are, with nothing sent
        self.local = [bool(stacked and stacked[i]) and _whole_matrices(p) for i, p in enumerate(self.params)]

    def __call__(self, indices: Sequence[int], updates: Sequence[torch.Tensor],
                 whole: Callable[[int, torch.Tensor], torch.Tensor]) -> list:
        out: list = [None] * len(updates)
        exchanges = []
        for k, (i, u) in enumerate(zip(indices, updates)):
            p = self.params[i]
            if not hasattr(p, "device_mesh") or self.local[i]:
                out[k] = whole(i, u)
                continue
            exchange = _Exchange(p, u, self.first + i)
            if exchange.size == 1:
                out[k] = whole(i, u)
                continue
            exchange.gather()
            exchanges.append((k, i, exchange))
        for k, i, exchange in exchanges:  # every owner computes its matrices before any result is sent
            exchange.compute(lambda full, i=i: whole(i, full))
        for k, i, exchange in exchanges:
            out[k] = exchange.scatter()
        return out


def _whole_matrices(p: torch.Tensor) -> bool:
    """Whether every local shard of the stack ``p`` (a DTensor of 3 or more dims) holds whole matrices of its
    last two dims: each placement shards a leading dim or replicates (none is partial)."""
    if not hasattr(p, "placements") or p.ndim < 3:
        return False
    return all((P.is_shard(pl) and pl.dim % p.ndim < p.ndim - 2) or pl.is_replicate() for pl in p.placements)


class _Exchange:
    """One matrix's trip to its owner and back: ``gather`` (every rank), ``compute`` (runs on the owner
    only), ``scatter`` (every rank: returns this rank's part of the result). Values travel as bf16 in
    buffers of an even length padded to the largest part; gloo has no 16-bit collectives, so there a buffer
    travels as the int32 view of its bf16 pairs (the same bytes)."""

    def __init__(self, p: torch.Tensor, update: torch.Tensor, position: int):
        self.shape = tuple(p.shape)
        self.update = update
        self.group, coordinates = _mesh_group(p.device_mesh)
        self.size = len(coordinates)
        self.owner = position % self.size
        self.me = dist.get_rank(self.group)
        self.parts_at = _parts(self.shape, tuple(p.device_mesh.shape), tuple(p.placements), coordinates)
        largest = max(math.prod(shape) for _, shape in self.parts_at)
        self.pad = largest + largest % 2
        self.gloo = dist.get_backend(self.group) == "gloo"
        self.received = None
        self.parts = None
        self.result_dtype = update.dtype

    def _wire(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.view(torch.int32) if self.gloo else buffer

    def _count(self, sent: int, received: int) -> None:
        wire_bytes = self.pad * self.update.element_size()
        TRAFFIC["sent"] += sent * wire_bytes
        TRAFFIC["received"] += received * wire_bytes

    def gather(self) -> None:
        u = self.update
        sent = torch.zeros(self.pad, dtype=u.dtype, device=u.device)
        sent[: u.numel()] = u.reshape(-1)
        owner = self.me == self.owner
        self.received = [torch.empty_like(sent) for _ in range(self.size)] if owner else None
        dist.gather(self._wire(sent), [self._wire(r) for r in self.received] if owner else None, group=self.group,
                    group_dst=self.owner)
        self._count(0 if owner else 1, self.size - 1 if owner else 0)

    def compute(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.me != self.owner:
            return
        u = self.update
        full = torch.empty(self.shape, dtype=u.dtype, device=u.device)
        for (index, shape), got in zip(self.parts_at, self.received):
            full[index] = got[:math.prod(shape)].view(shape)
        self.received = None
        result = fn(full)
        del full
        self.result_dtype = result.dtype
        self.parts = []
        for index, shape in self.parts_at:
            part = torch.zeros(self.pad, dtype=result.dtype, device=u.device)
            part[:math.prod(shape)] = result[index].reshape(-1)
            self.parts.append(part)

    def scatter(self) -> torch.Tensor:
        u = self.update
        owner = self.me == self.owner
        back = torch.empty(self.pad, dtype=self.result_dtype, device=u.device)
        dist.scatter(self._wire(back), [self._wire(p) for p in self.parts] if owner else None, group=self.group,
                     group_src=self.owner)
        self._count(self.size - 1 if owner else 0, 0 if owner else 1)
        self.parts = None
        return back[: u.numel()].view(u.shape)


TRAFFIC = {"sent": 0, "received": 0}
"""Bytes this process has sent and received through the owners' exchanges (the wire's padded buffers, the
owner's own part not counted), since it started or since ``TRAFFIC.update(sent=0, received=0)``: what the
module docstring's budget measures."""
