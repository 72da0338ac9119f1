"""The fused CPU step (flashdist.kernels.cpu) against the eager reference: bitwise, over a matrix of cases.

Every optimizer of tests/cases.py (its functional step, with the hyper-parameters of its options) x parameter
dtype x master weight bits x moment layout (8-bit companded, 8-bit linear, fp32) x group layout (row-aligned,
flat), on tensors with odd row lengths, over several steps whose gradients hold NaN and Inf groups and the
largest finite values (steps that overflow), parameters that are zero, negative zero, powers of two,
subnormal or near the format's largest value. Equal means the same bits (a NaN matches any NaN: the kernel
and torch may write different NaN payloads).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from flashdist.functional import flash_adam, flash_lion, flash_sgd
from flashdist.kernels import cpu
from flashdist.quant import codes as Q
from flashdist.quant import rho as R
from tests.cases import DTYPES, MOMENTS, OPTIMIZERS

# Where a compiler and ninja are present the kernel must build; without them the reference is the CPU path.
TOOLCHAIN = bool(shutil.which(os.environ.get("CXX", "c++"))) and bool(
    shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable)))
pytestmark = pytest.mark.skipif(not TOOLCHAIN, reason="no C++ compiler or ninja: CPU steps use the reference")


def test_kernel_builds():
    assert cpu.available(), cpu.build_error()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _copy_source(folder):
    """step.cpp and the headers beside it, copied into folder; the copy of step.cpp"""
    for f in [cpu.SOURCE, *cpu.SOURCE.parent.glob("*.h")]:
        shutil.copy(f, folder / f.name)
    return folder / cpu.SOURCE.name


def test_the_vector_path_of_this_cpu_is_built():
    # AVX-512 F/BW/VL where the CPU has them, else AVX2, else the block code alone; the bitwise tests below then
    # run the 8-bit cases through that path (test_avx2_path builds the AVX2 one on an AVX-512 machine too)
    flags = _cpu_flags()
    expected = "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "avx2" if "avx2" in flags else ""
    assert cpu.vector_isa() == expected


def test_build_key_covers_the_headers_beside_the_source(tmp_path):
    # a changed header must rebuild, not load a stale library
    source = _copy_source(tmp_path)
    before = cpu.build_key(source)
    assert before == cpu.build_key()
    for header in ("avx512.h", "avx2.h"):
        with open(tmp_path / header, "a") as f:
            f.write("\n")
        after = cpu.build_key(source)
        assert after != before
        before = after


def test_build_from_and_using_swap_the_step_for_a_block(tmp_path):
    own = cpu.load()
    other = cpu.build_from(cpu.SOURCE)  # the package's own source: the cached build
    with cpu.using(other):
        assert cpu.load() is other
    assert cpu.load() is own
    with pytest.raises(FileNotFoundError, match="missing.cpp"):
        cpu.build_from(tmp_path / "missing.cpp")

BITS = (24, 32, None)  # master_weight_bits
# odd rows, a 3-d tensor, one exact group, a short 1-d tensor, rows of a whole block (256) and a partial one
SHAPES = [(5, 70), (2, 3, 11), (1, 32), (7,), (3, 300)]
STEPS = 3


@dataclass(frozen=True)
class Case:
    opt: str  # a name of tests/cases.py's OPTIMIZERS
    dtype: str
    bits: int | None
    moments: str
    flat: bool
    shapes: tuple = tuple(SHAPES)
    grad_dtype: str | None = None  # the parameters' dtype unless given

    @property
    def id(self) -> str:
        grads = f"-{self.grad_dtype}-grads" if self.grad_dtype else ""
        return (f"{self.opt}-{self.dtype}-{self.bits or 'nosplit'}-{self.moments}-{'flat' if self.flat else 'rows'}"
                f"{grads}")


def _cases():
    for opt, dtype, bits, moments, flat in itertools.product(OPTIMIZERS, DTYPES, BITS, MOMENTS, (False, True)):
        if dtype == "fp32" and bits is not None:
            continue  # fp32 parameters are not split
        if moments == "fp32m" and flat:
            continue  # the group layout only matters to 8-bit moments
        if not OPTIMIZERS[opt].moments and moments != "fp32m":
            continue  # no momentum: no moments
        if "cpu" not in OPTIMIZERS[opt].backends or not OPTIMIZERS[opt].elementwise:
            continue  # (FlashMuon's phases, one tensor per call around Newton-Schulz: test_muon_phases_...)
        yield Case(opt, dtype, bits, moments, flat)


CASES = list(_cases())


def _params(shape, dtype, gen):
    """Random values of many magnitudes plus the special ones."""
    n = 1
    for d in shape:
        n *= d
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 6, (n,), generator=gen).float())
    biggest = torch.finfo(dtype).max if dtype != torch.float32 else 1e38
    tiny = torch.finfo(dtype).tiny
    special = torch.tensor([0.0, -0.0, 1.0, -0.5, 2.0**-3, tiny, -tiny / 4, biggest * 0.999, -biggest, 3e-3])
    k = min(n, len(special))
    x[:k] = special[:k]
    return x.reshape(shape).to(dtype)


def _grads(shape, dtype, gen, step):
    g = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 4, shape, generator=gen).float())
    flat = g.view(-1)
    flat[flat.numel() // 2] = 0.0
    if step == 1 and flat.numel() > 40:  # one NaN and one Inf (in other groups) at the second step
        flat[3] = float("nan")
        flat[flat.numel() - 2] = float("-inf")
    if step == 2 and flat.numel() > 40:  # the largest finite gradients: their step overflows
        flat[5] = torch.finfo(dtype).max
        flat[flat.numel() - 3] = -torch.finfo(dtype).max / 3
    return g.to(dtype)


def _state(case: Case, gen):
    """Parameters, their state and grads of every step, for one call of the functional step."""
    dtype = DTYPES[case.dtype]
    quantized, companded = MOMENTS[case.moments]
    shapes = [s for s in case.shapes if not quantized or case.flat or len(s) >= 2]
    params = [_params(s, dtype, gen) for s in shapes]
    cols = [p.numel() if case.flat else p.numel() // p.shape[0] for p in params] if quantized else None
    rhos = None
    if case.bits is not None and dtype != torch.float32:
        thetas = [p.float() + torch.randn(p.shape, generator=gen) * p.float().abs() * 2.0**-9 for p in params]
        splits = [R.split(t, dtype, R.rho_dtype(case.bits)) for t in thetas]
        params = [s[0] for s in splits]
        rhos = [s[1] for s in splits]
    moments, scales = [], []
    for k in range(len(OPTIMIZERS[case.opt].moments)):
        vals = [torch.randn(p.shape, generator=gen) * 1e-2 for p in params]
        if k == 1:
            vals = [v * v for v in vals]
        if quantized:
            q = [(Q.quantize_exp_avg(v, c, companded) if k == 0 else Q.quantize_exp_avg_sq(v, c, companded))
                 for v, c in zip(vals, cols)]
            moments.append([c for c, _ in q])
            scales.append([s for _, s in q])
        else:
            moments.append(vals)
            scales.append(None)
    grad_dtype = DTYPES[case.grad_dtype or case.dtype]
    grads = [[_grads(p.shape, grad_dtype, gen, step) for p in params] for step in range(STEPS)]
    return dict(params=params, rhos=rhos, moments=moments, scales=scales, cols=cols, grads=grads,
                companded=companded)


def _clone(state):
    c = lambda ts: [t.clone() for t in ts] if ts is not None else None  # noqa: E731
    return dict(state, params=c(state["params"]), rhos=c(state["rhos"]), moments=[c(m) for m in state["moments"]],
                scales=[c(s) for s in state["scales"]])


def _step(case: Case, s, step: int, backend: str, skipped: torch.Tensor):
    OPTIMIZERS[case.opt].functional_step(s["params"], s["grads"][step], s["moments"], s["scales"], s["rhos"],
                                         step=step + 1, cols=s["cols"], companded=s["companded"],
                                         skipped=skipped, backend=backend)


def _tensors(s):
    out = list(s["params"]) + list(s["rhos"] or [])
    for m, sc in zip(s["moments"], s["scales"]):
        out += list(m) + list(sc or [])
    return out


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.is_floating_point():
        both_nan = a.isnan() & b.isnan()
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        differ = (a.view(width) != b.view(width)) & ~both_nan
    else:
        differ = a != b
    if differ.any():
        i = differ.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(differ.sum())} values differ, first at {i}: {a[tuple(i)]} vs "
                             f"{b[tuple(i)]}")


def _run(case: Case, seed: int = 0):
    state = _state(case, torch.Generator().manual_seed(seed))
    fused, ref = _clone(state), _clone(state)
    skipped_fused = torch.zeros((), dtype=torch.int32)
    skipped_ref = torch.zeros((), dtype=torch.int32)
    for step in range(STEPS):
        _step(case, fused, step, "cpu", skipped_fused)
        _step(case, ref, step, "reference", skipped_ref)
        for k, (a, b) in enumerate(zip(_tensors(fused), _tensors(ref))):
            assert_same_bits(a, b, f"step {step + 1}, tensor {k}")
        assert int(skipped_fused) == int(skipped_ref), f"step {step + 1}: skipped"
    return int(skipped_ref)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bitwise_against_reference(case):
    skipped = _run(case)
    assert skipped > 0  # the NaN / Inf groups were there and were skipped the same way


# bf16 parameters with fp32 or fp16 gradients (FSDP2 with an fp32 reduce dtype, a model whose loss is scaled in
# fp16): the vectorised paths load fp32 gradients in their own lane order; fp16 gradients take the block code
GRAD_DTYPE_CASES = [Case(opt, "bf16", bits, moments, False, grad_dtype=g)
                    for opt in ("adamw", "adam-l2", "sgd-nesterov", "lion") for bits in (24, 32)
                    for moments in ("q-comp", "q-linear") for g in ("fp32", "fp16")]


@pytest.mark.parametrize("case", GRAD_DTYPE_CASES, ids=lambda c: c.id)
def test_gradients_of_another_dtype(case):
    _run(case)


@pytest.mark.parametrize("case", [Case("adamw", "bf16", 24, "q-comp", False, ((300, 130),)),
                                  Case("lion", "fp16", 32, "fp32m", False, ((41, 1000),)),
                                  Case("sgdw", "fp32", None, "q-linear", True, ((40, 1001),))],
                         ids=lambda c: c.id)
def test_bitwise_multithreaded(case):
    """Tensors large enough to be spread over the intra-op threads."""
    torch.set_num_threads(max(2, torch.get_num_threads()))
    _run(case, seed=1)


def test_auto_backend_uses_fused_step_on_cpu():
    from flashdist.functional import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend("reference", torch.device("cpu")) == "reference"


def test_unsupported_tensors_fall_back_to_reference():
    """A non-contiguous parameter: ``auto`` runs the reference (same result), ``cpu`` refuses and changes
    nothing."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(8, 64, generator=gen)
    grad = torch.randn(32, 8, generator=gen)
    kw = dict(cols=None, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, decoupled=True)
    outs = []
    for backend in ("auto", "reference"):
        p = base.clone().t()[:32]
        m, v = torch.zeros(32, 8), torch.zeros(32, 8)
        flash_adam([p], [grad], [m], [v], None, None, None, backend=backend, **kw)
        outs.append((p, m, v))
    for a, b in zip(*outs):
        assert_same_bits(a, b, "auto vs reference")
    p = base.clone().t()[:32]
    before = p.clone()
    with pytest.raises(RuntimeError, match="backend='cpu'"):
        flash_adam([p], [grad], [torch.zeros(32, 8)], [torch.zeros(32, 8)], None, None, None, backend="cpu", **kw)
    assert torch.equal(p, before)


