"""Everything flashdist knows about DTensor / FSDP2 lives here; the rest works on plain local tensors.

FSDP2 (``fully_shard``) turns each parameter into a DTensor sharded on dim 0 (``Shard(0)`` over a 1-D
mesh, or ``(Replicate(), Shard(0))`` for HSDP). Because quantization groups never cross a row, the step
on each rank's local rows is exactly the step on those rows of the full tensor. Tensor parallelism adds
shards inside a row (``RowwiseParallel``'s ``Shard(1)``) and several sharded mesh dims; they are exact when
every rank's piece of a row is whole groups (flashdist.distributed.placements holds that rule), and the step
then sees each rank's local tensor as a shorter row (flashdist.quant.moment.MomentLayout.local).
"""

from __future__ import annotations

import math

import torch

try:  # torch >= 2.5 exposes DTensor publicly
    from torch.distributed.tensor import DTensor

    from . import placements as P
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment]


def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor this rank stores (the tensor itself when it is not a DTensor)."""
    if t is not None and is_dtensor(t):
        return t._local_tensor  # to_local() without autograd bookkeeping on the hot path
    return t


def share_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` each rank holds on average: a DTensor's global bytes over the ranks that split it (a
    number every rank computes alike, where uneven shards give each rank its own), a plain tensor's own."""
    nbytes = t.numel() * t.element_size()  # (a DTensor's numel is its global one)
    if is_dtensor(t):
        mesh_shape = t.device_mesh.shape
        nbytes //= math.prod(mesh_shape[dim] for dim, placement in enumerate(t.placements) if placement.is_shard())
    return nbytes


def global_shape(t: torch.Tensor) -> torch.Size:
    return t.shape  # a DTensor reports its global shape


def check_placements(p: torch.Tensor, name: str, group: int | None) -> None:
    """Refuse a DTensor parameter whose local shard would cut a quantization group (or is ``Partial``),
    naming the parameter, its placements and what would fix it. The rule (flashdist.distributed.placements):
    any ``Shard(d)``, ``_StridedShard`` and ``Replicate`` on any number of mesh dims is accepted when every
    rank's piece of every row starts on a group boundary; dim-0 shards (FSDP2, ``ColwiseParallel``, experts)
    always are. ``group``: values per quantization group (flashdist.quant.codes.GROUP); None
    (``quantize_states=False``): elementwise state, only ``Partial`` is refused."""
    if not is_dtensor(p):
        return
    placements = tuple(p.placements)
    mesh_shape = tuple(p.device_mesh.shape)
    problem = P.placement_problem(tuple(p.shape), mesh_shape, placements, group)
    if problem is None:
        return
    fix = "shard it on dim 0 (ColwiseParallel, FSDP2) or keep it replicated on that mesh dim"
    row_dims = {pl.dim % p.ndim for pl in placements if P.is_shard(pl)} - {0}
    if len(row_dims) == 1:
        d = row_dims.pop()
        degrees = P.whole_group_degrees(tuple(p.shape), d, group)
        rule = f"; for a 2-D weight, n with ceil(cols / n) a multiple of {group}" if p.ndim == 2 else ""
        fix = f"shard dim {d} over n ranks that keep groups whole (n in {degrees} up to 16{rule}), or {fix}"

    raise ValueError(f"flashdist: parameter {name} has placements {placements} on mesh {p.device_mesh}: {problem}. "
                     f"Fix: {fix}.")


