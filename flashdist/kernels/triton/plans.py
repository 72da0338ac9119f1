"""Launch plans of the fused step: which launches a call makes, with which device tables, cached per call site.

A plan sorts a call's tensors into buckets of one compile-time specialisation (param dtype, grad dtype, rho
dtype, quantized, ``ALIGNED`` rows, 16-byte aligned storage; companded, decoupled and exact are per call) and
holds, per bucket, the work table and the per-tensor int64 table of the table launch and the arguments of
each tensor that gets a launch of its own.

Plans are cached per ``LaunchConfig``. A step must not pay per-tensor Python calls beyond the few that
safety needs (a step can hold thousands of tensors), so a plan is found and checked with three per tensor:
- the parameter's ``data_ptr`` (with the layout: quantized, rho dtype, cols): a parameter whose storage is
  swapped (``p.data = ...``, as ``module.to`` does) gets a new plan;
- the gradient's ``data_ptr``, compared with the plan's: gradients are new tensors at each step when
  ``zero_grad(set_to_none=True)``, usually at the same addresses; where one moved, the gradients are
  checked again (dtype, size, contiguity, device, alignment) and only the gradient addresses of the
  tables are rewritten (a changed dtype or alignment rebuilds the plan);
- the ``id`` of the first moment (its codes): a state that is replaced, as ``load_state_dict`` does, gets a
  new plan, also while the old tensors live on elsewhere (a state dict kept by the caller).
The plan also holds weak references to every state tensor (moments, scales, rho) whose callbacks drop it
as soon as one is freed, so it never writes to freed memory and an ``id`` it compares names a live
tensor. Not detected: replacing one scales or rho tensor alone while the old one stays alive elsewhere,
and swapping the storage of a state tensor in place (``.data =``, ``set_``); the optimizer does neither.
``clear_plans()`` drops every cached plan (their device tables are freed once no launch reads them). A plan
launched inside a CUDA graph capture is also kept apart (``keep_captured``) for as long as a graph may replay
its tables: until the graph's owner releases it (``GraphedStep``: ``release_captured``) or, for a graph the
caller captured, until one of its state tensors is freed. Eager steps never change a captured plan (new
gradient addresses get a new plan); its owner may point it at the gradients of the next replay, in place and
outside the graph (``Plan.retarget``: one small host-to-device copy per table), which is what lets a graph
replay after ``zero_grad(set_to_none=True)`` put the gradients elsewhere. For that, capturable launches read
the gradient address of a large tensor from a device cell (``Bucket.cells``), as the table launch reads the
small tensors' from its table, never from a kernel argument fixed into the graph.

This module imports no triton: it is host-side bookkeeping.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Iterator, Sequence

import torch

from ...quant import codes as Q
from .config import LaunchConfig, current

# dtype codes of the kernel's constexpr arguments
FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
RHO_KIND = {None: 0, torch.int8: 1, torch.int16: 2}
RHO_LOG2 = {None: 7, torch.int8: 7, torch.int16: 15}  # log2 of rho.RHO_STEPS (unused without rho)
# Row of the per-tensor int64 table of the table launch (programs.table_kernel reads it): the 7 addresses,
# then the sizes; padded to TABLE_STRIDE entries so that one row is one 128-byte line.
TABLE_COLUMNS = ("p", "g", "m", "v", "ms", "vs", "rho", "numel", "ngroups", "cols", "gpr")
TABLE_FIELDS = len(TABLE_COLUMNS)
TABLE_STRIDE = 16
GRAD_COLUMN = TABLE_COLUMNS.index("g")

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_is_contiguous = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


class Bucket:
    """Tensors of one specialisation: one table launch for the small ones, one launch each for the large."""

    __slots__ = ("flags", "work", "tensors", "rows", "small", "small_index", "items", "large", "cells", "cell_rows")

    def __init__(self, flags: dict):
        self.flags = flags  # the constexpr arguments fixed by the tensors (dtypes, alignment, rho constants)
        self.work = None  # device int32 (items, 3) work table of the small tensors, or None
        self.tensors = None  # device int64 (small tensors, TABLE_STRIDE) table
        self.rows = None  # the same table on the host, kept to rewrite gradient addresses
        self.small = []  # index in the call's lists of each table row
        self.small_index = None  # the same as an int64 CPU tensor
        self.items = 0  # programs of the table launch
        self.large = []  # [index, grid, address and size arguments, WIDE, grad cell] of each large tensor
        # device int64 (large tensors, 2): each large tensor's gradient address in column 0 (16-byte rows, so
        # that every cell is 16-byte aligned), read by capturable launches (fused: GRAD_CELL) in place of the
        # address argument, so that a captured launch reads the address written before each replay
        self.cells = None
        self.cell_rows = None  # the same on the host


class Plan:
    """The launches of one call's lists (its buckets) and what identifies the lists they were built for."""

    __slots__ = ("buckets", "dummy", "exp_avg_table", "device", "layout", "param_ptrs", "numels", "grad_dtypes",
                 "grad_ptrs", "grad_addresses", "state_ids", "refs", "streams", "aligned16", "__weakref__")

    @property
    def captured(self) -> bool:
        """Launched inside a CUDA graph capture that may still be replayed (``keep_captured``): kept alive, and
        its tables never changed."""
        return self in _CAPTURED

    def __init__(self, buckets, device, layout, param_ptrs, numels, grad_dtypes, grad_ptrs):
        self.buckets = buckets
        self.device = device
        self.dummy = torch.zeros(1, dtype=torch.int32, device=device)  # skip counter when none is counted
        self.exp_avg_table = Q.exp_avg_table(device)
        self.layout = layout  # (device, algorithm, moments, quantized, rho dtype, cols): with param_ptrs, the key
        self.param_ptrs = param_ptrs
        self.numels = numels  # of each tensor in the call's lists
        self.grad_dtypes = grad_dtypes
        self.grad_ptrs = grad_ptrs  # gradient addresses the tables hold
        self.grad_addresses = None  # the same as an int64 CPU tensor, kept by GraphedStep for its compiled check
        self.state_ids: list[int] = []
        self.refs: list[weakref.ref] = []  # weak references to the state tensors that drop this plan when freed
        self.streams: list = []  # streams the device tables are marked as used on
        # int64 CPU tensor of the indices whose gradient must stay 16-byte aligned (their bucket's ALIGN16)
        self.aligned16 = torch.tensor(sorted(
            i for bucket in buckets if bucket.flags["ALIGN16"] for i in [*bucket.small, *(l[0] for l in bucket.large)]),
            dtype=torch.int64)

    def used_on(self, stream) -> None:
        """Mark the plan's device tables as read by work queued on ``stream`` (caching allocator). Once per
        stream is enough: when a table is freed, the allocator waits for everything queued on its marked
        streams up to then. Tables rebuilt by ``set_grads`` are new tensors, marked again."""
        if stream in self.streams:
            return
        self.streams.append(stream)
        self.dummy.record_stream(stream)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.record_stream(stream)
                bucket.tensors.record_stream(stream)

    @property
    def table_tensors(self) -> int:
        """Tensors stepped by the table launches of this plan."""
        return sum(len(bucket.small) for bucket in self.buckets)

    @property
    def table_launches(self) -> int:
        """Table launches of this plan (one per bucket holding small tensors)."""
        return sum(bucket.items > 0 for bucket in self.buckets)

    @property
    def own_launches(self) -> int:
        """Tensors stepped by a launch of their own (``LaunchConfig.large_numel`` elements or more)."""
        return sum(len(bucket.large) for bucket in self.buckets)

    def watch(self, cache: "PlanCache", first: Sequence[torch.Tensor], states: list[Sequence[torch.Tensor]]) -> None:
        """Record the ids of the ``first`` state list (the first moments), and drop the plan from ``cache`` as
        soon as any state tensor is freed (after which the plan would point at freed memory, and its id may
        name a new tensor)."""
        this = weakref.ref(self)

        def freed(_ref, this=this):
            plan = this()
            if plan is not None:
                cache.discard(plan)
                _CAPTURED.pop(plan, None)

        self.state_ids = list(map(id, first))
        self.refs = [weakref.ref(t, freed) for kind in states for t in kind]

    def fits(self, grads: Sequence[torch.Tensor], ptrs: list[int]) -> bool:
        """Whether the tables can point at ``grads`` (at ``ptrs``): False for another number of tensors, another
        dtype, or an address that breaks a bucket's 16-byte alignment (a new plan is needed); a gradient that no
        plan can take (another device or size, not contiguous) is refused as ``check`` refuses it. One pass of
        C-level maps over the lists, per-tensor Python only where something is off."""
        if len(grads) != len(self.numels):
            return False
        if (list(map(_DTYPE, grads)) != self.grad_dtypes or list(map(_numel, grads)) != self.numels
                or not all(map(_is_contiguous, grads)) or set(map(_DEVICE, grads)) != {self.device}):
            floats = tuple(FLOAT_KIND)
            for i, g in enumerate(grads):  # the one that is off, by name (raises), or another dtype (False)
                check(i, "grad", g, self.numels[i], floats, self.device)
            if list(map(_DTYPE, grads)) != self.grad_dtypes:
                return False
        if len(self.aligned16):
            if bool((torch.tensor(ptrs, dtype=torch.int64)[self.aligned16] & 15).any()):
                return False
        return True

    def set_grads(self, grads: Sequence[torch.Tensor], ptrs: list[int]) -> bool:
        """Point the tables at new gradient tensors; False when the plan does not fit them (``fits``), or when a
        CUDA graph captured it (a graph replays the tables it captured: only ``retarget`` changes them, in
        place, outside the graph), so that a new plan is built."""
        if self.captured or not self.fits(grads, ptrs):
            return False
        addresses = torch.tensor(ptrs, dtype=torch.int64)
        for bucket in self.buckets:
            if bucket.small and any(ptrs[i] != self.grad_ptrs[i] for i in bucket.small):
                rows = bucket.rows.clone()
                rows[:, GRAD_COLUMN] = addresses[bucket.small_index]
                bucket.rows, bucket.tensors = rows, to_device(rows, self.device)
                self.streams = []  # a new device table: mark it on the streams that will read it
            if bucket.large:
                cells = bucket.cell_rows.clone()
                for k, large in enumerate(bucket.large):
                    large[2][GRAD_COLUMN] = cells[k, 0] = ptrs[large[0]]
                bucket.cell_rows, bucket.cells = cells, to_device(cells, self.device)
                for k, large in enumerate(bucket.large):
                    large[4] = bucket.cells[k]
                self.streams = []
        self.grad_ptrs = ptrs
        return True

    def retarget(self, grads: Sequence[torch.Tensor], ptrs: list[int]) -> bool:
        """Point this plan's device tables at ``grads`` IN PLACE (one host-to-device copy per table, queued on
        the current stream), so that a CUDA graph that captured the plan reads them at its next replay: called
        outside the graph, before a replay (``GraphedStep``), with the step's stream current. False (nothing
        changed) where the plan does not fit them (``fits``)."""
        if not self.fits(grads, ptrs):
            return False
        return self.retarget_addresses(torch.tensor(ptrs, dtype=torch.int64))

    def retarget_addresses(self, addresses: torch.Tensor) -> bool:
        """``retarget`` to gradients the caller has checked already (dtype, numel, contiguity, device: the
        compiled ``kernels.host.grad_info``), given as an int64 CPU tensor of their addresses; False (nothing
        changed) where one breaks a bucket's 16-byte alignment."""
        if len(self.aligned16) and bool((addresses[self.aligned16] & 15).any()):
            return False
        for bucket in self.buckets:
            if bucket.small:
                bucket.rows[:, GRAD_COLUMN] = addresses[bucket.small_index]
                bucket.tensors.copy_(pinned(bucket.rows), non_blocking=True)
            if bucket.large:
                for k, large in enumerate(bucket.large):
                    large[2][GRAD_COLUMN] = bucket.cell_rows[k, 0] = int(addresses[large[0]])
                bucket.cells.copy_(pinned(bucket.cell_rows), non_blocking=True)
        self.grad_ptrs = addresses.tolist()
        self.grad_addresses = addresses.clone()
        return True


