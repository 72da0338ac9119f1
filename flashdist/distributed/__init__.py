"""Everything flashdist knows about DTensor / FSDP2 lives here; the rest works on plain local tensors.

FSDP2 (``fully_shard``) turns each parameter into a DTensor sharded on dim 0 (``Shard(0)`` over a 1-D
mesh, or ``(Replicate(), Shard(0))`` for HSDP). Because quantization groups never cross a row, the step
on each rank's local rows is exactly the step on those rows of the full tensor.
"""

from __future__ import annotations

import torch

try:  # torch >= 2.5 exposes DTensor publicly
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment]


def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor this rank stores (the tensor itself when it is not a DTensor)."""
    if t is not None and is_dtensor(t):
        return t._local_tensor  # to_local() without autograd bookkeeping on the hot path
    return t


def global_shape(t: torch.Tensor) -> torch.Size:
    return t.shape  # a DTensor reports its global shape


def _is_row_shard(placement, ndim: int) -> bool:
    # Exactly Shard on dim 0, however the dim is spelled: _StridedShard (FSDP2 over tensor parallelism; a
    # Shard subclass in some torch versions) interleaves the rows of several ranks.
    return type(placement) is Shard and ndim > 0 and placement.dim % ndim == 0


def check_placements(p: torch.Tensor, name: str) -> None:
    """Refuse layouts whose local shard is not one contiguous block of whole rows of the global tensor.

    Accepted: ``Shard(0)`` over a 1-D mesh (FSDP2), ``(Replicate(), Shard(0))`` over a 2-D mesh (HSDP), and
    any mix of ``Replicate()`` with at most one ``Shard(0)``. Refused, naming the parameter and placement:
    ``Shard(d)`` for d > 0 (FSDP2's ``shard_placement_fn``, tensor-parallel column shards), ``Partial``,
    strided shards (FSDP2 over tensor parallelism) and more than one sharded mesh dim.
    """
    if not is_dtensor(p):
        return
    placements = tuple(p.placements)
    where = f"parameter {name} has placements {placements} on mesh {p.device_mesh}"
    for placement in placements:
        if isinstance(placement, Replicate) or _is_row_shard(placement, p.ndim):
            continue
        raise ValueError(
            f"flashdist: {where}; only Shard(0) (FSDP2) and Replicate() (HSDP) keep whole rows on each rank, "
            "which the row-aligned quantized state needs. Shard this parameter on dim 0 (fully_shard without "
            "a shard_placement_fn) or keep it out of tensor parallelism."
        )
    if sum(not isinstance(pl, Replicate) for pl in placements) > 1:
        raise ValueError(f"flashdist: {where}; it is sharded on dim 0 by more than one mesh dim. Use one "
                         "Shard(0) mesh dim (FSDP2 or HSDP).")


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


def state_like(p: torch.Tensor, local_state: torch.Tensor, global_shape_: tuple[int, ...]) -> torch.Tensor:
    """Wrap a local state tensor as a DTensor with ``p``'s mesh and placements and its true global shape,
    so that dcp.save writes it and a resharding dcp.load finds it (uneven shards need shape= and stride=)."""
    if not is_dtensor(p):
        return local_state
    stride = torch.empty(global_shape_, device="meta").stride()
    if local_state.device.type != p.device_mesh.device_type:
        # FSDP2's CPUOffloadPolicy keeps the local shards in host memory on a CUDA mesh; from_local would copy
        # the state to the mesh's device. Build the DTensor around the host tensor, as FSDP2 does for the
        # offloaded parameters themselves, so the state stays beside its parameter (and dcp.save writes it).
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = DTensorSpec(p.device_mesh, tuple(p.placements),
                           tensor_meta=TensorMeta(torch.Size(global_shape_), stride, local_state.dtype))
        return DTensor(local_state, spec, requires_grad=False)
    return DTensor.from_local(local_state, p.device_mesh, p.placements, run_check=False,
                              shape=torch.Size(global_shape_), stride=stride)


def local_rows(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of an unsharded tensor ``full``, laid out like the DTensor ``like``; no communication.

    DTensor's ``Shard`` splits with ``torch.chunk`` (ranks past the last chunk hold an empty shard), so
    splitting the same way here gives exactly the rows a resharding load would place on this rank."""
    if not is_dtensor(like):
        return full
    t = full
    coordinate = like.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            pieces = torch.chunk(t, like.device_mesh.size(mesh_dim), dim=0)
            index = coordinate[mesh_dim]
            t = pieces[index] if index < len(pieces) else t[:0]
    return t


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
