"""The fused Triton step against the eager reference, BITWISE, on CPU under the Triton interpreter.

How the interpreter is switched on (tests/_interpreter.py). Triton chooses interpreted or compiled when a
``@triton.jit`` function is defined, and that includes its own library (``tl.max``, ``tl.sum``) defined when
triton is imported: one process is in one mode. So:
- on a machine without CUDA, where interpreting is the only way to run triton anyway, importing
  ``_interpreter`` first sets ``TRITON_INTERPRET=1`` before anything imports triton, and the tests run in this
  process;
- when that did not take (CUDA is present, so the GPU tests of this process need compiled kernels, or an
  earlier test module imported triton first), the same tests run in child pytest processes with
  ``TRITON_INTERPRET=1`` and no visible GPU, one per core up to 4, each with a share of the tests:
  ``test_in_interpreter_process`` below.

What the oracle computes. ``reference.adam_step_`` is IEEE arithmetic throughout on CPU, its square root
included (``codes.sqrt_rn``; torch's own vectorised CPU sqrt is not correctly rounded in some builds), so
the kernel must match it bit for bit with no patching. Under the interpreter ``/`` and ``tl.sqrt`` are
numpy's IEEE operations too, so the approximate variant (``EXACT = False``) must match as well; its GPU
bound is tests/test_gpu.py's.

Cost. The interpreter spends tens of milliseconds per program, so the matrix packs every shape and param
dtype of a configuration into one call and uses 64 groups per block (2 blocks per program); the module's
own block sizes have a test of their own.
"""

from __future__ import annotations

import _interpreter  # first: it decides whether this process interprets triton  # isort: skip

import dataclasses  # noqa: E402
import itertools  # noqa: E402
import re  # noqa: E402
import zlib  # noqa: E402

import torch  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
tl = triton.language

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import flashdist.kernels.triton.fused as K  # noqa: E402
from flashdist.kernels.triton import DEFAULT, LaunchConfig, cached_plans, clear_plans, using  # noqa: E402
from flashdist.kernels.triton import programs, rho_bits  # noqa: E402
from flashdist.kernels.triton.bits import SPLIT_LIMIT  # noqa: E402
from flashdist.kernels.triton.config import default_layout  # noqa: E402
from flashdist.kernels import reference  # noqa: E402
from flashdist.kernels.scalars import KERNEL_SLOTS, AdamScalars, LionScalars, SGDScalars  # noqa: E402
from flashdist.quant import codes as Q  # noqa: E402
from flashdist.quant import rho as R  # noqa: E402
from _rho_probe import rho_probe  # noqa: E402

IN_PROCESS = isinstance(triton.language.max, InterpretedFunction) and isinstance(programs.table_kernel,
                                                                                 InterpretedFunction)
# where triton runs compiled in this process, these run in a child process (test_in_interpreter_process) and
# are deselected here (tests/conftest.py)
interpreted = pytest.mark.interpreted
# numpy warns about the inf/NaN arithmetic of groups with a non-finite gradient, which are never stored
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


@pytest.mark.interpreter_runner
def test_in_interpreter_process():
    """The ``interpreted`` tests of this module, in children that interpret triton (tests/_interpreter.py)."""
    done = _interpreter.run_interpreted(__file__, shards=4)
    passed = sum(int(m) for m in re.findall(r"(\d+) passed", done.stdout))
    assert done.returncode == 0 and passed > 0, done.stdout[-6000:] + done.stderr[-3000:]
    print(f"{passed} interpreted tests passed in child processes")


SHAPES = [(1,), (31,), (33,), (4097,), (3, 5, 7), (7, 33), (64, 64), (5, 1), (0, 4), (0,), (130, 33)]
PARAM_DTYPES = {None: (torch.bfloat16, torch.float16, torch.float32),  # rho -> params that can carry it
                torch.int8: (torch.bfloat16, torch.float16), torch.int16: (torch.bfloat16, torch.float16)}
LAYOUTS = {"q-companded": (True, True), "q-linear": (True, False), "fp32-moments": (False, True)}


class Launch:
    """The kernel's launchers under one launch configuration, and the plans cached for it."""

    def __init__(self, config: LaunchConfig):
        self.config = config

    def adam_step_multi(self, *args, **kwargs):
        K.adam_step_multi(*args, config=self.config, **kwargs)

    def sgd_step_multi(self, *args, **kwargs):
        K.sgd_step_multi(*args, config=self.config, **kwargs)

    def lion_step_multi(self, *args, **kwargs):
        K.lion_step_multi(*args, config=self.config, **kwargs)

    def plans(self):
        return cached_plans(self.config)


# 64 groups per block and 2 blocks per program: a tensor of the table launch spans several programs, the last
# one partial
SMALL_BLOCKS = DEFAULT.replace(table_groups=64, table_blocks=2)


@pytest.fixture
def kernels():
    """The launchers under SMALL_BLOCKS, with no plan cached."""
    clear_plans()
    return Launch(SMALL_BLOCKS)


def _cols(shape) -> int:
    """Row length of a tensor viewed as (rows, cols): like the optimizer for 2+ dims, one row for 1-d."""
    if len(shape) >= 2:
        n = 1
        for d in shape[1:]:
            n *= d
        return max(n, 1)
    return max(shape[0], 1)


