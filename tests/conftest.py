"""Test setup. On CPU the suite runs the Triton kernels in the interpreter: TRITON_INTERPRET=1
is set here before pintail is imported (kernels pick interpreter or compiler when they are
defined), and the torch reference is made to raise, so a test passes only through a kernel.
`--device cuda` runs the same tests compiled on a GPU."""

import os
import zlib

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"],
                     help="cpu: Triton interpreter (the default); cuda: compiled kernels on the GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "uses_reference: the test expects the torch reference path")
    if config.getoption("device") == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device(pytestconfig):
    name = pytestconfig.getoption("device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda asked for, but torch sees no GPU", returncode=2)
    return torch.device(name)


@pytest.fixture(autouse=True)
def forbid_reference(request, monkeypatch):
    """Every test must reach the kernels: the torch reference raises unless a test is
    marked `uses_reference` (float64, which the kernels leave to torch)."""
    if request.node.get_closest_marker("uses_reference"):
        return
    import pintail.reference as reference

    def refuse(*args, **kwargs):
        raise AssertionError("the torch reference ran where a Triton kernel should have")

    for name, value in vars(reference).items():
        if callable(value) and getattr(value, "__module__", None) == reference.__name__:
            monkeypatch.setattr(reference, name, refuse)


@pytest.fixture(autouse=True)
def seeded(request):
    """Each test draws its random inputs from a seed of its own id, so that what it draws does
    not depend on which tests ran before it in its process: pytest-xdist hands tests to its
    processes in a different order each run."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
