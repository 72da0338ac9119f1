"""``GraphedStep``: an optimizer's step captured once in a CUDA graph and replayed, with the checks that make a
replay safe and an eager step wherever one is not.

A step over thousands of tensors spends more time on the host (Python, launches) than the GPU spends on it.
A capturable flashdist optimizer (``capturable=True``: the step count and the update's scalars live on the
device) can be captured in a CUDA graph, as torch.optim's capturable optimizers can; a replay runs the whole
step with no host work. But a graph holds the addresses it was captured with: replayed after the gradients
moved (``zero_grad(set_to_none=True)`` frees them, and the next backward pass may allocate them elsewhere),
it would read freed memory. ``GraphedStep`` compares, at every call, what the graph was captured for (the
gradient and parameter addresses, the optimizer's step plans, the hyper-parameters) and replays only where
all are the same; otherwise it steps eagerly, and captures again once a step sees the same tensors as the one
before. Results are the same bits either way. The addresses are compared in C++ (``flashdist.kernels.host``,
built at first use: a few nanoseconds per tensor), or in Python where it cannot be built (a few hundred).
"""

from __future__ import annotations

import itertools
import operator

import torch

from . import distributed as D
from .kernels import host
from .optim.base import FlashOptimizer

_GRAD = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr


def _addresses(tensors: list) -> list[int]:
    """Storage addresses (0 for None; a DTensor's local shard), with one C-level pass in the common case."""
    if any(map(operator.is_, tensors, itertools.repeat(None))):
        return [0 if t is None else D.local(t).data_ptr() for t in tensors]
    if any(map(D.is_dtensor, tensors[:1])):
        return [D.local(t).data_ptr() for t in tensors]
    return list(map(_data_ptr, tensors))


def _setting(value):
    return id(value) if isinstance(value, torch.Tensor) else value


class GraphedStep:
    """Call it in place of ``optimizer.step()``: the first call steps eagerly (the warm-up a capture needs), a
    call that finds the same tensors as the one before captures the step in a CUDA graph and replays it, and
    later calls replay it for as long as nothing it reads moved.

    Args:
        optimizer: a flashdist optimizer whose param groups are ``capturable=True`` and whose parameters are
            on one CUDA device.

    A float learning rate (what LR schedulers set) is copied at each call into a device tensor the graph
    reads, so schedules need no recapture; a learning rate given as a tensor on the device is read where it
    is. Any other hyper-parameter changed, a parameter given or denied a gradient, a gradient or parameter
    at a new address, or state replaced (``load_state_dict``) makes that call an eager step. Not seen: the
    data of a tensor swapped in place (``.data =`` or ``set_`` on a gradient keeps its Python object but
    not always its address, which is compared; on a state tensor, nothing is compared).

    ``captures``, ``replays`` and ``eager_steps`` count what the calls did.
    """

    def __init__(self, optimizer: FlashOptimizer):
        if not isinstance(optimizer, FlashOptimizer):
            raise TypeError(f"flashdist: GraphedStep takes a flashdist optimizer, got {type(optimizer).__name__}")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("flashdist: GraphedStep got an optimizer without parameters")
        not_capturable = [i for i, group in enumerate(optimizer.param_groups) if not group.get("capturable", False)]
        if not_capturable:
            raise ValueError(f"flashdist: GraphedStep needs capturable=True in every param group; param_groups "
                             f"{not_capturable} are not (build the optimizer with capturable=True)")
        devices = {D.local(p).device for p in params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError("flashdist: GraphedStep needs the parameters on one CUDA device, got "
                             f"{sorted(map(str, devices))}")
        self.optimizer = optimizer
        self.device = next(iter(devices))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = self.replays = self.eager_steps = 0
        self._host = host.load()  # the compiled address check (None: the same in Python)
        self._settings = None  # what _settings_key gave at the last call
        self._seen: list[list] = []  # per group: [its params list, param addresses, grad addresses] at the last call
        # one fp64 device tensor per group, read by the graph in place of a float learning rate
        self._lr = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in optimizer.param_groups]
        self._lr_written: list[float | None] = [None] * len(optimizer.param_groups)

    def _settings_key(self) -> tuple:
        """The optimizer's step plans (they change with its state tensors) and each group's settings other than
        a float learning rate."""
        return (self.optimizer.plan_generation, *(
            (len(group["params"]), id(group["lr"]) if isinstance(group["lr"], torch.Tensor) else float,
             tuple((k, _setting(v)) for k, v in group.items() if k not in ("params", "lr", "param_names")))
            for group in self.optimizer.param_groups))

    def _unchanged(self) -> bool:
        """Whether everything a replay reads is where the last call found it; records what this call finds."""
        settings = self._settings_key()
        same = settings == self._settings
        self._settings = settings
        groups = self.optimizer.param_groups
        if len(self._seen) != len(groups):
            self._seen = [[None, None, None] for _ in groups]
        for group, seen in zip(groups, self._seen):
            params = group["params"]
            if seen[0] is not params or len(seen[1]) != len(params):
                seen[:] = [params, *torch.zeros((2, len(params)), dtype=torch.int64)]
                same = False
            if self._addresses_changed(params, seen[1], seen[2]):
                same = False
        return same

    def _addresses_changed(self, params: list, param_seen: torch.Tensor, grad_seen: torch.Tensor) -> bool:
        if self._host is not None:
            try:  # (both lists are recorded, whatever the first finds)
                return self._host.addresses_changed(params, False, param_seen) | \
                    self._host.addresses_changed(params, True, grad_seen)
            except RuntimeError:  # DTensors (no storage of their own): their local tensors, in Python
                pass
        changed = False
        for seen, addresses in ((param_seen, _addresses(params)), (grad_seen, _addresses(list(map(_GRAD, params))))):
            new = torch.tensor(addresses, dtype=torch.int64)
            if not torch.equal(new, seen):
                seen.copy_(new)
                changed = True
        return changed

    def _write_lrs(self) -> None:
        """Copy each group's float learning rate to the device tensor the graph reads (where it changed)."""
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group["lr"]
            if not isinstance(lr, torch.Tensor) and lr != self._lr_written[i]:
                self._lr[i].fill_(float(lr))
                self._lr_written[i] = lr

    def _capture(self) -> None:
        groups = self.optimizer.param_groups
        floats = [(group, group["lr"]) for group in groups if not isinstance(group["lr"], torch.Tensor)]
        graph = torch.cuda.CUDAGraph()
        try:
            for i, group in enumerate(groups):  # the graph reads the device copy of a float learning rate
                if not isinstance(group["lr"], torch.Tensor):
                    group["lr"] = self._lr[i]
            with torch.cuda.graph(graph):
                self.optimizer.step()
        finally:
            for group, lr in floats:
                group["lr"] = lr
        self.graph = graph
        self.captures += 1

    @torch.no_grad()
    def __call__(self) -> None:
        unchanged = self._unchanged()
        if unchanged and self.graph is None:
            # the last call stepped eagerly with these very tensors (a warm-up): capture, then replay below
            self._write_lrs()
            self._capture()
        if unchanged:
            self._write_lrs()
            self.graph.replay()
            self.replays += 1
            return
        self.graph = None  # captured for other tensors: dropped (its memory pool is freed)
        self.optimizer.step()
        self.eager_steps += 1
        self._settings = self._settings_key()  # (the step may have made new plans)