class Case:
    """One tensor and its state, held twice (kernel and reference copies) from one random draw.

    The state comes from two reference steps on finite gradients, so that the first compared step
    already dequantizes real codes, scales and rho (a random state would pair large first moments with
    tiny second moments and blow parameters up to inf, where NaN -> int conversions are undefined)."""

    def __init__(self, shape, param_dtype, grad_dtype, rho_dtype, quantized, gen, companded=True):
        self.shape, self.grad_dtype, self.quantized = shape, grad_dtype, quantized
        self.cols = _cols(shape)
        n = torch.Size(shape).numel()
        t = {"p": self.draw_param(n, param_dtype, gen)}
        if quantized:
            rows, gpr = n // self.cols, -(-self.cols // Q.GROUP)
            t["m"] = torch.zeros(shape, dtype=torch.int8)
            t["v"] = torch.zeros(shape, dtype=torch.uint8)
            t["ms"] = torch.zeros(rows, gpr, dtype=torch.bfloat16)
            t["vs"] = torch.zeros(rows, gpr, dtype=torch.bfloat16)
        else:
            t["m"], t["v"] = torch.zeros(shape), torch.zeros(shape)
        if rho_dtype is not None:
            t["rho"] = torch.zeros(shape, dtype=rho_dtype)
        for step in (1, 2):
            scalars = AdamScalars.make(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step,
                                       decoupled=True)
            g = self.new_grad(gen, finite=True)
            reference.adam_step_(t["p"], g, t["m"], t["v"], t.get("ms"), t.get("vs"), t.get("rho"),
                                 cols=self.cols if quantized else None, scalars=scalars, companded=companded,
                                 skipped=None)
        self.kernel = t
        self.ref = {k: v.clone() for k, v in t.items()}

    def draw_param(self, n: int, param_dtype, gen) -> torch.Tensor:
        """The parameter, and the gradient magnitude of each run of 32 values (the same at every step: tiny,
        small, unit, huge; a group whose gradient drops by 1e14 from one step to the next sends fp16
        parameters to inf). Parameters span magnitudes, with exact zeros (smallest half-ulp) and fp16
        subnormals."""
        self.magnitudes = torch.tensor([1e-10, 1e-3, 1.0, 1e4])[
            torch.randint(0, 4, (n // 32 + 1,), generator=gen)].repeat_interleave(32)[:n]
        mag = torch.tensor([0.0, 6e-6, 0.02, 1.0, 30.0])[torch.randint(0, 5, (n,), generator=gen)]
        return (torch.randn(n, generator=gen) * mag).reshape(self.shape).to(param_dtype)

    def new_grad(self, gen, finite=False) -> torch.Tensor:
        n = torch.Size(self.shape).numel()
        g = torch.randn(n, generator=gen) * self.magnitudes
        if n and not finite:
            bad = torch.randint(0, n, (max(1, n // 300),), generator=gen)
            g[bad] = torch.tensor([float("nan"), float("inf"), -float("inf")])[torch.arange(len(bad)) % 3]
        return g.reshape(self.shape).to(self.grad_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t


def _step_both(k, cases, grads, scalars, companded, count):
    """One step of the kernel (one call) and of the reference (per tensor) from identical states."""
    quantized = cases[0].quantized
    has_rho = "rho" in cases[0].kernel
    skipped_k = torch.zeros((), dtype=torch.int32) if count else None
    skipped_r = torch.zeros((), dtype=torch.int32) if count else None

    def col(name, side):
        return [getattr(c, side)[name] for c in cases]

    k.adam_step_multi(
        col("p", "kernel"), grads, col("m", "kernel"), col("v", "kernel"),
        col("ms", "kernel") if quantized else None, col("vs", "kernel") if quantized else None,
        col("rho", "kernel") if has_rho else None,
        cols=[c.cols for c in cases] if quantized else None, scalars=scalars, companded=companded, skipped=skipped_k)
    for c, g in zip(cases, grads):
        r = c.ref
        reference.adam_step_(r["p"], g, r["m"], r["v"], r.get("ms"), r.get("vs"), r.get("rho"),
                             cols=c.cols if quantized else None, scalars=scalars, companded=companded,
                             skipped=skipped_r)
    return skipped_k, skipped_r


def _assert_equal(cases, where):
    for c in cases:
        for name, got in c.kernel.items():
            want = c.ref[name]
            assert got.dtype == want.dtype and got.shape == want.shape
            diff = (_bits(got) != _bits(want)).sum().item()
            assert diff == 0, f"{where}: {name} of {tuple(c.shape)} {c.kernel['p'].dtype}: {diff} values differ"


def _run(k, cases, *, steps, decoupled, companded, gen, skipped_pattern=(True, False, True)):
    for step in range(1, steps + 1):
        scalars = AdamScalars.make(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step,
                                   decoupled=decoupled)
        grads = [c.new_grad(gen) for c in cases]
        count = skipped_pattern[(step - 1) % len(skipped_pattern)]
        skipped_k, skipped_r = _step_both(k, cases, grads, scalars, companded, count)
        _assert_equal(cases, f"step {step}")
        if count:
            assert skipped_k.item() == skipped_r.item() > 0


MATRIX = [
    pytest.param(rho, layout, decoupled,
                 id=f"{'no-rho' if rho is None else str(rho).split('.')[1]}-{layout}-{'adamw' if decoupled else 'adam'}")
    for rho, layout, decoupled in itertools.product(PARAM_DTYPES, LAYOUTS, (True, False))
]


@interpreted
@pytest.mark.parametrize("rho_dtype,layout,decoupled", MATRIX)
def test_matches_reference_bitwise(kernels, rho_dtype, layout, decoupled):
    """Every param dtype that can carry this rho, every shape, in ONE call per step; two kernel steps in a
    row after two reference steps (so the first reads reference-made codes, scales and rho, the second
    its own)."""
    quantized, companded = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rho_dtype}-{layout}-{decoupled}".encode()))
    cases = [Case(s, dt, dt, rho_dtype, quantized, gen, companded) for dt in PARAM_DTYPES[rho_dtype] for s in SHAPES]
    _run(kernels, cases, steps=2, decoupled=decoupled, companded=companded, gen=gen)


@interpreted
def test_nonfinite_parameter_with_coupled_decay_skips_its_group(kernels):
    """With 8-bit moments the kernel takes a group's skip flag from its new first moment. Under coupled weight
    decay (Adam) a NaN or Inf parameter value makes that moment non-finite although the gradient is finite:
    the group is skipped and counted, as in the reference, and the other groups step."""
    gen = torch.Generator().manual_seed(7)
    cases = [Case((4, 96), torch.bfloat16, torch.bfloat16, torch.int8, True, gen)]
    for side in ("kernel", "ref"):
        cases[0].__dict__[side]["p"][1, 40] = float("nan")  # row 1, group 1
        cases[0].__dict__[side]["p"][3, 70] = float("inf")  # row 3, group 2
    before = cases[0].kernel["p"].clone()
    scalars = AdamScalars.make(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3,
                               decoupled=False)
    skipped_k, skipped_r = _step_both(kernels, cases, [cases[0].new_grad(gen, finite=True)], scalars, True, True)
    _assert_equal(cases, "coupled decay, non-finite parameters")
    assert skipped_k.item() == skipped_r.item() == 2
    after = cases[0].kernel["p"]
    assert torch.equal(_bits(after[1, 32:64]), _bits(before[1, 32:64]))
    assert torch.equal(_bits(after[3, 64:96]), _bits(before[3, 64:96]))
    assert (after[0] != before[0]).any()


@interpreted
@pytest.mark.parametrize("eps", [1e-38, 1e4], ids=["tiny-eps", "huge-eps"])
def test_update_division_outside_the_fast_range(kernels, eps):
    """An eps outside [2^-122, 2^12] takes IEEE's division for Adam's update of 8-bit moments (FAST_UPDATE
    off): still bitwise the reference's."""
    gen = torch.Generator().manual_seed(11)
    cases = [Case((4, 96), torch.bfloat16, torch.bfloat16, torch.int8, True, gen)]
    scalars = AdamScalars.make(lr=3e-3, beta1=0.9, beta2=0.999, eps=eps, weight_decay=0.1, step=3, decoupled=True)
    _step_both(kernels, cases, [cases[0].new_grad(gen)], scalars, True, True)
    _assert_equal(cases, f"eps {eps}")


@interpreted
@pytest.mark.parametrize("quantized", [True, False], ids=["q-companded", "fp32-moments"])
def test_mixed_grad_dtypes(kernels, quantized):
    gen = torch.Generator().manual_seed(1)
    pairs = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
             (torch.float32, torch.bfloat16), (torch.float32, torch.float16)]
    cases = [Case(s, p, g, None, quantized, gen) for p, g in pairs for s in [(7, 33), (64, 64)]]
    _run(kernels, cases, steps=2, decoupled=True, companded=True, gen=gen)


@interpreted
def test_module_block_sizes():
    """The default configuration's block sizes: many programs per tensor, a partial last block."""
    clear_plans()
    gen = torch.Generator().manual_seed(2)
    cases = [Case(s, torch.bfloat16, torch.bfloat16, torch.int8, True, gen) for s in [(64, 64), (4097,), (7, 33)]]
    _run(K, cases, steps=2, decoupled=True, companded=True, gen=gen)
    assert len(cached_plans(DEFAULT)) == 1  # a launch given no configuration uses the current one
    cases = [Case(s, torch.bfloat16, torch.bfloat16, torch.int8, False, gen) for s in [(4097,), (33,)]]
    _run(K, cases, steps=2, decoupled=True, companded=True, gen=gen)


@interpreted
def test_approximate_variant_is_ieee_here(kernels):
    """``exact=False`` takes Triton's ``/`` and ``tl.sqrt``, which the interpreter computes with numpy's
    IEEE operations (libdevice's fast division, the GPU's choice, cannot run here): still bitwise."""
    approx = Launch(kernels.config.replace(exact=False))
    gen = torch.Generator().manual_seed(8)
    for quantized in (True, False):
        cases = [Case(s, torch.bfloat16, torch.bfloat16, torch.int8, quantized, gen) for s in [(7, 33), (64, 64)]]
        _run(approx, cases, steps=2, decoupled=True, companded=True, gen=gen)


@interpreted
@pytest.mark.parametrize("quantized", [True, False], ids=["q-companded", "fp32-moments"])
def test_large_tensor_path(kernels, quantized):
    """Tensors at or above large_numel get launches of their own (threshold lowered to keep this cheap)."""
    large = Launch(kernels.config.replace(large_numel=200, large_groups=16))
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 64), (7, 33), (4097,), (31,), (5, 1), (3, 5, 7)]  # the first three are large
    cases = [Case(s, torch.bfloat16, torch.bfloat16, torch.int16, quantized, gen) for s in shapes]
    _run(large, cases, steps=2, decoupled=False, companded=True, gen=gen)
    plan = large.plans()[0]  # the plan of the last step
    assert (plan.own_launches, plan.table_tensors) == (3, 3)


@interpreted
def test_plan_cache_reused_and_refreshed(kernels):
    """Each step is compared bit for bit with the reference, so a plan pointing at a stale tensor fails."""
    builds = []  # every plan a step used, once (held here, so that no two are the same object)
    gen = torch.Generator().manual_seed(4)
    cases = [Case(s, torch.bfloat16, torch.bfloat16, torch.int8, True, gen) for s in [(7, 33), (33,)]]
    grads = [c.new_grad(gen) for c in cases]

    def step(t):
        scalars = AdamScalars.make(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=t,
                                   decoupled=True)
        _step_both(kernels, cases, grads, scalars, True, True)
        _assert_equal(cases, f"step {t}")
        plan = kernels.plans()[0]  # the plan of this step
        if not any(plan is built for built in builds):
            builds.append(plan)

    step(1)
    step(2)
    assert len(builds) == 1, "a repeated step with the same tensors must not rebuild its tables"
    grads[1] = cases[1].new_grad(gen)  # a new gradient buffer: the same plan reads it
    step(3)
    assert len(builds) == 1
    unaligned = torch.empty(grads[0].numel() + 1, dtype=grads[0].dtype)[1:].view(grads[0].shape)
    grads[0] = unaligned.copy_(grads[0])  # not 16-byte aligned: another bucket
    step(4)
    assert len(builds) == 2
    grads[0] = grads[0].float()  # another gradient dtype: another bucket
    step(5)
    assert len(builds) == 3
    cases[0].kernel["p"] = cases[0].kernel["p"].clone()  # a replaced parameter
    step(6)
    assert len(builds) == 4
    old = cases[1].kernel["m"]  # a replaced state tensor, the old one still alive
    cases[1].kernel["m"] = old.clone()
    step(7)
    assert len(builds) == 5
    cases[1].kernel["rho"] = cases[1].kernel["rho"].clone()  # a replaced state tensor, the old one freed
    step(8)
    assert len(builds) == 6
    step(9)
    assert len(builds) == 6


@interpreted
def test_plan_dropped_when_a_state_tensor_is_freed(kernels):
    gen = torch.Generator().manual_seed(6)
    cases = [Case((7, 33), torch.bfloat16, torch.bfloat16, torch.int8, True, gen)]
    _run(kernels, cases, steps=1, decoupled=True, companded=True, gen=gen)
    assert len(kernels.plans()) == 1
    del cases[0].kernel["v"]  # the optimizer dropped this state: its id may now name another tensor
    assert len(kernels.plans()) == 0


@interpreted
def test_plan_cache_is_bounded(kernels):
    bounded = Launch(kernels.config.replace(plan_cache_size=2))
    gen = torch.Generator().manual_seed(5)
    alive = []  # distinct storages for the three calls: three different keys
    for _ in range(3):
        alive.append([Case((5, 1), torch.float32, torch.float32, None, False, gen)])
        _run(bounded, alive[-1], steps=1, decoupled=True, companded=True, gen=gen)
    assert len(bounded.plans()) == 2


@interpreted
def test_clear_plans_and_one_cache_per_config(kernels):
    """``clear_plans`` drops every cached plan, and the next step builds its plan again (still bitwise);
    plans are cached per launch configuration, and ``using`` sets the one of launches given none."""
    gen = torch.Generator().manual_seed(9)
    cases = [Case((7, 33), torch.bfloat16, torch.bfloat16, torch.int8, True, gen)]
    _run(kernels, cases, steps=1, decoupled=True, companded=True, gen=gen)
    (before,) = kernels.plans()
    other = kernels.config.replace(table_blocks=3)
    with using(other):
        _run(K, cases, steps=1, decoupled=True, companded=True, gen=gen)
    assert len(cached_plans(other)) == 1 and kernels.plans() == (before,)
    clear_plans()
    assert cached_plans(other) == () and kernels.plans() == ()
    _run(kernels, cases, steps=1, decoupled=True, companded=True, gen=gen)
    (after,) = kernels.plans()
    assert after is not before


@pytest.mark.parametrize("field, value", [("table_groups", 48), ("large_groups", 0), ("num_warps", 3),
                                          ("table_blocks", 0), ("large_numel", -1), ("prefetch_ahead", 1.5),
                                          ("plan_cache_size", True), ("max_registers", 0), ("prefetch_level", 3),
                                          ("exact_max_registers", 1.0), ("approx_max_registers", -8), ("exact", 1),
                                          ("muon_momentum", (16, 4, 1, True)), ("muon_apply", None)])
def test_launch_config_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=rf"LaunchConfig\.{field} must be"):
        DEFAULT.replace(**{field: value})


@pytest.mark.parametrize("field, value", [("groups", 24), ("groups", 0), ("groups", 1 << 16), ("warps", 3),
                                          ("warps", 64), ("blocks", 0), ("blocks", True), ("blocks", 1 << 31),
                                          ("prefetch", 1), ("max_registers", 0), ("tile_cols", 48),
                                          ("tile_cols", 1024), ("tile_cols", 1)])
def test_kernel_launch_refuses_bad_values(field, value):
    from flashdist.kernels.triton import KernelLaunch

    with pytest.raises(ValueError, match=rf"KernelLaunch\.{field} must be"):
        KernelLaunch(**{"groups": 16, field: value})


def test_register_caps_by_variant_moments_and_layout():
    """8-bit moments on the default layout: the exact variant compiles under ``exact_max_registers``, the
    approximate one under ``approx_max_registers``; fp32 moments and other layouts under none;
    ``max_registers`` overrides both everywhere."""
    config = DEFAULT.replace(exact_max_registers=72, approx_max_registers=88)
    assert config.replace(exact=True).compile_options()["maxnreg"] == 72
    assert config.replace(exact=False).compile_options()["maxnreg"] == 88
    assert "maxnreg" not in config.compile_options(quantized=False)
    assert "maxnreg" not in config.replace(exact_max_registers=None).compile_options()
    for exact, quantized in ((True, True), (False, True), (True, False)):
        capped = config.replace(exact=exact, max_registers=64).compile_options(quantized)
        assert capped == dict(num_warps=config.num_warps, enable_fp_fusion=False, maxnreg=64)
    # the caps only on the default layout, where the kernel fits them without spilling
    for exact in (True, False):
        assert "maxnreg" not in config.replace(exact=exact).compile_options(True, default_layout=False)
    default = dict(P_KIND=0, G_KIND=0, RHO_KIND=1, ALIGNED=True, ALIGN16=True, COMPANDED=True, ALGO=0,
                   FAST_UPDATE=True)
    assert default_layout(default) and default_layout(dict(default, ALGO=1, FAST_UPDATE=False))
    for change in (dict(RHO_KIND=2), dict(RHO_KIND=0), dict(P_KIND=2), dict(G_KIND=1), dict(ALIGNED=False),
                   dict(ALIGN16=False), dict(COMPANDED=False), dict(FAST_UPDATE=False)):
        assert not default_layout(dict(default, **change)), change


def test_launches_take_the_register_cap_on_the_default_layout_only(kernels, monkeypatch):
    """The launcher asks for ``exact_max_registers`` where the tensors have the default layout (bf16 with int8
    rho, whole groups, aligned) and for no cap elsewhere (int16 rho here), as launch/bench/kernel_sass.py compiles."""
    asked = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **flags: asked.append((flags["RHO_KIND"], flags.get("maxnreg")))

    monkeypatch.setattr(K, "table_kernel", Recorder())
    monkeypatch.setattr(K, "tensor_kernel", Recorder())
    gen = torch.Generator().manual_seed(5)
    for rho in (torch.int8, torch.int16):
        cases = [Case((4, 64), torch.bfloat16, torch.bfloat16, rho, True, gen)]
        _step_both(kernels, cases, [c.new_grad(gen) for c in cases],
                   AdamScalars.make(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1,
                                    decoupled=True), True, False)
    assert asked == [(1, SMALL_BLOCKS.exact_max_registers), (2, None)]


def test_launch_config_is_immutable_and_module_settings_are_refused():
    with pytest.raises(AttributeError):
        DEFAULT.exact = False  # type: ignore[misc]
    assert K.TABLE_GROUPS == DEFAULT.table_groups and K.EXACT == DEFAULT.exact  # the old names still read
    with pytest.raises(AttributeError, match="LaunchConfig\\(table_groups=...\\)"):
        K.TABLE_GROUPS = 64
    assert K.TABLE_GROUPS == DEFAULT.table_groups
    with pytest.raises(TypeError, match="config must be a LaunchConfig"):
        p = torch.zeros(4)
        K.sgd_step_multi([p], [p.clone()], None, None, None, cols=None, companded=True, skipped=None,
                         scalars=SGDScalars.make(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
                                                 nesterov=False, step=1, decoupled=False), config={"exact": True})


@pytest.mark.parametrize("cls", [AdamScalars, SGDScalars, LionScalars], ids=["adam", "sgd", "lion"])
def test_scalars_fill_the_kernel_slots_by_name(cls):
    """Each update's scalars name the kernel slot of every field the kernel reads, and only their own fields."""
    fields = {f.name for f in dataclasses.fields(cls)}
    assert len(cls.KERNEL_FIELDS) == KERNEL_SLOTS
    assert {name for name in cls.KERNEL_FIELDS if name is not None} <= fields
    made = {AdamScalars: dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=2, decoupled=True),
            SGDScalars: dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1, nesterov=True, step=2,
                             decoupled=True),
            LionScalars: dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)}[cls]
    sc = cls.make(**made)
    args = sc.kernel_args()
    assert [a for a, name in zip(args, cls.KERNEL_FIELDS) if name is None] == [0.0] * cls.KERNEL_FIELDS.count(None)
    assert all(args[k] == getattr(sc, name) for k, name in enumerate(cls.KERNEL_FIELDS) if name is not None)


