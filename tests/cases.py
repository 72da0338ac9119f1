"""The optimizer test cases: every flashdist optimizer, its float64 reference and its error model, and the
matrix of options (parameter dtype x master_weight_bits x moment storage) each runs under.

Adding an optimizer is one entry of ``OPTIMIZERS``: its class and options, its functional step, the float64
optimizer it must follow, and the size of its update (what its tolerances are stated in). Every test that
runs "each optimizer" takes the entries from here:
- tests/test_optim.py runs every entry through the same checks: the trajectory against float64, the
  backends against the eager reference bit for bit, odd shapes, and a state_dict round trip in the middle of
  a run;
- tests/test_cpu_kernel.py calls each entry's functional step (``Optimizer.functional_step``, with the
  hyper-parameters of its options) on the fused CPU step and the reference, bit for bit;
- tests/distributed/sharding_cases.py picks its sharded-vs-one-process configurations as ``Case`` values,
  at least one per optimizer class.

The error model. After ``k`` steps, ``|flash master weight - float64|`` of an element of row ``r`` stays under
``k * (lr * u_r * (arith + quant) + grid)``:
- ``u_r``, the size of one update in units of lr: 1 for Adam (a normalised step) and Lion (a sign), the row's
  gradient scale for SGD (lr times a momentum buffer of the gradients' size);
- ``arith``: fp32 arithmetic on the update, in units of ``lr * u_r``;
- ``quant``: what 8-bit moments add, in units of ``lr * u_r``: a few code steps of the group scale for
  companded codes; linear codes (the paper's ablation) round small second moments to zero, so single Adam
  updates can be several times lr; a Lion momentum whose sign flips moves a coordinate 2 lr the other way;
- ``grid``: each step rounds the master weight to its grid at the largest |weight| of the run: half a rho step
  (2^-7 or 2^-15 of half an ulp of the parameter format) with rho, half an ulp of the format without, plus
  a few fp32 roundings (fp32 master weights, and the fp32 arithmetic that rebuilds the weight).
These are bounds a correct implementation stays under, not fitted values.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial

import torch

from flashdist import FlashAdam, FlashAdamW, FlashLion, FlashMuon, FlashSGD, FlashSGDW
from flashdist.functional import flash_adam, flash_lion, flash_muon, flash_sgd

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MANTISSA = {"bf16": 8, "fp16": 11}  # significant bits: half an ulp at |w| in [2^e, 2^e+1) is 2^(e - MANTISSA)
RHO_STEPS = {24: 127, 32: 32767}  # rho splits half an ulp into this many steps
# moment storage -> (quantize_states, companded)
MOMENTS = {"q-comp": (True, True), "q-linear": (True, False), "fp32m": (False, True)}


class Lion64:
    """Lion in float64, as published (decoupled weight decay, sign of the interpolation)."""

    def __init__(self, p, lr, betas, weight_decay):
        self.p, self.lr, self.betas, self.wd = p, lr, betas, weight_decay
        self.m = torch.zeros_like(p)

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        self.p.mul_(1 - self.lr * self.wd)
        self.p.add_(torch.sign(self.m * b1 + self.p.grad * (1 - b1)), alpha=-self.lr)
        self.m.mul_(b2).add_(self.p.grad, alpha=1 - b2)


class SGDW64:
    """torch.optim.SGD without weight decay, after a decoupled decay of the weights (FlashSGDW's order)."""

    def __init__(self, p, lr, weight_decay, **kwargs):
        self.p, self.factor = p, 1 - lr * weight_decay
        self.sgd = torch.optim.SGD([p], lr=lr, weight_decay=0.0, foreach=False, **kwargs)

    @torch.no_grad()
    def step(self):
        self.p.mul_(self.factor)
        self.sgd.step()


class Muon64:
    """torch.optim.Muon's update in float64, Newton-Schulz included, for a matrix (a parameter of two or more
    dims, as ``(shape[0], prod(shape[1:]))``); torch.optim.AdamW in float64 for the rest (FlashMuon's
    ``use_muon=False`` groups, as ``muon_groups`` makes them)."""

    def __init__(self, p, lr, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, eps=1e-7,
                 adjust_lr_fn=None, adamw_betas=(0.9, 0.999), adamw_eps=1e-8):
        self.p, self.lr, self.wd, self.mu, self.nesterov = p, lr, weight_decay, momentum, nesterov
        self.ns_steps, self.eps, self.adjust_lr_fn = ns_steps, eps, adjust_lr_fn
        self.adamw = None if p.ndim >= 2 else torch.optim.AdamW(
            [p], lr=lr, betas=adamw_betas, eps=adamw_eps, weight_decay=weight_decay, foreach=False)
        self.buf = torch.zeros_like(p)

    @torch.no_grad()
    def step(self):
        if self.adamw is not None:
            self.adamw.step()
            return
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _adjust_lr

        g = self.p.grad
        self.buf.lerp_(g, 1 - self.mu)
        u = g.lerp(self.buf, self.mu) if self.nesterov else self.buf
        x = u.reshape(u.shape[0], math.prod(u.shape[1:]))
        rows, cols = x.shape
        x = x.T if rows > cols else x
        x = x / x.norm().clamp(min=self.eps)
        for _ in range(self.ns_steps):
            gram = x @ x.T
            x = DEFAULT_A * x + (DEFAULT_B * gram + DEFAULT_C * gram @ gram) @ x
        x = x.T if rows > cols else x
        self.p.mul_(1 - self.lr * self.wd)
        self.p.add_(x.reshape(self.p.shape), alpha=-_adjust_lr(self.lr, self.adjust_lr_fn, (rows, cols)))


def muon_groups(params) -> list[dict]:
    """FlashMuon's param groups for parameters given as any torch optimizer takes them (tensors, named
    tensors, group dicts): each group split into its matrices (``use_muon=True``) and the rest (False)."""
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    out = []
    for group in groups:
        entries = list(group["params"])
        matrix = [(e[1] if isinstance(e, tuple) else e).ndim >= 2 for e in entries]
        for use_muon in (True, False):
            part = [e for e, m in zip(entries, matrix) if m == use_muon]
            if part:
                # (Muon64 takes a weight of more than 2 dims as one matrix: flatten=True)
                out.append({**group, "params": part, "use_muon": use_muon, **({"flatten": True} if use_muon else {})})
    return out


def _torch(cls):
    return lambda p, **kw: cls([p], foreach=False, **kw)


# what the caller of a functional step gives on each call; the rest of its keywords are hyper-parameters
_PER_CALL = {"cols", "step", "companded", "skipped", "backend"}


@dataclass(frozen=True)
class Optimizer:
    """One optimizer configuration under test: what the tests need to run it, call its functional step and
    judge it. ``dtypes``, ``bits`` and ``quant`` bound the float64 comparisons of tests/test_optim.py (where
    its error model holds); bit-for-bit comparisons run every combination."""

    name: str  # the pytest id's first part
    cls: type  # the flashdist optimizer
    kwargs: dict  # its options, given to the reference too (lr, master weights and moments come from the Case)
    step: Callable  # its functional step, with the arguments the class fixes (decoupled=) bound
    reference: Callable  # reference(p, lr=, **kwargs): the float64 optimizer that steps the float64 copy p
    lr: float
    update: str  # "unit" (|update| = lr: Adam, Lion) or "gradient" (lr times the gradients' size: SGD)
    arith: float  # error of fp32 arithmetic per step, in units of the update
    quant: dict  # moment storage -> its error per step, in units of the update; storages absent are not run
    max_flipped: float | None = None  # sign updates: the fraction of coordinates allowed to end > lr apart
    groups: Callable | None = None  # params -> the param groups the optimizer is built with (default: as given)
    elementwise: bool = True  # each value's step reads its own group only (FlashMuon's reads its whole matrix)
    backends: tuple = ("cpu", "triton")  # fused backends it has besides the eager reference
    dtypes: tuple = tuple(DTYPES)  # parameter dtypes it runs with
    bits: tuple = (24, 32, None)  # master_weight_bits it runs with (bf16 and fp16 parameters)

    def make(self, params, *, bits=24, moments="q-comp", lr=None, **options):
        quantize, companded = MOMENTS[moments]
        if self.groups is not None:
            params = self.groups(params)
        return self.cls(params, lr=self.lr if lr is None else lr, master_weight_bits=bits,
                        quantize_states=quantize, companded=companded, **self.kwargs, **options)

    @cached_property
    def _group(self) -> tuple[dict, tuple[str, ...]]:
        optimizer = self.make([torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))])
        group = optimizer.param_groups[0]
        return group, optimizer.moments_of(group)

    @property
    def moments(self) -> tuple[str, ...]:
        """The state names of the moments it keeps, in the functional step's order (none: SGD without
        momentum)."""
        return self._group[1]

    @property
    def hyperparameters(self) -> dict:
        """The functional step's hyper-parameters (lr, betas as beta1 and beta2, ...), read from the param
        group the optimizer builds from ``lr`` and ``kwargs``: the class's defaults fill in the rest, as for
        a user."""
        group = self._group[0]
        values = dict(group, **dict(zip(("beta1", "beta2"), group.get("betas", ()))))
        return {p.name: values[p.name] for p in inspect.signature(self.step).parameters.values()
                if p.kind is p.KEYWORD_ONLY and p.name in values and p.name not in _PER_CALL}

    def functional_step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], moments: list,
                        scales: list, rhos, *, step: int, **per_call):
        """One call of its functional step on lists of local tensors: ``moments`` and ``scales`` hold one
        list per entry of ``moments`` (a scale list is None for fp32 moments); ``per_call`` holds cols,
        companded, skipped and backend."""
        signature = inspect.signature(self.step).parameters
        if not moments:  # SGD without momentum: None where the buffer and its scales would be
            slots = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in signature.values()) - 3  # params, grads, rhos
            moments, scales = [None] * (slots // 2), [None] * (slots // 2)
        if "step" in signature:  # Lion's update has no bias correction: its step takes no step count
            per_call["step"] = step
        self.step(params, grads, *moments, *scales, rhos, **self.hyperparameters, **per_call)


# companded 8-bit moments: a few code steps of the group scale, a few percent of the update (coupled L2 decay
# is the worst case: docs/method.md explains its sticky +-1 codes); SGD's buffer is <= 10 gradients with
# momentum 0.9, so a few percent of it is 0.15 of a gradient
ADAM_QUANT = {"q-comp": 0.1, "q-linear": 5.0, "fp32m": 0.0}
SGD_QUANT = {"q-comp": 0.15, "fp32m": 0.0}
# Muon's update is adjusted_lr * O: |O| <= 1.5 (the quintic's singular values end in [0.5, 1.5]) times the lr
# ratio, 1 for the (16, 96) trajectories and at most sqrt(5) for the odd shapes; bf16 Newton-Schulz rounds
# O's inputs and each of its 2 * ns_steps + 1 products to 8 bits (2^-9 relative each): 0.023 of |O|, so
# 0.023 * 1.5 * sqrt(5) = 0.08 of lr. 8-bit momentum perturbs U by (2/254 + 2^-8) of each group's absmax,
# which Newton-Schulz passes on with a gain of a few units
MUON_ARITH = 0.1
MUON_QUANT = {"q-comp": 0.1, "q-linear": 0.2, "fp32m": 0.0}
_SGD = dict(cls=FlashSGD, step=partial(flash_sgd, decoupled=False), reference=_torch(torch.optim.SGD), lr=1e-2,
            update="gradient", arith=1e-3, quant=SGD_QUANT)

OPTIMIZERS = {o.name: o for o in [
    Optimizer("adamw", FlashAdamW, dict(weight_decay=0.1), partial(flash_adam, decoupled=True),
              _torch(torch.optim.AdamW), lr=1e-3, update="unit", arith=1e-5, quant=ADAM_QUANT),
    # L2 decay adds wd * theta to the gradient; a small wd keeps that term from dominating tiny-gradient rows,
    # where 8-bit momentum codes stuck at +-1 (a property of round-to-nearest EMAs) would dominate the
    # comparison (docs/method.md)
    Optimizer("adam-l2", FlashAdam, dict(weight_decay=1e-3), partial(flash_adam, decoupled=False),
              _torch(torch.optim.Adam), lr=1e-3, update="unit", arith=1e-5, quant=ADAM_QUANT, dtypes=("bf16",)),
    Optimizer("sgd-momentum", kwargs=dict(momentum=0.9, weight_decay=1e-3), **_SGD),
    Optimizer("sgd-nesterov", kwargs=dict(momentum=0.9, nesterov=True, weight_decay=1e-3), **_SGD),
    Optimizer("sgd-dampening", kwargs=dict(momentum=0.9, dampening=0.5), **_SGD),
    Optimizer("sgd-plain", kwargs=dict(weight_decay=1e-3), **{**_SGD, "quant": {"q-comp": 0.0, "fp32m": 0.0}}),
    Optimizer("sgdw", FlashSGDW, dict(momentum=0.9, weight_decay=0.1), partial(flash_sgd, decoupled=True), SGDW64,
              lr=1e-2, update="gradient", arith=1e-3, quant=SGD_QUANT),
    # Without rho, Lion's lr-sized steps below half a bf16/fp16 ulp are lost: test_rho_beats_plain_bf16. With
    # 8-bit momentum a flipped sign costs 2 lr at that step; max_flipped keeps that rare
    Optimizer("lion", FlashLion, dict(betas=(0.9, 0.99), weight_decay=0.1), flash_lion, Lion64, lr=1e-2,
              update="unit", arith=1e-3, quant={"q-comp": 2.0, "fp32m": 0.0}, max_flipped=0.05, bits=(24, 32)),
    # Matrices: Newton-Schulz runs in bf16 (as torch.optim.Muon's), against float64 here: MUON_ARITH. 1-d and
    # 0-d parameters take the AdamW groups' update (muon_groups). Bitwise against torch.optim.Muon:
    # tests/test_muon.py
    Optimizer("muon", FlashMuon, dict(weight_decay=0.1), flash_muon, Muon64, lr=1e-2, update="unit",
              arith=MUON_ARITH, quant=MUON_QUANT, groups=muon_groups, elementwise=False,
              backends=("triton", "cpu")),
]}


@dataclass(frozen=True)
class Case:
    """An optimizer under one set of options; ``id`` is its pytest id."""

    opt: Optimizer
    dtype: str = "bf16"
    bits: int | None = 24
    moments: str = "q-comp"
    backend: str = "auto"

    @property
    def id(self) -> str:
        bits = "" if self.dtype == "fp32" else f"-{self.bits or 'nosplit'}"
        backend = "" if self.backend == "auto" else f"-{self.backend}"
        return f"{self.opt.name}-{self.dtype}{bits}-{self.moments}{backend}"

    def make(self, params, **options):
        return self.opt.make(params, bits=self.bits, moments=self.moments, backend=self.backend, **options)


def matrix(opt: Optimizer, backend: str = "auto") -> list[Case]:
    """Every parameter dtype x master_weight_bits x moment storage that ``opt`` runs under (fp32 parameters
    are never split: they run once per moment storage, with master_weight_bits=None as fp32 training asks)."""
    return [Case(opt, d, b if d != "fp32" else None, m, backend)
            for d, b, m in itertools.product(opt.dtypes, opt.bits, opt.quant) if d != "fp32" or b == opt.bits[0]]


CASES = [case for opt in OPTIMIZERS.values() for case in matrix(opt)]


def problem(shape, steps: int, seed: int = 0):
    """A float64 start, gradients whose scale spans 1e-3 to 10 across rows, and that scale per element."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=g, dtype=torch.float64)
    rows = shape[0] if len(shape) else 1
    scale = torch.logspace(-3, 1, rows, dtype=torch.float64).reshape((-1,) + (1,) * (len(shape) - 1)) \
        if len(shape) else torch.tensor(1.0, dtype=torch.float64)
    grads = [torch.randn(shape, generator=g, dtype=torch.float64) * scale for _ in range(steps)]
    return w0, grads, scale


def grid(dtype: str, bits, max_abs: float) -> float:
    """The per-step rounding of the master weight at |w| <= max_abs (see the module docstring)."""
    e = torch.tensor(max(max_abs, 2.0**-126)).log2().floor().item()
    fp32 = 4 * 2.0 ** (e - 24)
    if dtype == "fp32":
        return fp32
    half_ulp = 2.0 ** (e - MANTISSA[dtype])
    return fp32 + (half_ulp / RHO_STEPS[bits] / 2 if bits else half_ulp)


@dataclass
class Result:
    ratio: float  # worst |flash - float64| over steps and elements, divided by its bound (<= 1 passes)
    per_step: float  # worst |flash - float64| / (k * lr), over steps k and elements
    flipped: float  # fraction of coordinates that end more than lr apart
    final: float  # max |flash - float64| at the end


def run_pair(case: Case, *, shape=(16, 96), steps: int = 20, lr: float | None = None, seed: int = 0) -> Result:
    """Run ``case`` and its float64 reference on the same gradients (the flashdist gradients rounded to the
    parameter dtype, the reference's their exact float64 value)."""
    opt = case.opt
    lr = opt.lr if lr is None else lr
    w0, grads, scale = problem(shape, steps, seed)
    p = torch.nn.Parameter(w0.to(DTYPES[case.dtype]))
    ref = torch.nn.Parameter(p.detach().double().clone())
    flash = case.make([p], lr=lr)
    ropt = opt.reference(ref, lr=lr, **opt.kwargs)
    unit = scale if opt.update == "gradient" else torch.ones_like(scale)
    quant = opt.quant[case.moments]
    diffs, max_abs = [], 1.0 if not w0.numel() else w0.abs().max().item()
    for gr in grads:
        p.grad = gr.to(p.dtype)
        ref.grad = p.grad.double()
        flash.step()
        ropt.step()
        master = flash.master_weight(p).double()
        diffs.append((master - ref.detach()).abs())
        if w0.numel():
            max_abs = max(max_abs, master.abs().max().item(), ref.detach().abs().max().item())
    g = grid(case.dtype, case.bits, max_abs)
    ratio = per_step = 0.0
    for k, diff in enumerate(diffs, 1):
        if diff.numel():
            ratio = max(ratio, (diff / (k * (lr * unit * (opt.arith + quant) + g))).max().item())
            per_step = max(per_step, diff.max().item() / (k * lr))
    final = diffs[-1]
    return Result(ratio, per_step, (final > lr).double().mean().item() if final.numel() else 0.0,
                  final.max().item() if final.numel() else 0.0)