def test_step_bumps_version_counter():
    p, g = torch.zeros(4, 32), torch.ones(4, 32)
    before = p._version
    flash_sgd([p], [g], None, None, None, cols=None, lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
              nesterov=False, step=1, decoupled=False, backend="cpu")
    assert p._version > before and torch.all(p == -0.1)


def _subprocess(code: str, env: dict) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


def test_no_compiler_falls_back_with_one_warning(tmp_path):
    code = (
        "import warnings, torch\n"
        "from flashdist.functional import flash_adam\n"
        "p = torch.ones(2, 40); m = torch.zeros(2, 40); v = torch.zeros(2, 40)\n"
        "kw = dict(cols=None, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    for step in (1, 2):\n"
        "        flash_adam([p], [torch.ones(2, 40)], [m], [v], None, None, None, step=step, **kw)\n"
        "assert len([x for x in w if 'fused CPU step' in str(x.message)]) == 1, [str(x.message) for x in w]\n"
        "print(p[0, 0].item())\n"
    )
    out = _subprocess(code, {"FLASHDIST_CPU_BUILD_DIR": str(tmp_path), "CXX": str(tmp_path / "no-compiler")})
    assert out.returncode == 0, out.stderr
    assert abs(float(out.stdout.split()[-1]) - 0.8) < 1e-5  # two Adam steps of lr 0.1 from 1.0