@interpreted
def test_nothing_to_do(kernels):
    scalars = AdamScalars.make(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, decoupled=True)
    K.adam_step_multi([], [], [], [], None, None, None, cols=None, scalars=scalars, companded=True, skipped=None)
    e = torch.empty(0, 4, dtype=torch.bfloat16)
    K.adam_step_multi([e], [e.clone()], [torch.empty(0, 4, dtype=torch.int8)], [torch.empty(0, 4, dtype=torch.uint8)],
                      [torch.empty(0, 1, dtype=torch.bfloat16)], [torch.empty(0, 1, dtype=torch.bfloat16)], None,
                      cols=[4], scalars=scalars, companded=True, skipped=torch.zeros((), dtype=torch.int32))


@interpreted
def test_rejects_bad_tensors(kernels):
    scalars = AdamScalars.make(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, decoupled=True)
    p = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        K.adam_step_multi([p], [torch.zeros(4, 8).t()], [torch.zeros(8, 4)], [torch.zeros(8, 4)], None, None, None,
                          cols=None, scalars=scalars, companded=True, skipped=None)
    with pytest.raises(TypeError, match="first moment codes of tensor 0"):
        K.adam_step_multi([p], [p.clone()], [torch.zeros(8, 4)], [torch.zeros(8, 4, dtype=torch.uint8)],
                          [torch.zeros(8, 1, dtype=torch.bfloat16)], [torch.zeros(8, 1, dtype=torch.bfloat16)], None,
                          cols=[4], scalars=scalars, companded=True, skipped=None)
    with pytest.raises(TypeError, match="rho"):
        K.adam_step_multi([p], [p.clone()], [torch.zeros(8, 4)], [torch.zeros(8, 4)], None, None,
                          [torch.zeros(8, 4, dtype=torch.int8)], cols=None, scalars=scalars, companded=True,
                          skipped=None)


