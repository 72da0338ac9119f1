"""A step's bookkeeping over a fixed list of parameters, built once and reused: the parameters bucketed by
state layout and device, their local tensors as the functional step takes them, and one tensor holding
their step counts."""

from __future__ import annotations

import operator
from collections import defaultdict

import torch

from .. import distributed as D
from ..errors import CaptureRefused
from ..quant.moment import MomentLayout, QuantizedMoment


def refuse_while_capturing(device: torch.device, why: str) -> None:
    """Refuse, before anything changes, a step being captured in a CUDA graph that would need host work a graph
    cannot replay (building plans and state, reading step counts)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise CaptureRefused(f"flashdist: the optimizer step is being captured in a CUDA graph, but {why}; run one "
                           "step with the same parameters, gradients and state before capturing (a warm-up step, as "
                           "torch.cuda.graphs requires), in an optimizer built with capturable=True")


class Bucket:
    """Local tensors of parameters that share one layout (rho or not, quantized or not) and one device."""

    def __init__(self, opt, group: dict, params: list[torch.Tensor], index: list[int]):
        self.index = index
        states = [opt.state[p] for p in params]
        self.device = D.local(params[0]).device
        self.sources = list(params)  # the parameters themselves (DTensors where sharded)
        self.params = [D.local(p) for p in params]
        names = opt.moments_of(group)
        self.quantized = bool(names) and QuantizedMoment.held_in(states[0], names[0])
        self.moments, self.scales = [], []
        for name in names:
            codes_key, scales_key = QuantizedMoment.keys(name) if self.quantized else (name, None)
            self.moments.append([D.local(s[codes_key]) for s in states])
            self.scales.append([D.local(s[scales_key]) for s in states] if self.quantized else None)
        self.rhos = [D.local(s["rho"]) for s in states] if "rho" in states[0] else None
        flat = group.get("flat_layout", False)
        self.cols = ([MomentLayout.of(D.global_shape(p), flat).local(D.local(p).shape).cols for p in params]
                     if self.quantized else None)
        self.dtensor = any(D.is_dtensor(p) for p in params)

    def subset(self, index: list[int]) -> "Bucket":
        keep = [self.index.index(i) for i in index]
        out = object.__new__(Bucket)
        out.__dict__.update(self.__dict__)
        out.index = index
        out.params = [self.params[k] for k in keep]
        out.sources = [self.sources[k] for k in keep]
        out.moments = [[m[k] for k in keep] for m in self.moments]
        out.scales = [[s[k] for k in keep] if s is not None else None for s in self.scales]
        out.rhos = [self.rhos[k] for k in keep] if self.rhos is not None else None
        out.cols = [self.cols[k] for k in keep] if self.cols is not None else None
        return out

    def local_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return [D.local(g) for g in grads] if self.dtensor else grads


class StepPlan:
    """What one step over a fixed list of parameters needs, computed once."""

    def __init__(self, opt, group: dict, params: list[torch.Tensor]):
        self.params = list(params)
        self.dtypes = list(map(_DTYPE, params))  # what each state's rho belongs to (module.to() keeps the objects)
        self.shapes = list(map(_SHAPE, params))  # (p.data = a tensor of another shape keeps the object too)
        self.states = [opt.state[p] for p in params]
        # The parameters' version counters after the optimizer's last write (None: not stepped yet): a
        # parameter whose counter moved since was written outside the optimizer (base.py, stale rho). A
        # DTensor's own counter, which its in-place ops bump (copy_, load_state_dict, nn.init: the local shard's
        # is not, since DTensor runs the local op below autograd); the kernels write the local shard, and
        # neither counter moves. Not for flat_layout groups: DeepSpeed writes its own partitions (views of
        # the buffer it all-gathers into).
        self.watched = None if group.get("flat_layout", False) else list(params)
        self.versions: list[int] | None = None
        # One tensor holds the step counts of all these parameters, and each state["step"] becomes a 0-d view
        # of it: a step increments them all with one add (torch.optim keeps one tensor per parameter; 2,000
        # separate adds cost milliseconds). On the CPU, except for CUDA parameters of a capturable optimizer,
        # where it lives on their device (as torch.optim's capturable steps keep theirs) and the step reads
        # it there, so that a CUDA graph can capture the step.
        self.capturable = capturable(opt, params)
        steps = [s["step"] for s in self.states]
        device = D.local(params[0]).device if self.capturable else torch.device("cpu")
        if all(t.device.type == "cpu" for t in steps):
            self.counts = torch.tensor([float(t) for t in steps], dtype=torch.float32).to(device)
        else:  # counts on a GPU (a capturable optimizer's): gathered there, not read one by one
            self.counts = torch.stack([t.detach().to(steps[0].device, torch.float32).reshape(())
                                       for t in steps]).to(device)
        self.count = self.counts[:1]  # the common count (plan.step is its host copy), read by capturable steps
        for i, s in enumerate(self.states):
            s["step"] = self.counts[i]
        # A loader writing straight into optimizer.state (DeepSpeed's universal checkpoints, so flat_layout
        # groups only) adds keys: counted at each step there, to rebuild the plan from the new state.
        self.sizes = list(map(len, self.states)) if group.get("flat_layout", False) else None
        self.step: int | None = None  # the common step count, once known
        by_layout: dict[tuple, list[int]] = defaultdict(list)
        codes = QuantizedMoment.codes_key(opt.moments_of(group)[0]) if opt.moments_of(group) else None
        for i, (p, s) in enumerate(zip(params, self.states)):
            by_layout[("rho" in s, codes in s, D.local(p).device)].append(i)
        self.buckets = [Bucket(opt, group, [params[i] for i in index], index) for index in by_layout.values()]
        for bucket in self.buckets:
            bucket.everything = len(self.buckets) == 1

    def position(self, p: torch.Tensor) -> int:
        """The index of parameter ``p`` in ``params``."""
        if not hasattr(self, "_position"):
            self._position = {id(q): i for i, q in enumerate(self.params)}
        return self._position[id(p)]

    def matches(self, opt, params: list[torch.Tensor]) -> bool:
        """Same parameters of the same dtypes and shapes, and (flat_layout groups) no state added behind the optimizer's back, and
        ``opt.capturable`` as when built."""
        return (len(params) == len(self.params) and all(map(operator.is_, params, self.params))
                and all(map(operator.is_, map(_DTYPE, params), self.dtypes))
                and list(map(_SHAPE, params)) == self.shapes
                and (self.sizes is None or list(map(len, self.states)) == self.sizes)
                and self.capturable == capturable(opt, params))


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """The version counters of ``tensors`` (torch bumps one at each in-place change made through Python:
    ``copy_``, ``torch.nn.init``, ``load_state_dict``; a kernel writing through a raw pointer does not)."""
    return list(map(_VERSION, tensors))


_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def capturable(opt, params: list[torch.Tensor]) -> bool:
    """Whether a step of ``params`` reads its step count and scalars on their device: CUDA parameters of a
    capturable optimizer (elsewhere there is no graph to capture, and the option changes nothing)."""
    return opt.capturable and D.local(params[0]).device.type == "cuda"
