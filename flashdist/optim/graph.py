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

from .. import distributed as D
from ..errors import CaptureRefused
from ..kernels import host
from ..kernels.triton import plans
from .params import check_number

_GRAD = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr


def _addresses(tensors: list) -> list[int]:
    """Storage addresses (0 for None; a DTensor's local shard), with one C-level pass in the common case."""
    if any(map(operator.is_, tensors, itertools.repeat(None))) or any(map(D.is_dtensor, tensors)):
        return [0 if t is None else D.local(t).data_ptr() for t in tensors]
    return list(map(_data_ptr, tensors))


def _setting(value):
    return id(value) if isinstance(value, torch.Tensor) else value


class GraphedStep:
    """Call it in place of ``optimizer.step()``: the first call steps eagerly (the warm-up a capture needs), a
    call that finds the same tensors as the one before captures the step in a CUDA graph and replays it, and
    later calls replay it for as long as nothing it reads moved.

    Args:
        optimizer: a flashdist optimizer built with ``capturable=True``, whose parameters are on one
            CUDA device and whose backend is the Triton kernel ("auto" or "triton").

    A float learning rate (what LR schedulers set), or one in a CPU tensor, is copied at each call into a
    device tensor the graph reads (checked as ``step()`` checks it), so schedules need no recapture; a learning
    rate in a tensor on the parameters' device is read where it is. Any other hyper-parameter changed, a
    parameter given or denied a gradient, a gradient or parameter at a new address (FSDP2's DTensors by their
    local shards), a param group added, or state replaced (``load_state_dict``) makes that call an eager step.
    A step the graph cannot capture (parameters at different step counts: ``flashdist.errors.CaptureRefused``)
    runs eagerly until something changes. Not seen: data swapped into a state tensor in place (``set_``,
    ``.data =``); the optimizer itself does not.

    Step hooks run when ``optimizer.step()`` runs: at eager steps and at the capture, not at replays (a
    ``graphed=True`` optimizer runs its own GraphedStep inside ``step()``, so its hooks run at every step).
    ``captures``, ``replays`` and ``eager_steps`` count what the calls did. ``eager``: the step an eager call
    and the capture run (default ``optimizer.step``). ``strict=False``: a call that finds the optimizer no
    longer fit for a graph (the checks of the constructor: a group emptied, parameters moved off the GPU)
    steps eagerly instead of raising, until the settings change again.
    """

    def __init__(self, optimizer, *, eager=None, strict: bool = True):
        if not hasattr(optimizer, "plan_generation"):  # (a FlashOptimizer: base.py imports this module)
            raise TypeError(f"flashdist: GraphedStep takes a flashdist optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._eager = eager or optimizer.step  # what an eager step and the capture run
        self._strict = strict  # False: a later call that fails the constructor's checks steps eagerly instead
        self._unusable = False  # (not strict) the last checks failed: eager steps until the settings change
        self.device = self._check()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = self.replays = self.eager_steps = 0
        self._host = host.load()  # the compiled address check (None: the same in Python)
        self._settings = None  # what _settings_key gave at the last call
        self._seen: list[list] = []  # per group: [its params list, param addresses, grad addresses] at the last call
        self._plans: list = []  # the launch plans the graph holds (kernels.triton.plans.collect_captured)
        self._refused = False  # the last capture was refused: none is tried until something changes
        # one fp64 device tensor per group, read by the graph in place of a float learning rate
        self._lr: list[torch.Tensor] = []
        self._lr_written: list[float | None] = []

    def _check(self) -> torch.device:
        """The parameters' device, after the checks of the constructor (run again when the groups change)."""
        optimizer = self.optimizer
        if optimizer.backend not in ("auto", "triton"):
            raise ValueError(f"flashdist: GraphedStep needs the Triton kernel; the optimizer's backend is "
                             f"{optimizer.backend!r} (use backend='auto' or 'triton')")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("flashdist: GraphedStep got an optimizer without parameters")
        if not optimizer.capturable:
            raise ValueError("flashdist: GraphedStep needs an optimizer built with capturable=True")
        devices = {D.local(p).device for p in params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError("flashdist: GraphedStep needs the parameters on one CUDA device, got "
                             f"{sorted(map(str, devices))}")
        return next(iter(devices))

    def _device_lr(self, lr) -> bool:
        return isinstance(lr, torch.Tensor) and lr.device == self.device

    def _settings_key(self) -> tuple:
        """The optimizer's step plans (they change with its state tensors), backend and capturable, and each group's
        settings other than a learning rate the graph does not hold."""
        return (self.optimizer.plan_generation, self.optimizer.backend, self.optimizer.capturable, *(
            (len(group["params"]), id(group["lr"]) if self._device_lr(group["lr"]) else float,
             tuple((k, _setting(v)) for k, v in group.items() if k not in ("params", "lr", "param_names")))
            for group in self.optimizer.param_groups))

    def _unchanged(self) -> bool:
        """Whether everything a replay reads is where the last call found it; records what this call finds."""
        settings = self._settings_key()
        same = settings == self._settings
        if not same:
            try:
                device = self._check()  # (a group added, a setting changed: the same checks as the constructor's)
            except ValueError:
                if self._strict:
                    raise
                self._unusable = True
            else:
                self._unusable = False
                if device != self.device:  # (parameters moved to another GPU)
                    self.device, self._seen = device, []
        self._settings = settings
        if self._unusable:
            return False
        groups = self.optimizer.param_groups
        if len(self._seen) != len(groups):
            self._seen = [[None, None, None] for _ in groups]
            self._lr = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in groups]
            self._lr_written = [None] * len(groups)
        dtensors = bool(self.optimizer._dtensor_groups)
        for group, seen in zip(groups, self._seen):
            params = group["params"]
            if seen[0] is not params or len(seen[1]) != len(params):
                seen[:] = [params, *torch.zeros((2, len(params)), dtype=torch.int64)]
                same = False
            if self._addresses_changed(params, seen[1], seen[2], dtensors):
                same = False
        return same

    def _addresses_changed(self, params: list, param_seen: torch.Tensor, grad_seen: torch.Tensor,
                           dtensors: bool = False) -> bool:
        if self._host is not None and not dtensors:
            try:  # (both lists are recorded, whatever the first finds)
                return self._host.addresses_changed(params, False, param_seen) | \
                    self._host.addresses_changed(params, True, grad_seen)
            except RuntimeError:  # a tensor without data of its own (a DTensor): in Python, its local tensor
                pass
        changed = False
        for seen, addresses in ((param_seen, _addresses(params)), (grad_seen, _addresses(list(map(_GRAD, params))))):
            new = torch.tensor(addresses, dtype=torch.int64)
            if not torch.equal(new, seen):
                seen.copy_(new)
                changed = True
        return changed

    def _write_lrs(self) -> None:
        """Copy each group's learning rate that the graph does not read in place (a float, a CPU tensor) to the
        device tensor it reads instead, where it changed; checked first, as ``step()`` checks it."""
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group["lr"]
            if self._device_lr(lr):
                continue
            value = float(lr)
            if value != self._lr_written[i]:
                check_number("lr", value, low=0.0)
                self._lr[i].fill_(value)
                self._lr_written[i] = value

    def _capture(self) -> None:
        groups = self.optimizer.param_groups
        held = [(group, group["lr"]) for group in groups if not self._device_lr(group["lr"])]
        graph = torch.cuda.CUDAGraph()
        try:
            for i, group in enumerate(groups):  # the graph reads the device copy of the learning rate
                if not self._device_lr(group["lr"]):
                    group["lr"] = self._lr[i]
            with plans.collect_captured() as kept:
                try:
                    with torch.cuda.graph(graph):
                        self._eager()
                finally:
                    self._plans = kept
        finally:
            for group, lr in held:
                group["lr"] = lr
        self.graph = graph
        self.captures += 1

    def _drop(self) -> None:
        """Drop the graph (its memory pool is freed) and release the launch plans it held."""
        self.graph = None
        plans.release_captured(self._plans)
        self._plans = []

    @torch.no_grad()
    def __call__(self) -> None:
        unchanged = self._unchanged()
        if unchanged and self.graph is None and not self._refused:
            # the last call stepped eagerly with these very tensors (a warm-up): capture, then replay below
            self._write_lrs()
            try:
                self._capture()
            except CaptureRefused:  # nothing changed: step eagerly, and try again once something has
                self._drop()
                self._refused = True
        if unchanged and self.graph is not None:
            self._write_lrs()
            self.graph.replay()
            self.replays += 1
            return
        if not unchanged:
            self._drop()
            self._refused = False
        self._eager()
        self.eager_steps += 1
        self._settings = self._settings_key()  # (the step may have made new plans)