def grad_layout_problem(p: torch.Tensor, grad: torch.Tensor) -> str | None:
    """Why ``grad``'s local tensor is not the gradient of ``p``'s local rows, or None when it is. A gradient
    whose placements differ from the parameter's (``Partial`` after tensor parallelism, a replicated grad
    of a sharded parameter) would be stepped as if it were the local rows: refuse it instead. No collective."""
    if is_dtensor(p) != is_dtensor(grad):
        kinds = ("a DTensor", "a plain tensor")
        return (f"is {kinds[not is_dtensor(p)]} but its gradient is {kinds[not is_dtensor(grad)]}; give it a "
                "gradient of the same kind and layout")
    if is_dtensor(p) and (grad.placements != p.placements or grad.device_mesh != p.device_mesh):
        return (f"has placements {tuple(p.placements)} but its gradient has {tuple(grad.placements)} on mesh "
                f"{grad.device_mesh}; reduce or redistribute the gradient to the parameter's placements "
                "(grad.redistribute(p.device_mesh, p.placements)) before the step")
    return None


def state_placements(p: torch.Tensor, global_shape_: tuple[int, ...]) -> tuple:
    """Placements of a state tensor of ``p`` with this global shape: ``p``'s own for tensors of its shape
    (codes, rho, fp32 moments), and for the scales ``(rows, groups)`` of a parameter of more dims, a shard
    of a dim inside the row becomes a shard of dim 1 (the rule in flashdist.distributed.placements makes
    the local groups exactly that shard)."""
    if len(global_shape_) == p.ndim:
        return tuple(p.placements)
    return P.scale_placements(p.placements, p.ndim)


def state_like(p: torch.Tensor, local_state: torch.Tensor, global_shape_: tuple[int, ...]) -> torch.Tensor:
    """Wrap a local state tensor as a DTensor on ``p``'s mesh with ``state_placements`` and its true global
    shape, so that dcp.save writes it and a resharding dcp.load finds it (uneven shards need shape= and stride=)."""
    if not is_dtensor(p):
        return local_state
    placements = state_placements(p, global_shape_)
    stride = torch.empty(global_shape_, device="meta").stride()
    if local_state.device.type != p.device_mesh.device_type:
        # FSDP2's CPUOffloadPolicy keeps the local shards in host memory on a CUDA mesh; from_local would copy
        # the state to the mesh's device. Build the DTensor around the host tensor, as FSDP2 does for the
        # offloaded parameters themselves, so the state stays beside its parameter (and dcp.save writes it).
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = DTensorSpec(p.device_mesh, placements,
                           tensor_meta=TensorMeta(torch.Size(global_shape_), stride, local_state.dtype))
        return DTensor(local_state, spec, requires_grad=False)
    return DTensor.from_local(local_state, p.device_mesh, placements, run_check=False,
                              shape=torch.Size(global_shape_), stride=stride)


def local_rows(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of an unsharded tensor ``full``, laid out like the DTensor ``like``; no communication.

    DTensor's ``Shard`` splits with ``torch.chunk`` (ranks past the last chunk hold an empty shard), on any
    dim and any number of mesh dims; splitting the same way here gives exactly the part a resharding load
    would place on this rank."""
    if not is_dtensor(like):
        return full
    return P.local_part(full, tuple(like.device_mesh.shape), like.device_mesh.get_coordinate(),
                        tuple(like.placements))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a DTensor: every rank must call this, in the same order)."""
    if not is_dtensor(t):
        return t
    if t.dtype == torch.int16:  # gloo cannot all-gather int16 (rho of 32-bit master weights): widen
        return t.to(torch.int32).full_tensor().to(torch.int16)
    return t.full_tensor()


def fsdp_compute_dtypes(module: torch.nn.Module) -> dict[int, torch.dtype]:
    """``id(parameter) -> dtype`` that FSDP2 computes with, for every parameter ``fully_shard`` manages in
    ``module``: its ``MixedPrecisionPolicy.param_dtype`` when set, else the parameter's own dtype. Empty for
    a module without FSDP2. Reads FSDP2's per-module state (no public accessor exists in torch 2.13)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return {}
    out: dict[int, torch.dtype] = {}
    for submodule in module.modules():
        if not isinstance(submodule, FSDPModule):
            continue
        state = submodule._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # older torch: at most one group per module
            groups = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
        for group in groups:
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                out[id(param)] = group.mp_policy.param_dtype or param.dtype
    return out
