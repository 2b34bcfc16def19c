"""Test configuration shared by every test module.

Without a GPU, Triton kernels run under the Triton interpreter on CPU tensors: TRITON_INTERPRET
must be set before triton decorates any kernel, i.e. before selective_scan is imported.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from selective_scan import ops  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
INTERPRETER_ON = ops.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETER_ON:
    import interpreter_speedups

    interpreter_speedups.install()
# Triton kernels run on CUDA tensors, or under the interpreter on CPU tensors.
TRITON_RUNS = (ops.HAS_TRITON and HAS_CUDA) or INTERPRETER_ON
BACKENDS = ["torch", "triton"] if TRITON_RUNS else ["torch"]


# Under the interpreter every Triton program runs in Python, so the option grids take far longer
# there than on the torch backend. Those runs carry the "interpreter" mark: `pytest -m "not
# interpreter"` runs the rest, `pytest -m interpreter` only them.
INTERPRETED = TRITON_RUNS and not HAS_CUDA


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "interpreter: runs the Triton kernels under the Triton interpreter (slow)"
    )


def pytest_collection_modifyitems(items):
    if not INTERPRETED:
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "triton":
            item.add_marker(pytest.mark.interpreter)


@pytest.fixture(autouse=True)
def _exact_first_exp():
    """Torch 2.13's CPU build: the first float32 exp of a process may be inaccurate on the
    second thread (shared notes); a tiny single-threaded call first makes it go away."""
    torch.exp(torch.zeros(1))


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Run the public functions on each available backend (SELECTIVE_SCAN_BACKEND)."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", request.param)
    return request.param


@pytest.fixture
def poison_uninitialized():
    """Fill every torch.empty with NaN (and integers with their maximum) while the test runs, so
    an output element the op allocates but never writes shows up as non-finite."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = was_filling
    torch.use_deterministic_algorithms(was_deterministic)
