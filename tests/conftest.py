"""Test setup. Three ways to run the suite:
- `--device cpu` (the default): the Triton kernels in the interpreter. TRITON_INTERPRET=1 is
  set here before pintail is imported (kernels pick interpreter or compiler when they are
  defined), and the torch reference is made to raise, so a test passes only through a kernel.
- `--device cpu --path reference`: the plain torch path a CPU user gets without the
  interpreter (and that float64 takes everywhere); tests of kernel internals skip.
- `--device cuda`: the same tests, compiled kernels on a GPU.
"""

import os
import random
import tempfile
import zlib

import numpy as np
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"],
                     help="cpu: Triton interpreter (the default); cuda: compiled kernels on the GPU")
    parser.addoption("--path", default="kernels", choices=["kernels", "reference"],
                     help="kernels: the Triton kernels (the default); reference: the plain torch path, CPU only")
    parser.addoption("--fuzz-seeds", type=int, default=0,
                     help="test_fuzz.py: this many fresh random seeds instead of the fixed 0 and 1")


def reference_path(config) -> bool:
    return config.getoption("path") == "reference"


def pytest_configure(config):
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability:  # inductor's CPU code cached under one capability ran wrong under another (torch 2.13)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                              os.path.join(tempfile.gettempdir(), f"torchinductor-{capability}"))
    config.addinivalue_line("markers", "uses_reference: the test expects the torch reference path")
    config.addinivalue_line("markers", "kernels_only: the test is about the kernels (plans, launches); "
                                       "skipped on the reference path")
    config.addinivalue_line("markers", "gpu_only: a property only a GPU can show (races, cross-program "
                                       "waits, determinism across program orders); skipped on the CPU")
    config.addinivalue_line("markers", "large: past 2^31 elements, GBs of GPU memory; tools/gpu_check.py runs "
                                       "these one at a time")
    if config.getoption("fuzz_seeds"):  # one draw for the run: pytest-xdist's workers must agree
        os.environ.setdefault("PINTAIL_FUZZ_BASE", str(random.SystemRandom().randrange(2**63)))
    if reference_path(config):
        if config.getoption("device") != "cpu":
            raise pytest.UsageError("--path reference runs on the CPU only")
        os.environ.pop("TRITON_INTERPRET", None)
    elif config.getoption("device") == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        round_bf16_as_the_gpu()


def pytest_collection_modifyitems(config, items):
    on_reference = reference_path(config)
    on_cpu = config.getoption("device") == "cpu"
    for item in items:
        if on_reference and item.get_closest_marker("kernels_only"):
            item.add_marker(pytest.mark.skip(reason="kernels only: not on the reference path"))
        if on_cpu and item.get_closest_marker("gpu_only"):
            item.add_marker(pytest.mark.skip(reason="GPU only: the interpreter runs programs one at a time"))


class CompileCount:
    """Triton's compilations on a GPU run (kernel variants built, seconds spent, variants loaded
    from the disk cache), summed over pytest-xdist's workers: the suite's cost on a GPU is
    mostly compilation, and the summary says how much."""

    def __init__(self):
        self.built, self.seconds, self.loaded = 0, 0.0, 0

    def listen(self, *, cache_hit, times, **_):
        if cache_hit:
            self.loaded += 1
        else:
            self.built += 1
            self.seconds += times.total / 1e6

    def add(self, counts):
        self.built += counts[0]
        self.seconds += counts[1]
        self.loaded += counts[2]

    def totals(self):
        return self.built, self.seconds, self.loaded


COMPILES = CompileCount()


def pytest_sessionstart(session):
    if session.config.getoption("device") == "cuda":
        import triton
        triton.knobs.compilation.listener = COMPILES.listen


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: hand the counts to the controller
        session.config.workeroutput["triton_compiles"] = COMPILES.totals()


def pytest_runtest_logreport(report):
    """With PINTAIL_FAILURE_LOG set (tools/gpu_check.py sets it), each failure's id and message
    go to that file as it happens: a run stopped by a time limit keeps them."""
    path = os.environ.get("PINTAIL_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes once
        crash = getattr(report.longrepr, "reprcrash", None)
        message = (crash.message if crash else str(report.longrepr)).strip().splitlines()
        with open(path, "a") as stream:
            stream.write(f"{report.nodeid} ({report.when}): {message[0][:300] if message else '(no message)'}\n")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    COMPILES.add(getattr(node, "workeroutput", {}).get("triton_compiles", (0, 0.0, 0)))


def pytest_terminal_summary(terminalreporter):
    """On a GPU, what compilation cost; how many tests skipped, and why: CI's log shows what
    the CPU could not check."""
    built, seconds, loaded = COMPILES.totals()
    if built or loaded:
        terminalreporter.write_line(f"Triton compiled {built} kernel variants in {seconds:.0f} s "
                                    f"(summed over workers); {loaded} loaded from its cache")
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("skipped, by reason")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{count:5d}  {reason}")


def round_bf16_as_the_gpu():
    """Triton 3.6's interpreter casts float32 to bfloat16 by dropping the low bits; the GPU
    rounds to nearest even. Make the interpreter round as the GPU does (torch's cast is
    round-to-nearest-even), so that bf16 tests measure the kernel users get."""
    import triton.language as tl
    from triton.runtime import interpreter

    def to_bf16(data):  # round to nearest even on the bits (numpy: no torch op for tests to see)
        values = np.ascontiguousarray(data, dtype=np.float32)
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)

    builder = interpreter.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def rounded_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(to_bf16(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def rounded_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16 and \
                rounding_mode != interpreter._ir.ROUNDING_MODE.RTZ:
            return interpreter.TensorHandle(to_bf16(src.data), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = rounded_cast  # create_fp_trunc and the other casts call it through self
    builder.create_fp_to_fp = rounded_fp_to_fp


@pytest.fixture(scope="session")
def device(pytestconfig):
    name = pytestconfig.getoption("device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda asked for, but torch sees no GPU", returncode=2)
    return torch.device(name)


@pytest.fixture(scope="session")
def on_reference(pytestconfig):
    """Whether the suite runs the plain torch path (no kernels)."""
    return reference_path(pytestconfig)


@pytest.fixture(autouse=True)
def forbid_reference(request, monkeypatch):
    """On the kernel paths every test must reach the kernels: the torch reference raises
    unless a test is marked `uses_reference` (float64, which the kernels leave to torch)."""
    if request.node.get_closest_marker("uses_reference") or reference_path(request.config):
        return
    import pintail.reference as reference

    on_gpu = request.config.getoption("device") == "cuda"

    def refusing(function):
        def refuse(*args, **kwargs):
            # on a GPU run, CPU tensors take the reference legitimately (pintail.patch proves its
            # swaps on CPU stand-ins); anything else must have reached a kernel
            if on_gpu and all(t.device.type == "cpu" for t in _tensors(args, kwargs)):
                return function(*args, **kwargs)
            raise AssertionError("the torch reference ran where a Triton kernel should have")
        return refuse

    for name, value in vars(reference).items():
        if callable(value) and getattr(value, "__module__", None) == reference.__name__:
            monkeypatch.setattr(reference, name, refusing(value))


def _tensors(args, kwargs):
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


@pytest.fixture(autouse=True)
def seeded(request):
    """Each test draws its random inputs from a seed of its own id, so that what it draws does
    not depend on which tests ran before it in its process: pytest-xdist hands tests to its
    processes in a different order each run."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
