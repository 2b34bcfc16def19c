"""What the ONNX tests share: ONNX Runtime sessions on one thread and the comparison with eager
(every element within RTOL of the largest eager magnitude). Imported after the test module's
importorskip of the onnx packages."""

import onnxruntime as ort
import pytest
import torch

RTOL = 1e-4


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """The PyTorch ops on CPU tensors (eager Triton would run under the interpreter)."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "torch")


def assert_rel_close(name: str, actual, expected: torch.Tensor, rtol: float = RTOL) -> None:
    """Same shape, and max |actual - expected| <= rtol * max |expected|."""
    actual = torch.as_tensor(actual)
    assert tuple(actual.shape) == tuple(expected.shape), f"{name}: shape {actual.shape}"
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol:g} x {scale:.3g}"


def session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # the CI machine's two cores run two test workers
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