def check(i: int, what: str, t: torch.Tensor, numel: int, dtypes: tuple, device: torch.device) -> None:
    where = f"flashdist: {what} of tensor {i}"
    if t.device != device:
        raise ValueError(f"{where} is on {t.device}, the parameters on {device}: one call takes one device")
    if t.dtype not in dtypes:
        raise TypeError(f"{where} has dtype {t.dtype}, expected one of {dtypes}")
    if t.numel() != numel:
        raise ValueError(f"{where} has {t.numel()} elements (shape {tuple(t.shape)}), expected {numel}")
    if not t.is_contiguous():
        raise ValueError(f"{where} is not contiguous (strides {t.stride()}); the fused step reads flat storage")


def build_plan(config: LaunchConfig, layout, param_ptrs, params, grads, moments, scales, rhos, cols) -> Plan:
    """The buckets and device tables of one call's lists under ``config``, checking every tensor.
    ``moments``: the call's moment lists (none, the first, or Adam's first and second); ``scales`` their
    scale lists when quantized, else None."""
    device = params[0].device
    quantized = scales is not None
    lists = {"grads": grads, "rhos": rhos, "cols": cols if quantized else None}
    for k, values in enumerate(moments):
        lists[f"moments[{k}]"] = values
        lists[f"scales[{k}]"] = scales[k] if quantized else None
    for name, values in lists.items():
        if values is not None and len(values) != len(params):
            raise ValueError(f"flashdist: {len(params)} params but {len(values)} {name}")
    names = ("first moment", "second moment")
    floats = tuple(FLOAT_KIND)
    buckets: dict[tuple, Bucket] = {}
    small: dict[tuple, list[tuple]] = {}  # bucket key -> (index, table row, blocks) of each small tensor
    for i, p in enumerate(params):
        n = p.numel()
        check(i, "param", p, n, floats, device)
        check(i, "grad", grads[i], n, floats, device)
        # addresses of p, g, m, v, their scales, rho (0: none)
        data = [p, grads[i], *(m[i] for m in moments), *[None] * (2 - len(moments))]
        if quantized:
            c = int(cols[i])
            if c <= 0 or n % c:
                raise ValueError(f"flashdist: tensor {i} has {n} elements, not a whole number of rows of {c}")
            gpr = -(-c // Q.GROUP)
            ngroups = n // c * gpr
            for k, (m, sc) in enumerate(zip(moments, scales)):
                check(i, f"{names[k]} codes", m[i], n, (torch.uint8,) if k else (torch.int8,), device)
                check(i, f"{names[k]} scales", sc[i], ngroups, (torch.bfloat16,), device)
            data += [*(sc[i] for sc in scales), *[None] * (2 - len(scales))]
            aligned = c % Q.GROUP == 0
            table_blocks, large_blocks = -(-ngroups // config.table_groups), -(-ngroups // config.large_groups)
        else:
            c, gpr, ngroups = n, 0, n
            for k, m in enumerate(moments):
                check(i, names[k], m[i], n, (torch.float32,), device)
            data += [None, None]
            aligned = True  # not read without quantization
            table_blocks = -(-n // (config.table_groups * Q.GROUP))
            large_blocks = -(-n // (config.large_groups * Q.GROUP))
        rho_dtype = None
        if rhos is not None:
            if p.dtype not in (torch.bfloat16, torch.float16):
                raise TypeError(f"flashdist: tensor {i} has a rho but its param is {p.dtype}; only bf16 and "
                                "fp16 params are split")
            check(i, "rho", rhos[i], n, (rhos[0].dtype,), device)
            rho_dtype = rhos[i].dtype
        data.append(rhos[i] if rhos is not None else None)
        if n == 0:
            continue
        addrs = [t.data_ptr() if t is not None else 0 for t in data]
        align16 = all(a % 16 == 0 for a in addrs)
        key = (p.dtype, grads[i].dtype, aligned, align16)
        if key not in buckets:
            buckets[key] = Bucket(dict(
                P_KIND=FLOAT_KIND[p.dtype], G_KIND=FLOAT_KIND[grads[i].dtype], RHO_KIND=RHO_KIND[rho_dtype],
                QUANTIZED=quantized, ALIGNED=aligned, ALIGN16=align16, RHO_LOG2=RHO_LOG2[rho_dtype],
            ))
        sizes = [n, ngroups, c, gpr]
        if n >= config.large_numel or n >= 2**31:  # the table launch indexes with int32
            grid = (-(-large_blocks // config.large_blocks),)
            buckets[key].large.append([i, grid, [*addrs, *sizes, large_blocks], n >= 2**31])
        else:
            small.setdefault(key, []).append((i, addrs + sizes, table_blocks))
    for key, rows in small.items():
        table = torch.zeros((len(rows), TABLE_STRIDE), dtype=torch.int64)
        table[:, :TABLE_FIELDS] = torch.tensor([row for _, row, _ in rows], dtype=torch.int64)
        # items of up to table_blocks blocks of one tensor: item k of a tensor starts at block k * table_blocks
        nblocks = torch.tensor([blocks for _, _, blocks in rows], dtype=torch.int64)
        nitems = -(-nblocks // config.table_blocks)
        index = torch.repeat_interleave(torch.arange(len(rows)), nitems)
        k = torch.arange(len(index)) - torch.repeat_interleave(torch.cumsum(nitems, 0) - nitems, nitems)
        first = k * config.table_blocks
        last = torch.minimum(nblocks[index] - first, torch.tensor(config.table_blocks))
        work = torch.stack([index, first, last], dim=1).to(torch.int32)
        bucket = buckets[key]
        bucket.small = [i for i, _, _ in rows]
        bucket.small_index = torch.tensor(bucket.small, dtype=torch.int64)
        bucket.rows = table
        bucket.work, bucket.tensors, bucket.items = to_device(work, device), to_device(table, device), len(work)
    for bucket in buckets.values():
        if bucket.large:
            bucket.cell_rows = torch.zeros((len(bucket.large), 2), dtype=torch.int64)
            bucket.cell_rows[:, 0] = torch.tensor([large[2][GRAD_COLUMN] for large in bucket.large])
            bucket.cells = to_device(bucket.cell_rows, device)
            for k, large in enumerate(bucket.large):
                large.append(bucket.cells[k])
    return Plan(list(buckets.values()), device, layout, param_ptrs, [p.numel() for p in params],
                 [g.dtype for g in grads], list(map(_data_ptr, grads)))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)  # no wait for the work queued before the step


def pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of CPU tensor ``t`` for an asynchronous copy to the device (the caching host allocator
    keeps it until that copy ran); ``t`` itself where no GPU is (a copy into a CPU table)."""
    return t.pin_memory() if torch.cuda.is_available() else t



class PlanCache:
    """Cached plans of one launch configuration, most recently used first, at most ``capacity``. A list, not
    a dict keyed by the parameter addresses: comparing lists of ints stops at the first difference, where
    hashing a key walks all of it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._plans: list[Plan] = []

    def find(self, layout: tuple, param_ptrs: list[int], first: Sequence[torch.Tensor]) -> Plan | None:
        """The plan of these parameters, layout and first state list, moved to the front; or None."""
        ids = None
        for plan in self._plans:
            if plan.param_ptrs == param_ptrs and plan.layout == layout:
                if ids is None:
                    ids = list(map(id, first))
                if plan.state_ids == ids:
                    if self._plans[0] is not plan:
                        self._plans.remove(plan)
                        self._plans.insert(0, plan)
                    return plan
        return None

    def add(self, plan: Plan) -> None:
        """Put ``plan`` first, dropping the least recently used beyond ``capacity``."""
        self._plans.insert(0, plan)
        del self._plans[self.capacity:]

    def discard(self, plan: Plan) -> None:
        if plan in self._plans:
            self._plans.remove(plan)

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __iter__(self) -> Iterator[Plan]:
        return iter(list(self._plans))


_CACHES: dict[LaunchConfig, PlanCache] = {}
# Plans launched inside a CUDA graph capture: a graph replays their device tables, so they are kept (not only
# cached, which can drop them) until one of their state tensors is freed, when the graph is void anyway.
_CAPTURED: dict[Plan, int] = {}  # plan -> graphs that hold it
_COLLECTORS: list[list[Plan]] = []


def keep_captured(plan: Plan) -> None:
    """Keep ``plan`` (and its device tables, which it never changes again) alive for the CUDA graph being
    captured; within ``collect_captured()``, also note it there, for ``release_captured``."""
    _CAPTURED[plan] = _CAPTURED.get(plan, 0) + 1
    if _COLLECTORS:
        _COLLECTORS[-1].append(plan)


def collecting() -> bool:
    """Whether a capture inside ``collect_captured`` is under way: its owner points the plans it collects at
    the gradients of each replay (``Plan.retarget``) before the replay, so that a launch captured there may
    use a plan whose tables hold other gradient addresses."""
    return bool(_COLLECTORS)


@contextlib.contextmanager
def collect_captured() -> Iterator[list[Plan]]:
    """The plans the launches inside this block keep for a graph (``flashdist.GraphedStep``'s, which points
    them at each replay's gradients with ``Plan.retarget`` and releases them with ``release_captured`` when
    it drops the graph). Plans kept for graphs a caller captured otherwise stay kept until their state is
    freed."""
    plans: list[Plan] = []
    _COLLECTORS.append(plans)
    try:
        yield plans
    finally:
        _COLLECTORS.remove(plans)


def release_captured(plans: list[Plan]) -> None:
    """A graph that held ``plans`` (``collect_captured``) is gone: each is kept for one graph fewer."""
    for plan in plans:
        held = _CAPTURED.get(plan, 0)
        if held > 1:
            _CAPTURED[plan] = held - 1
        else:
            _CAPTURED.pop(plan, None)


def cache_for(config: LaunchConfig) -> PlanCache:
    """The plan cache of ``config`` (made on first use)."""
    cache = _CACHES.get(config)
    if cache is None:
        cache = _CACHES[config] = PlanCache(config.plan_cache_size)
    return cache


def cached_plans(config: LaunchConfig | None = None) -> tuple[Plan, ...]:
    """The plans cached for ``config`` (default: ``config.current()``), most recently used first."""
    cache = _CACHES.get(config if config is not None else current())
    return tuple(cache) if cache is not None else ()


def clear_plans() -> None:
    """Drop every cached launch plan, of every configuration: the next step of each call site rebuilds its
    plan (for benchmarks that time plan building, tests that count builds, or to release the plans' small
    device tables at once). Plans a CUDA graph captured keep their tables until their state is freed."""
    for cache in _CACHES.values():
        cache.clear()
    _CACHES.clear()