def test_stale_build_lock_does_not_hang(tmp_path):
    """A build killed midway leaves torch's lock file; the next process (no live builder) removes it and
    finishes the build instead of waiting forever."""
    src = cpu.build_dir()
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    (dst / "built").unlink()
    (dst / "lock").write_text("")
    code = "from flashdist.kernels import cpu\nassert cpu.available(), cpu.build_error()\n"
    out = _subprocess(code, {"FLASHDIST_CPU_BUILD_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert not (dst / "lock").exists() and (dst / "built").exists()


@pytest.mark.parametrize("opt", ["sgd", "lion", "lion-fp32-moments", "adamw"])
@pytest.mark.parametrize("bits", [24, 32])
@pytest.mark.parametrize("lr", [0.0, 1e-3])
def test_split_and_merge_on_every_bf16_value(bits, lr, opt):
    """Every bf16 value, each with the low halves of fp32 that sit on or next to a rounding edge of the split
    (ties, the last rho step, carries into the exponent), including zeros, subnormals, the largest finite
    values, infinities and NaNs: merged and split again by an SGD, a Lion or an AdamW step (lr 0: the same
    master weights; lr 1e-3: moved ones) through the fused step and the reference, bitwise. SGD and Lion keep
    the split parameter differently until they store it (SGD checks it for infinities first), and FlashAdam(W)
    keeps it as Lion does; with fp32 moments the block code splits it (the vectorised path takes 8-bit moments). Among
    them: negative master weights in the upper half of the last bf16 step, which the reference splits to -inf
    (the parameter rounds to inf before any step up)."""
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    lo = torch.tensor([0, 1, 0x7F, 0x80, 0x81, 0xFF, 0x7F7F, 0x7F80, 0x7FFF, 0x8000, 0x8001, 0x807F, 0x8080,
                       0xFF7F, 0xFF80, 0xFFFF], dtype=torch.int64)
    theta = (hi[:, None] | lo[None, :]).to(torch.int32).view(torch.float32).reshape(1024, -1)
    param, rho = R.split(theta, torch.bfloat16, R.rho_dtype(bits))
    grad = torch.randn(theta.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    codes, scales = Q.quantize_exp_avg(torch.zeros(theta.shape), theta.shape[1], True)
    sq, sq_scales = Q.quantize_exp_avg_sq(torch.full(theta.shape, 1e-6), theta.shape[1], True)
    if opt == "lion-fp32-moments":
        codes, scales = torch.zeros(theta.shape), None
    runs = []
    for backend in ("cpu", "reference"):
        state = [t.clone() if t is not None else None for t in (param, rho, codes, scales, sq, sq_scales)]
        if opt == "adamw":
            flash_adam([state[0]], [grad], [state[2]], [state[4]], [state[3]], [state[5]], [state[1]],
                       cols=[theta.shape[1]], lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=2,
                       decoupled=True, companded=True, backend=backend)
        elif opt == "sgd":
            flash_sgd([state[0]], [grad], [state[2]], [state[3]], [state[1]], cols=[theta.shape[1]], lr=lr,
                      momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, step=2, decoupled=True,
                      backend=backend)
        else:
            flash_lion([state[0]], [grad], [state[2]], None if scales is None else [state[3]], [state[1]],
                       cols=[theta.shape[1]], lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.0, backend=backend)
        runs.append(state)
    for what, a, b in zip(("param", "rho", "moments", "scales", "second moments", "their scales"), *runs):
        if a is not None:
            assert_same_bits(a, b, what)
    if lr == 0.0:  # finite master weights of non-zero parameters come back as they were
        finite = runs[0][0].float().isfinite() & (param != 0)
        assert_same_bits(runs[0][0][finite], param[finite], "param")
        assert_same_bits(runs[0][1][finite], rho[finite], "rho")


@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512vl", "avx512vbmi"} <= _cpu_flags(),
                    reason="this CPU has no AVX-512 VBMI: the package's own build is already the one without it")
def test_avx512_path_without_vbmi(tmp_path):
    """The vectorised path as built on CPUs with AVX-512 F/BW/VL but no VBMI (Skylake-SP and Cascade Lake Xeons):
    the narrowing stores and the companded first moment's values take their fallbacks. Built here with the VBMI
    macro undefined, and bitwise against the reference on the 8-bit cases of every optimizer and on every bf16
    value's split."""
    src = _copy_source(tmp_path)
    src.write_text("#include <immintrin.h>\n#undef __AVX512VBMI__\n" + cpu.SOURCE.read_text())
    module = cpu.build_from(src)
    with cpu.using(module):
        assert cpu.vector_isa() == "avx512"
        for case in CASES:
            if case.moments.startswith("q") and case.dtype == "bf16" and case.bits == 24:
                _run(case)
        test_split_and_merge_on_every_bf16_value(24, 1e-3, "lion")
        test_first_moment_code_minus_128(True)


@pytest.mark.parametrize("companded", [True, False])
def test_first_moment_code_minus_128(companded):
    """-128, a first-moment code quantization never writes (a state from elsewhere may hold it), decodes as the
    reference decodes it: outside the lookup the fused step uses for companded codes."""
    gen = torch.Generator().manual_seed(5)
    shape = (3, 200)
    param, rho = R.split(torch.randn(shape, generator=gen) * 0.02, torch.bfloat16, R.rho_dtype(24))
    grad = (torch.randn(shape, generator=gen) * 1e-3).bfloat16()
    m, ms = Q.quantize_exp_avg(torch.randn(shape, generator=gen) * 1e-3, shape[1], companded)
    v, vs = Q.quantize_exp_avg_sq(torch.rand(shape, generator=gen) * 1e-6, shape[1], companded)
    m[0, 5] = m[2, 190] = -128
    runs = []
    for backend in ("cpu", "reference"):
        state = [t.clone() for t in (param, m, v, ms, vs, rho)]
        flash_adam([state[0]], [grad], [state[1]], [state[2]], [state[3]], [state[4]], [state[5]], cols=[shape[1]],
                   lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=3, decoupled=True,
                   companded=companded, backend=backend)
        runs.append(state)
    for what, a, b in zip(("param", "exp_avg", "exp_avg_sq", "scales", "sq scales", "rho"), *runs):
        assert_same_bits(a, b, what)
    assert not torch.equal(runs[0][0], param)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("bits", [None, 24, 32])
def test_sgd_skips_a_group_whose_new_parameter_is_not_finite(bits, decoupled):
    """FlashSGD(W) with 8-bit momentum skips a group whose new parameter is infinite or NaN while its momentum
    fits its scale: a step that overflows, an infinite and a NaN parameter (fp32 parameters, which the bitwise
    matrix above never drives there, and bf16 + rho), in whole groups and a row's last, partial one."""
    gen = torch.Generator().manual_seed(7)
    shape, cols = (3, 300), 300
    theta = torch.randn(shape, generator=gen) * 1e-2
    theta[0, 37], theta[1, 290], theta[2, 100] = 3e38, float("inf"), float("nan")
    grad = torch.randn(shape, generator=gen) * 1e-3
    grad[0, 37] = -1e37  # the momentum fits its scale, the step (lr 100) overflows
    if bits is None:
        param, rho = theta, None
    else:
        param, rho = R.split(theta, torch.bfloat16, R.rho_dtype(bits))
        grad = grad.bfloat16()
    buf, scales = Q.quantize_exp_avg(torch.randn(shape, generator=gen) * 1e-3, cols, True)
    runs, skipped = [], []
    for backend in ("cpu", "reference"):
        state = [t.clone() if t is not None else None for t in (param, buf, scales, rho)]
        count = torch.zeros((), dtype=torch.int32)
        flash_sgd([state[0]], [grad], [state[1]], [state[2]], None if rho is None else [state[3]], cols=[cols],
                  lr=100.0, momentum=0.9, dampening=0.0, weight_decay=1e-3, nesterov=False, step=2,
                  decoupled=decoupled, skipped=count, backend=backend)
        runs.append(state)
        skipped.append(int(count))
    for what, a, b in zip(("param", "momentum", "scales", "rho"), *runs):
        if a is not None:
            assert_same_bits(a, b, what)
    assert skipped[0] == skipped[1] == 3


@pytest.mark.skipif(not {"avx2", "avx512f", "avx512bw", "avx512vl"} <= _cpu_flags(),
                    reason="this CPU has no AVX-512: the package's own build is the AVX2 path, which the tests above "
                           "cover (or it has no AVX2 either)")
def test_avx2_path(tmp_path):
    """The vectorised path of CPUs with AVX2 but no AVX-512 (AMD Zen 1-3, Intel client cores), built here with the
    AVX-512 macros undefined, bitwise against the reference on the 8-bit cases of every optimizer (FlashAdam(W),
    FlashSGD(W), FlashLion; whole blocks, a row's partial block, bf16 and fp32 parameters, bf16 parameters with fp32
    gradients), on parameters of every bf16 value (AdamW; SGD, which checks the split parameter for infinities
    before it stores it; Lion) and on SGD groups skipped for a parameter that is not finite."""
    src = _copy_source(tmp_path)
    src.write_text("#include <immintrin.h>\n#undef __AVX512F__\n" + cpu.SOURCE.read_text())
    with cpu.using(cpu.build_from(src)):
        assert cpu.vector_isa() == "avx2"
        for case in CASES + GRAD_DTYPE_CASES:
            if case.moments.startswith("q"):
                _run(case)
        for bits in (24, 32):
            test_split_and_merge_on_every_bf16_value(bits, 1e-3, "adamw")
        test_split_and_merge_on_every_bf16_value(24, 1e-3, "lion")
        test_split_and_merge_on_every_bf16_value(24, 1e-3, "sgd")
        for bits in (None, 24):
            test_sgd_skips_a_group_whose_new_parameter_is_not_finite(bits, True)
        test_first_moment_code_minus_128(True)


# ----- FlashMuon's elementwise phases (momentum, weight update): one tensor per call -------------------------

MUON_CASES = ([(d, b, m, True) for d, b, m in itertools.product(DTYPES, (24, 32, None), MOMENTS)
               if d != "fp32" or b is None] + [("bf16", 24, m, False) for m in MOMENTS])


def _muon_stepped(case, backend: str) -> list[torch.Tensor]:
    from flashdist import FlashMuon

    dtype, bits, moments, nesterov = case
    quantize, companded = MOMENTS[moments]
    gen = torch.Generator().manual_seed(0)
    shapes = ((5, 70), (40, 16), (3, 4, 24), (300, 257))  # odd rows, a stack of matrices, a parallel one
    params = [torch.nn.Parameter(_params(s, DTYPES[dtype], gen).reshape(s)) for s in shapes]
    opt = FlashMuon(params, lr=0.02, nesterov=nesterov, momentum=0.3 if not nesterov else 0.95, flatten=False,
                    master_weight_bits=bits, quantize_states=quantize, companded=companded, backend=backend)
    for step in range(3):
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-4, 3, p.shape, generator=gen)
            if step == 1 and p.ndim == 3:
                g[1, 2, 5] = float("nan")  # that matrix keeps its weight, its momentum group its buffer
            if step == 2 and p.shape == (40, 16):
                g[3, :] = 3e38  # a buffer that overflows: its groups keep theirs
            p.grad = g.to(p.dtype)
        opt.step()
    return [t for p in params for t in (p.detach(), opt.master_weight(p), *opt.state[p].values())] + [opt.skipped]


@pytest.mark.parametrize("case", MUON_CASES,
                         ids=lambda c: f"{c[0]}-{c[1] or 'nosplit'}-{c[2]}-{'nesterov' if c[3] else 'plain'}")
def test_muon_phases_match_the_reference_bitwise(case):
    """backend='cpu' (an error where the fused phases cannot run, never the reference in their place) against
    the reference, bit for bit, NaN payloads aside, over 3 steps with a non-finite gradient and an overflowing
    buffer."""
    got, want = _muon_stepped(case, "cpu"), _muon_stepped(case, "reference")
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        same = (a == b) | (torch.isnan(a.float()) & torch.isnan(b.float()) if a.is_floating_point() else False)
        assert a.dtype == b.dtype and bool(same.all()), f"tensor {i} differs from the reference's"