# ----- rho's split and merge on their own, over every bf16 / fp16 value -------------------------------------


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Equal bit patterns, or both NaN (the float sum may quiet a signalling NaN parameter)."""
    return (_bits(a) == _bits(b)) | (torch.isnan(a) & torch.isnan(b))


@interpreted
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rho_dtype", [torch.int8, torch.int16], ids=["int8", "int16"])
def test_rho_split_and_merge_every_value(param_dtype, rho_dtype):
    """The kernel's split and merge (integer arithmetic on bit patterns for bf16, exponent-built units for
    fp16) against rho.split / rho.merge: every parameter value with the end, middle and random codes, and
    master weights on the rho grid of every value and half a rho step, an fp32 step or a whole rounding
    interval off it (the ties and the overflow into the next value up), plus random fp32 patterns."""
    steps = int(R.RHO_STEPS[rho_dtype])
    gen = torch.Generator().manual_seed(7)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(param_dtype)
    codes = torch.tensor([-steps, -steps + 1, -1, 0, 1, steps // 2, steps - 1])
    p = every.repeat(len(codes) + 1)
    rho = torch.cat([codes.repeat_interleave(len(every)),
                     torch.randint(-steps, steps, (len(every),), generator=gen)]).to(rho_dtype)
    grid = R.merge(p, rho)
    fp32_step = (grid.view(torch.int32) + 1).view(torch.float32)  # one fp32 step away from zero
    last = slice(len(every) * len(codes), None)  # the random codes
    half_step = R.half_ulp(p[last].float(), param_dtype) / (2 * steps)
    half_ulp = R.half_ulp(every.float(), param_dtype)
    theta = torch.cat([grid, fp32_step, grid[last] + half_step, grid[last] - half_step, every.float() + half_ulp,
                       every.float() - half_ulp, every.float() + half_ulp * (1 - 1 / (2 * steps)),
                       torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int32).view(
                           torch.float32)])
    block = 1 << 16  # few, large programs: the interpreter's cost is per operation of a program
    if param_dtype == torch.bfloat16:
        # The bf16 split and merge take a general path for a whole block that holds a value past
        # SPLIT_LIMIT (merge: of its one-add sum). Those values go last, so that both paths run.
        limit = int(SPLIT_LIMIT.value)
        bits = p.view(torch.int16).int() << 16
        sign = bits >> 31
        past = ((bits + (((rho.int() << (15 - steps.bit_length() + 1)) ^ sign) - sign)) & 0x7FFFFFFF) >= limit
        order = torch.argsort(past.int(), stable=True)
        p, rho = p[order], rho[order]
        theta = theta[torch.argsort(((_bits(theta) & 0x7FFFFFFF) >= limit).int(), stable=True)]
        split_past = (_bits(theta) & 0x7FFFFFFF) >= limit
        for name, flags in (("merge", past), ("split", split_past)):
            assert flags.any() and len(flags) - int(flags.sum()) >= block, f"{name}: both paths must run"
    n = max(len(p), len(theta))
    n = -(-n // block) * block
    pad = lambda t, fill: torch.cat([t, t.new_full((n - len(t),), fill)])  # noqa: E731
    p_in, rho_in, theta_in = pad(p, 0), pad(rho, 0), pad(theta, 0.0)
    merged = torch.empty(n)
    low = torch.empty(n, dtype=torch.int16)
    split_rho = torch.empty(n, dtype=torch.int32)
    rho_probe[(n // block,)](p_in.view(torch.int16) if param_dtype == torch.bfloat16 else p_in, rho_in, theta_in,
                             merged, low, split_rho, FP16=param_dtype == torch.float16,
                             RHO_LOG2=steps.bit_length() - 1, BLOCK=block, COMPILED=False)
    want_merged = R.merge(p_in, rho_in)
    assert _same_bits(merged, want_merged).all(), "merge differs"
    want_low, want_rho = R.split(theta_in, param_dtype, rho_dtype)
    # (NaN patterns of bf16 differ between torch builds: any NaN will do)
    bad = (_bits(want_low) != low) & ~(torch.isnan(want_low) & torch.isnan(low.view(param_dtype)))
    assert not bad.any(), f"split: {int(bad.sum())} params differ, e.g. theta {theta_in[bad][:4].tolist()}"
    bad = want_rho.int() != split_rho
    assert not bad.any(), f"split: {int(bad.sum())} rho differ, e.g. theta {theta_in[bad][:4].tolist()}"


# ----- FlashSGD(W) and FlashLion: the same kernel with ALGO = SGD / LION ------------------------------------

FAMILY = {
    "sgd": lambda t: SGDScalars.make(lr=3e-3, momentum=0.9, dampening=0.1, weight_decay=0.1, nesterov=False,
                                     step=t, decoupled=False),
    "sgd-nesterov": lambda t: SGDScalars.make(lr=3e-3, momentum=0.9, dampening=0.0, weight_decay=0.1,
                                              nesterov=True, step=t, decoupled=False),
    "sgdw": lambda t: SGDScalars.make(lr=3e-3, momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=False,
                                      step=t, decoupled=True),
    "sgd-no-momentum": lambda t: SGDScalars.make(lr=3e-3, momentum=0.0, dampening=0.0, weight_decay=0.1,
                                                 nesterov=False, step=t, decoupled=False),
    "lion": lambda t: LionScalars.make(lr=3e-3, beta1=0.9, beta2=0.99, weight_decay=0.1),
}


class FamilyCase:
    """One tensor with a one-moment state (or none: SGD without momentum), kernel and reference copies, the
    state made by three reference steps (the first of SGD's is its buffer-starts-as-gradient step)."""

    def __init__(self, algo, shape, param_dtype, rho_dtype, layout, gen):
        self.algo, self.shape, self.layout, self.grad_dtype = algo, shape, layout, param_dtype
        self.quantized = layout in ("q-companded", "q-linear")
        self.companded = layout != "q-linear"
        self.cols = _cols(shape)
        n = torch.Size(shape).numel()
        t = {"p": self.draw_param(n, param_dtype, gen)}
        if self.quantized:
            t["m"] = torch.zeros(shape, dtype=torch.int8)
            t["ms"] = torch.zeros(n // self.cols if n else 0, -(-self.cols // Q.GROUP), dtype=torch.bfloat16)
        elif layout == "fp32":
            t["m"] = torch.zeros(shape)
        if rho_dtype is not None:
            t["rho"] = torch.zeros(shape, dtype=rho_dtype)
        self.kernel = t
        for step in (1, 2, 3):
            _family_step(None, [self], [self.new_grad(gen, finite=True)], step, None, sides=("kernel",))
        self.ref = {k: v.clone() for k, v in t.items()}

    draw_param, new_grad = Case.draw_param, Case.new_grad


def _family_step(k, cases, grads, step, skipped, sides=("kernel", "ref")):
    """One step of ``cases``' algorithm: one kernel call over all of them (``k`` the kernel module; None:
    the reference on the kernel side too), and the reference per tensor."""
    c0 = cases[0]
    scalars = FAMILY[c0.algo](step)
    cols = [c.cols for c in cases] if c0.quantized else None
    for side in sides:
        col = {name: [getattr(c, side)[name] for c in cases] if name in getattr(c0, side) else None
               for name in ("p", "m", "ms", "rho")}
        count = skipped[side] if skipped else None
        if side == "kernel" and k is not None:
            if c0.algo == "lion":
                k.lion_step_multi(col["p"], grads, col["m"], col["ms"], col["rho"], cols=cols, scalars=scalars,
                                  companded=c0.companded, skipped=count)
            else:
                k.sgd_step_multi(col["p"], grads, col["m"], col["ms"], col["rho"], cols=cols, scalars=scalars,
                                 companded=c0.companded, skipped=count)
            continue
        for i, (c, g) in enumerate(zip(cases, grads)):
            t = getattr(c, side)
            step_ = reference.lion_step_ if c0.algo == "lion" else reference.sgd_step_
            step_(t["p"], g, t.get("m"), t.get("ms"), t.get("rho"), cols=c.cols if c0.quantized else None,
                  scalars=scalars, companded=c0.companded, skipped=count)


FAMILY_MATRIX = [
    pytest.param(algo, rho, layout, id=f"{algo}-{'no-rho' if rho is None else str(rho).split('.')[1]}-{layout}")
    for algo, rho, layout in [
        *itertools.product(("sgd", "sgd-nesterov", "sgdw", "lion"), (None, torch.int8), ("q-companded", "fp32")),
        ("sgd", torch.int16, "q-linear"), ("lion", torch.int16, "q-linear"),
        ("sgd-no-momentum", None, "none"), ("sgd-no-momentum", torch.int8, "none"),
    ]
]


@interpreted
@pytest.mark.parametrize("algo,rho_dtype,layout", FAMILY_MATRIX)
def test_family_matches_reference_bitwise(kernels, algo, rho_dtype, layout):
    """SGD, SGD with Nesterov, SGDW, SGD without momentum and Lion: every param dtype that can carry this rho,
    every shape, one kernel call per step, non-finite gradients in every step, bitwise against the reference."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{algo}-{rho_dtype}-{layout}".encode()))
    cases = [FamilyCase(algo, s, dt, rho_dtype, layout, gen) for dt in PARAM_DTYPES[rho_dtype] for s in SHAPES]
    for step in (4, 5):
        grads = [c.new_grad(gen) for c in cases]
        skipped = {side: torch.zeros((), dtype=torch.int32) for side in ("kernel", "ref")}
        _family_step(kernels, cases, grads, step, skipped)
        _assert_equal(cases, f"{algo} step {step}")
        assert skipped["kernel"].item() == skipped["ref"].item() > 0


@interpreted
def test_family_first_sgd_step_starts_the_buffer_from_the_gradient(kernels):
    """torch.optim.SGD's first step: the buffer becomes the gradient (no dampening), in the kernel too."""
    gen = torch.Generator().manual_seed(9)
    p = torch.randn(4, 64, generator=gen)
    g = torch.randn(4, 64, generator=gen)
    buf = torch.full((4, 64), 7.0)  # whatever is stored is ignored at step 1
    scalars = SGDScalars.make(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.0, nesterov=False, step=1,
                              decoupled=False)
    expected = p - g * scalars.lr
    kernels.sgd_step_multi([p], [g], [buf], None, None, cols=None, scalars=scalars, companded=True, skipped=None)
    assert torch.equal(buf, g) and torch.equal(p, expected)


@interpreted
def test_stateless_plan_is_not_reused_for_another_tensor_at_the_same_address(kernels):
    """SGD without momentum on fp32 parameters keeps no state: the plan watches the parameters, so a new,
    smaller parameter at a freed one's address gets a plan of its own (not the old sizes)."""
    scalars = SGDScalars.make(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, step=1,
                              decoupled=False)
    storage = torch.zeros(4096 + 64)
    big = storage[:4096].view(64, 64)
    kernels.sgd_step_multi([big], [torch.ones(64, 64)], None, None, None, cols=None, scalars=scalars,
                           companded=True, skipped=None)
    assert len(kernels.plans()) == 1
    del big
    assert len(kernels.plans()) == 0  # the parameter is gone: so is its plan
    small = storage[:64].view(8, 8)  # the same address, 64 elements
    storage[64:] = 5.0
    kernels.sgd_step_multi([small], [torch.ones(8, 8)], None, None, None, cols=None, scalars=scalars,
                           companded=True, skipped=None)
    assert torch.equal(storage[64:], torch.full((4096,), 5.0))  # nothing written past the 64 elements


# ----- finite gradients whose step overflows fp32 ----------------------------------------------------------

# per gradient dtype: the value put in one element, then in a whole tensor (the largest finite ones, 1e30)
HUGE = {torch.bfloat16: (1e30, torch.finfo(torch.bfloat16).max), torch.float16: (torch.finfo(torch.float16).max,) * 2,
        torch.float32: (1e30, torch.finfo(torch.float32).max)}


def _huge_grads(cases, gen, step):
    """Normal gradients, with step 1 putting a huge value (of either sign) in one element of each tensor and
    step 2 filling every tensor with one; later steps normal."""
    grads = []
    for c in cases:
        g = c.new_grad(gen, finite=True)
        if step in (1, 2) and g.numel():
            value = HUGE[g.dtype][step - 1] * (-1) ** len(grads)
            g = g.clone()
            if step == 1:
                g.view(-1)[g.numel() // 2] = value
            else:
                g.fill_(value)
        grads.append(g)
    return grads


def _assert_finite(cases):
    for c in cases:
        for side in (c.kernel, c.ref):
            for name, t in side.items():
                if t.is_floating_point():
                    assert torch.isfinite(t.float()).all(), f"{name} of {tuple(c.shape)} is not finite"


OVERFLOW_SHAPES = [(4, 96), (3, 33), (70,)]


@interpreted
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rho_dtype", [None, torch.int8], ids=["no-rho", "int8"])
def test_overflowing_gradients_match_reference(kernels, layout, rho_dtype):
    """Adam: gradients up to the largest finite bf16, fp16 and fp32 values, in one element and in whole
    tensors, then normal steps: bitwise the reference's, the overflowing groups skipped and counted alike,
    and every state, parameter and rho finite."""
    quantized, companded = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(zlib.crc32(f"overflow-{layout}-{rho_dtype}".encode()))
    cases = [Case(s, dt, dt, rho_dtype, quantized, gen, companded) for dt in PARAM_DTYPES[rho_dtype]
             for s in OVERFLOW_SHAPES]
    for step in (1, 2, 3, 4):
        scalars = AdamScalars.make(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step + 2,
                                   decoupled=step % 2 == 0)
        skipped_k, skipped_r = _step_both(kernels, cases, _huge_grads(cases, gen, step), scalars, companded, True)
        _assert_equal(cases, f"overflow step {step}")
        _assert_finite(cases)
        assert skipped_k.item() == skipped_r.item()
        assert (skipped_k.item() > 0) == (step in (1, 2))


@interpreted
@pytest.mark.parametrize("rho_dtype", [None, torch.int8], ids=["no-rho", "int8"])
@pytest.mark.parametrize("algo,layout", [(a, lay) for a in ("sgd", "sgd-nesterov", "sgdw", "lion")
                                          for lay in ("q-companded", "q-linear", "fp32")]
                         + [("sgd-no-momentum", "none")])
def test_family_overflowing_gradients_match_reference(kernels, algo, layout, rho_dtype):
    """SGD (momentum with dampening, Nesterov, decoupled decay, none) and Lion under the same gradients: the
    momentum buffer, Nesterov's look-ahead and an unbounded SGD step can overflow; bitwise the reference's,
    counted alike, everything finite."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"overflow-{algo}-{layout}-{rho_dtype}".encode()))
    cases = [FamilyCase(algo, s, dt, rho_dtype, layout, gen) for dt in PARAM_DTYPES[rho_dtype]
             for s in OVERFLOW_SHAPES]
    for step in (1, 2, 3, 4):
        skipped = {side: torch.zeros((), dtype=torch.int32) for side in ("kernel", "ref")}
        _family_step(kernels, cases, _huge_grads(cases, gen, step), step + 3, skipped)
        _assert_equal(cases, f"{algo} overflow step {step}")
        _assert_finite(cases)
        assert skipped["kernel"].item() == skipped["ref"].item()


# ----- capturable step: scalars computed on the device ----------------------------------------------------------

def _f32_bits(values) -> list[int]:
    return torch.tensor(list(values), dtype=torch.float32).view(torch.int32).tolist()


@interpreted
def test_device_scalars_are_the_host_scalars():
    """device_scalars' kernel writes the bits AdamScalars / SGDScalars / LionScalars compute on the host, over
    step counts from 1 to 2^24, learning rates given as floats and as fp32 / fp64 tensors, both weight-decay
    conventions and SGD's first step."""
    from flashdist.kernels.triton import device_scalars as DS

    gen = torch.Generator().manual_seed(21)

    def draw(*choices):
        return choices[int(torch.randint(0, len(choices), (), generator=gen))]

    for trial in range(40):
        step = draw(1, 2, 3, 10, 999, 2**24, int(torch.randint(1, 2**24, (), generator=gen)))
        lr = draw(1e-3, 0.0, float(torch.rand((), generator=gen)) * 0.1)
        lr_given = draw(lr, torch.tensor(lr, dtype=torch.float64), torch.tensor(lr, dtype=torch.float32))
        lr_host = float(lr_given)
        b1, b2 = draw(0.9, 0.0, 0.5), draw(0.999, 0.95, 0.9999)
        wd, decoupled = draw(0.0, 0.01, 0.1), draw(True, False)
        count = torch.tensor([float(step)])
        got = DS.adam(count, lr_given, beta1=b1, beta2=b2, eps=1e-8, weight_decay=wd, decoupled=decoupled)
        want = AdamScalars.make(lr=lr_host, beta1=b1, beta2=b2, eps=1e-8, weight_decay=wd, step=step,
                                decoupled=decoupled)
        assert _f32_bits(got.values.tolist()) == _f32_bits(want.kernel_args()), (step, lr_host, b1, b2, wd)
        assert got.eps == want.eps and got.decoupled == decoupled
        momentum, dampening = draw(0.0, 0.9), draw(0.0, 0.1)
        got = DS.sgd(count, lr_given, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=False,
                     decoupled=decoupled)
        want = SGDScalars.make(lr=lr_host, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=False,
                               step=step, decoupled=decoupled)
        assert _f32_bits(got.values.tolist()) == _f32_bits(want.kernel_args()), (step, momentum, dampening)
        if isinstance(lr_given, torch.Tensor):
            got = DS.lion(lr_given, beta1=b1, beta2=b2, weight_decay=wd)
            want = LionScalars.make(lr=lr_host, beta1=b1, beta2=b2, weight_decay=wd)
            assert _f32_bits(got.values.tolist()) == _f32_bits(want.kernel_args())


@interpreted
@pytest.mark.parametrize("algo", ["adamw", "sgd", "lion"])
def test_step_with_device_scalars_matches_reference_bitwise(kernels, algo):
    """The step that reads its scalars from the device (``SCALARS``, a capturable step), small and large
    tensors, against the reference with the host's scalars: SGD from its first step (the buffer starts as the
    gradient), Adam over its bias-corrected first steps."""
    from flashdist.kernels.triton import device_scalars as DS

    gen = torch.Generator().manual_seed(zlib.crc32(algo.encode()))
    lr = torch.tensor(3e-3, dtype=torch.float64)
    k = Launch(SMALL_BLOCKS.replace(large_numel=2048))  # the (4097,) tensor gets a launch of its own
    shapes = [(7, 33), (64, 64), (4097,)]
    if algo == "adamw":
        cases = [Case(s, torch.bfloat16, torch.bfloat16, torch.int8, True, gen) for s in shapes]
        for step in (3, 4):
            count = torch.tensor([float(step)])
            scalars = DS.adam(count, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
            grads = [c.new_grad(gen) for c in cases]
            for side in ("kernel", "ref"):
                col = {n: [getattr(c, side)[n] for c in cases] for n in ("p", "m", "v", "ms", "vs", "rho")}
                if side == "kernel":
                    k.adam_step_multi(col["p"], grads, col["m"], col["v"], col["ms"], col["vs"], col["rho"],
                                      cols=[c.cols for c in cases], scalars=scalars, companded=True, skipped=None)
                    continue
                host = AdamScalars.make(lr=float(lr), beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step,
                                        decoupled=True)
                for i, c in enumerate(cases):
                    reference.adam_step_(col["p"][i], grads[i], col["m"][i], col["v"][i], col["ms"][i], col["vs"][i],
                                         col["rho"][i], cols=c.cols, scalars=host, companded=True, skipped=None)
            _assert_equal(cases, f"step {step}")
        return
    cases = [FamilyCase(algo, s, torch.bfloat16, torch.int8, "q-companded", gen) for s in shapes]
    for c in cases:  # FamilyCase ran three steps already: SGD starts over from its first step
        c.ref = {n: v.clone() for n, v in c.kernel.items()}
    for step in (1, 2):
        grads = [c.new_grad(gen) for c in cases]
        col = {n: [c.kernel[n] for c in cases] for n in ("p", "m", "ms", "rho")}
        cols = [c.cols for c in cases]
        if algo == "lion":
            scalars = DS.lion(lr, beta1=0.9, beta2=0.99, weight_decay=0.1)
            k.lion_step_multi(col["p"], grads, col["m"], col["ms"], col["rho"], cols=cols, scalars=scalars,
                              companded=True, skipped=None)
        else:
            scalars = DS.sgd(torch.tensor([float(step)]), lr, momentum=0.9, dampening=0.1, weight_decay=0.1,
                             nesterov=False, decoupled=False)
            k.sgd_step_multi(col["p"], grads, col["m"], col["ms"], col["rho"], cols=cols, scalars=scalars,
                             companded=True, skipped=None)
        host = FAMILY[algo](step)
        ref_step = reference.lion_step_ if algo == "lion" else reference.sgd_step_
        for c, g in zip(cases, grads):
            ref_step(c.ref["p"], g, c.ref["m"], c.ref["ms"], c.ref["rho"], cols=c.cols, scalars=host, companded=True,
                     skipped=None)
        _assert_equal(cases, f"{algo} step {step}")


# ----- the inline PTX of the compiled kernel, run by a small emulator ----------------------------------------
# The interpreter runs each helper's Triton path, never its inline assembly (``COMPILED``). These run the
# assembly itself, instruction by instruction, on every value its callers can pass, against that path's
# arithmetic. Packed operands as Triton passes them: value k of an int16 block in half k of its register,
# of an int8 block in byte k.


def _ptx(asm: str, inputs: list, outputs: int) -> list:
    """Run ``asm`` (``prmt.b32`` in its default mode, ``xor``/``and``/``or``/``add``/``shl``, ``.reg``
    declarations) on uint32 arrays: ``$0 .. $(outputs-1)`` are the results, the inputs follow."""
    import numpy as np

    regs = {f"${outputs + k}": np.asarray(v, dtype=np.uint32) for k, v in enumerate(inputs)}

    def val(x):
        x = x.strip()
        return regs[x] if x in regs else np.uint32(int(x, 0))

    for ins in asm.replace("{", ";").replace("}", ";").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        a = val(src[0])
        if op == "prmt.b32":
            b, c = val(src[1]), int(src[2], 0)
            both = a.astype(np.uint64) | (np.asarray(b, dtype=np.uint64) << np.uint64(32))
            out = np.zeros(np.shape(both), dtype=np.uint32)
            for i in range(4):
                sel = (c >> (4 * i)) & 0xF
                byte = ((both >> np.uint64(8 * (sel & 7))) & np.uint64(0xFF)).astype(np.uint32)
                if sel & 8:
                    byte = np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0))
                out |= byte << np.uint32(8 * i)
        elif op == "shl.b32":
            out = a << np.uint32(int(src[1], 0))
        else:
            b = val(src[1])
            out = {"xor.b32": np.bitwise_xor, "and.b32": np.bitwise_and, "or.b32": np.bitwise_or,
                   "add.u32": np.add}[op](a, b)
        regs[d] = np.asarray(out, dtype=np.uint32)
    return [regs[f"${k}"] for k in range(outputs)]


def _halves(x16):  # int16 values, four per row -> the two registers that hold them
    import numpy as np

    u = x16.astype(np.uint16).astype(np.uint32).reshape(-1, 4)
    return [u[:, 0] | (u[:, 1] << 16), u[:, 2] | (u[:, 3] << 16)]


def test_inline_ptx_widens_merges_and_splits_as_the_interpreted_path():
    import numpy as np

    from flashdist.kernels.triton import bits as B

    every16 = np.arange(-(2**15), 2**15, dtype=np.int32).astype(np.int16)  # every bf16 bit pattern
    # bf16 widening, every pattern in both halves
    lo, hi = _ptx(B.BF16_WIDEN_ASM.value, [every16.astype(np.uint16).astype(np.uint32) | (
        np.roll(every16, 1).astype(np.uint16).astype(np.uint32) << 16)], 2)
    assert (lo == every16.astype(np.uint16).astype(np.uint32) << 16).all()
    assert (hi == np.roll(every16, 1).astype(np.uint16).astype(np.uint32) << 16).all()

    # merge: every parameter pattern with every rho, each register of four mixing signs and codes
    perm = np.random.default_rng(3).permutation(len(every16))
    for shift in range(256):
        p = every16[perm] if shift % 2 else every16
        rho = ((np.arange(len(p)) * 37 + shift) % 256 - 128).astype(np.int8)
        bits = p.astype(np.int32) << 16
        s = bits >> 31
        want = (bits.astype(np.int64) + (((rho.astype(np.int32) << 8) ^ s) - s)).astype(np.uint32)
        rb = rho.view(np.uint8).astype(np.uint32).reshape(-1, 4)
        rho_reg = rb[:, 0] | (rb[:, 1] << 8) | (rb[:, 2] << 16) | (rb[:, 3] << 24)
        got = np.stack(_ptx(rho_bits.MERGE_INT8_ASM.value, [*_halves(p), rho_reg], 4), axis=1).reshape(-1)
        assert (got == want).all(), f"merge differs at rho offset {shift}"

    # split's add on fp32 patterns of every sign and exponent, and rho read back from the words it makes
    gen = np.random.default_rng(5)
    tb = np.concatenate([gen.integers(-(2**31), 2**31, 1 << 22, dtype=np.int64),
                         np.arange(-(2**15), 2**15) << 16, (np.arange(-(2**15), 2**15) << 16) + 0x7F80,
                         (np.arange(-(2**15), 2**15) << 16) + 0x8080]).astype(np.uint32).view(np.int32)
    w = tb.astype(np.int64) + 0x8080 + ((tb >> 31).astype(np.int64) << 8)
    assert (_ptx(rho_bits.SPLIT_INT8_ASM.value, [tb.view(np.uint32)], 1)[0] == w.astype(np.uint32)).all()
    words = np.concatenate([w.astype(np.uint32), gen.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)])
    words = words[: len(words) // 4 * 4]
    wi = words.view(np.int32)
    want = ((wi >> 8) ^ (wi >> 31) ^ 0x80) & 0xFF
    q = words.reshape(-1, 4)
    got = _ptx(rho_bits.RHO_INT8_ASM.value, [q[:, 0], q[:, 1], q[:, 2], q[:, 3]], 1)[0]
    got = np.stack([(got >> (8 * k)) & 0xFF for k in range(4)], axis=1).reshape(-1)
    assert (got == want).all()


@interpreted
def test_capturable_launch_reads_gradient_addresses_from_its_tables(kernels):
    """A capturable launch (scalars on the device) reads every gradient address from the plan's device tables,
    the large tensors' from their cells: ``Plan.retarget`` rewrites those tables in place (what GraphedStep
    does before a replay) and the next launch follows, bit for bit, while a launch's address argument would
    still name the old gradient (overwritten with NaN here, so that reading it would fail the comparison)."""
    from flashdist.kernels.scalars import DeviceScalars
    from flashdist.kernels.triton import plans as P

    large = Launch(kernels.config.replace(large_numel=200, large_groups=16))
    gen = torch.Generator().manual_seed(31)
    cases = [Case(s, torch.bfloat16, torch.bfloat16, torch.int16, True, gen) for s in [(64, 64), (7, 33), (33,)]]
    for step in (1, 2, 3):
        host = AdamScalars.make(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step,
                                decoupled=True)
        scalars = DeviceScalars(torch.tensor(host.kernel_args(), dtype=torch.float32), decoupled=True, eps=1e-8,
                                inv_bias_correction2_sqrt=host.inv_bias_correction2_sqrt)
        grads = [c.new_grad(gen) for c in cases]
        plan = large.plans()[0] if step > 1 else None
        if plan is not None:  # the tables in place, then the plan's own record of the old gradients poisoned
            old = list(plan_grads)
            assert plan.retarget(grads, [g.data_ptr() for g in grads])
            for g in old:
                g.fill_(float("nan"))
        launch = Launch(large.config)  # the kernel with the device scalars, the reference with the host's
        launch.adam_step_multi = lambda *a, scalars, **kw: large.adam_step_multi(*a, scalars=device, **kw)
        device = scalars
        _step_both(launch, cases, grads, host, True, False)
        _assert_equal(cases, f"step {step}")
        assert large.plans()[0] is plan or plan is None, "the retargeted plan must be reused, not rebuilt"
        plan_grads = grads
    plan = large.plans()[0]
    assert (plan.own_launches, plan.table_tensors) == (2, 1)
    unaligned = torch.empty(cases[0].shape[0] * cases[0].shape[1] + 1, dtype=torch.bfloat16)[1:]
    assert not plan.retarget([unaligned.view(cases[0].shape), *plan_grads[1:]],
                             [unaligned.data_ptr(), *(g.data_ptr() for g in plan_grads[1:])])
    with pytest.raises(ValueError, match="grad of tensor 1 is not contiguous"):
        bad = torch.empty(cases[1].shape[::-1], dtype=torch.bfloat16).t()
        plan.retarget([plan_grads[0], bad, plan_grads[2]], [g.data_ptr() for g in (plan_grads[0], bad, plan_grads[2])])
    assert P.Plan.fits(plan, plan_grads, [g.data_ptr() for g in plan_grads])
