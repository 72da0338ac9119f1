"""Whole matrices for an update that needs them (Muon's Newton-Schulz), from DTensor shards: gathered to one
owner rank, computed there, and the result sent back in shards.

Newton-Schulz mixes every value of a matrix, so a rank cannot orthogonalize its own rows. For each sharded
matrix (any ``Shard`` / ``_StridedShard`` / ``Replicate`` placements, uneven shards included: FSDP2's
``Shard(0)``, tensor parallelism's ``Shard(0)`` / ``Shard(1)``, FSDP x TP, HSDP), every rank of the
parameter's mesh sends its local part of the update to the matrix's owner (``torch.distributed.gather``),
the owner assembles the whole matrix at the global indices each rank holds (the inverse of
``placements.local_part``), runs the computation, and sends every rank its part of the result
(``torch.distributed.scatter``). The owners go round-robin over the mesh's ranks by the matrix's position
in the list, the same on every rank, so the matmul work divides over the ranks. The collectives run over
one process group over the mesh (a 1-D mesh's, or the world's for a mesh over every rank), or, for a mesh of
several dims over some of the ranks (a pipeline stage's slice), in hops along the mesh dims (``_Route``).
The owner computes on the exact whole matrix of a one-process run with the same (deterministic) function,
so every rank ends with the one-process bits, at any world size and on any mesh.

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


_ROUTES: dict[int, tuple] = {}  # id(mesh) -> (mesh, route): _route's answers


class _Route:
    """How a matrix sharded on ``mesh`` reaches its owner. ``coordinates``: the mesh coordinate of each part,
    in the order the owner assembles them. Through one process group over every rank of the mesh (a 1-D
    mesh, or a mesh over the whole world: ``group``, with ``coordinates`` in its group ranks' order), or,
    where no such group exists (a mesh of several dims over some of the ranks, as a pipeline stage's), in
    hops along the mesh dims, each through that dim's own group (``hops``: per dim, its group and each
    coordinate's group rank along it; ``coordinates`` in row-major order)."""

    def __init__(self, mesh, group, coordinates: tuple, hops: list | None = None):
        self.shape = tuple(mesh.shape)
        self.group = group
        self.coordinates = coordinates
        self.hops = hops
        self.mine = tuple(mesh.get_coordinate()) if hops is not None else None


def _one_group(mesh):
    """A process group over every rank of ``mesh`` that exists on every rank of it, or None."""
    if mesh.ndim == 1:
        return mesh.get_group(0)
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return None


def _route(mesh) -> _Route:
    known = _ROUTES.get(id(mesh))
    if known is not None and known[0] is mesh:
        return known[1]
    ranks = mesh.mesh
    group = _one_group(mesh)
    if group is not None:
        coordinates = {}
        for coordinate in itertools.product(*(range(n) for n in ranks.shape)):
            coordinates[dist.get_group_rank(group, int(ranks[coordinate]))] = coordinate
        route = _Route(mesh, group, tuple(coordinates[r] for r in range(len(coordinates))))
    else:
        mine = mesh.get_coordinate()
        hops = []
        for d in range(mesh.ndim):
            line = ranks[tuple(slice(None) if k == d else c for k, c in enumerate(mine))]
            dim_group = mesh.get_group(d)
            hops.append((dim_group, [dist.get_group_rank(dim_group, int(r)) for r in line]))
        route = _Route(mesh, None, tuple(itertools.product(*(range(n) for n in ranks.shape))), hops)
    _ROUTES[id(mesh)] = (mesh, route)
    return route


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
        self.route = route = _route(p.device_mesh)
        self.size = len(route.coordinates)
        self.owner = position % self.size
        self.parts_at = _parts(self.shape, route.shape, tuple(p.placements), route.coordinates)
        largest = max(math.prod(shape) for _, shape in self.parts_at)
        self.pad = largest + largest % 2
        if route.hops is None:
            self.me = dist.get_rank(route.group)
            self.gloo = dist.get_backend(route.group) == "gloo"
        else:
            self.me = route.coordinates.index(route.mine)
            self.gloo = dist.get_backend(route.hops[0][0]) == "gloo"
        self.received = None
        self.parts = None
        self.result_dtype = update.dtype

    def _wire(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.view(torch.int32) if self.gloo else buffer

    def _count(self, sent: int, received: int) -> None:
        wire_bytes = self.pad * self.update.element_size()
        TRAFFIC["sent"] += sent * wire_bytes
        TRAFFIC["received"] += received * wire_bytes

    def _hops(self, reverse: bool):
        """The hops this rank takes part in, in order (gather: the last dim first; scatter: the reverse): a
        hop along dim ``d`` joins the ranks that share the owner's coordinates in the dims after ``d`` (they
        hold, or will hold, the parts of all those dims' coordinates). Yields (group, each coordinate's group
        rank along d, the owner's coordinate along d, this rank's, the parts each member sends or receives)."""
        route, owner = self.route, self.route.coordinates[self.owner]
        dims = range(len(route.shape) - 1, -1, -1) if reverse else range(len(route.shape))
        for d in dims:
            if route.mine[d + 1:] != owner[d + 1:]:
                continue
            if route.shape[d] > 1:
                group, ranks_of = route.hops[d]
                yield group, ranks_of, owner[d], route.mine[d], math.prod(route.shape[d + 1:])

    def gather(self) -> None:
        u = self.update
        sent = torch.zeros(self.pad, dtype=u.dtype, device=u.device)
        sent[: u.numel()] = u.reshape(-1)
        owner = self.me == self.owner
        if self.route.hops is not None:
            self._gather_in_hops(sent)
            return
        self.received = [torch.empty_like(sent) for _ in range(self.size)] if owner else None
        dist.gather(self._wire(sent), [self._wire(r) for r in self.received] if owner else None,
                    group=self.route.group, group_dst=self.owner)
        self._count(0 if owner else 1, self.size - 1 if owner else 0)

    def _gather_in_hops(self, bundle: torch.Tensor) -> None:
        for group, ranks_of, dst, mine, held in self._hops(reverse=True):
            if mine != dst:  # send what this rank holds, and take no further part
                dist.gather(self._wire(bundle), None, group=group, group_dst=ranks_of[dst])
                self._count(held, 0)
                return
            received = [torch.empty_like(bundle) for _ in ranks_of]
            dist.gather(self._wire(bundle), [self._wire(r) for r in received], group=group, group_dst=ranks_of[dst])
            self._count(0, held * (len(ranks_of) - 1))
            bundle = torch.cat([received[r] for r in ranks_of])  # by coordinate along the dim
        self.received = list(bundle.split(self.pad))  # the owner's: every part, in row-major order

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
        if self.route.hops is not None:
            bundle = self._scatter_in_hops(torch.cat(self.parts) if owner else None)
        else:
            bundle = torch.empty(self.pad, dtype=self.result_dtype, device=u.device)
            dist.scatter(self._wire(bundle), [self._wire(p) for p in self.parts] if owner else None,
                         group=self.route.group, group_src=self.owner)
            self._count(self.size - 1 if owner else 0, 0 if owner else 1)
        self.parts = None
        return bundle[: u.numel()].view(u.shape)

    def _scatter_in_hops(self, bundle: torch.Tensor | None) -> torch.Tensor:
        for group, ranks_of, src, mine, held in self._hops(reverse=False):
            back = torch.empty(held * self.pad, dtype=self.result_dtype, device=self.update.device)
            pieces = None
            if mine == src:  # by group rank: the piece of each coordinate along the dim
                by_coordinate = bundle.split(held * self.pad)
                pieces = [None] * len(ranks_of)
                for c, r in enumerate(ranks_of):
                    pieces[r] = self._wire(by_coordinate[c])
            dist.scatter(self._wire(back), pieces, group=group, group_src=ranks_of[src])
            self._count(held * (len(ranks_of) - 1) if mine == src else 0, 0 if mine == src else held)
            bundle = back
        return bundle


TRAFFIC = {"sent": 0, "received": 0}
"""Bytes this process has sent and received through the owners' exchanges (the wire's padded buffers, the
owner's own part not counted), since it started or since ``TRAFFIC.update(sent=0, received=0)``: what the
module docstring's budget measures."""
