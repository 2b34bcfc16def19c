"""torch.export with dynamic batch and seqlen, save/load, and an AOTInductor package."""

import pytest
import torch
from helpers import assert_close, make_inputs

from selective_scan import selective_scan_fn

SCAN_FWD = torch.ops.selective_scan.scan_fwd.default
ARGS = ("u", "delta", "B", "C", "z")


class ScanLayer(torch.nn.Module):
    """The scan as a model uses it: A, D and delta_bias are parameters, the rest inputs."""

    def __init__(self, dim: int = 8, dstate: int = 4):
        super().__init__()
        weights = make_inputs(dim=dim, dstate=dstate, seed=100)
        self.A_log = torch.nn.Parameter(torch.log(-weights["A"]))
        self.D = torch.nn.Parameter(weights["D"])
        self.delta_bias = torch.nn.Parameter(weights["delta_bias"])

    def forward(self, u, delta, B, C, z):
        A = -torch.exp(self.A_log)
        return selective_scan_fn(
            u, delta, A, B, C, self.D, z, self.delta_bias,
            delta_softplus=True, return_last_state=True,
        )  # fmt: skip


def example(batch: int, seqlen: int, seed: int = 0) -> tuple:
    inputs = make_inputs(batch=batch, seqlen=seqlen, b_form="grouped", seed=seed)  # B: (b, g, n, L)
    return tuple(inputs[k] for k in ARGS)


@pytest.fixture(scope="module", autouse=True)
def hermetic_compile():
    """The PyTorch ops on CPU tensors (Triton under the interpreter cannot be exported), and no
    on-disk compile caches (they were seen to serve stale code after a change to the op's fake).
    Module scope, so that both are in place before the module-scoped export and package."""
    with (
        pytest.MonkeyPatch.context() as mp,
        torch._inductor.config.patch(force_disable_caches=True),
    ):
        mp.setenv("SELECTIVE_SCAN_BACKEND", "torch")
        yield


@pytest.fixture(scope="module")
def layer():
    return ScanLayer().eval()


@pytest.fixture(scope="module")
def exported(layer):
    # Sizes 0 and 1 would specialize: both dims are dynamic from 2 up.
    batch, seqlen = torch.export.Dim("batch", min=2), torch.export.Dim("seqlen", min=2)
    dims = {name: {0: batch, 2: seqlen} for name in ARGS} | {"B": {0: batch, 3: seqlen}}
    return torch.export.export(layer, example(3, 70), dynamic_shapes=dims)


@pytest.fixture(scope="module")
def package(exported, tmp_path_factory):
    """AOTInductor compiles for tens of seconds on this 2-core machine: once per module."""
    path = tmp_path_factory.mktemp("aoti") / "scan.pt2"
    return torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


def scan_nodes(program) -> int:
    return sum(node.target == SCAN_FWD for node in program.graph.nodes)


def assert_matches_eager(run, layer, batch: int, seqlen: int, tol: float = 1e-6) -> None:
    args = example(batch, seqlen, seed=batch * 1000 + seqlen)
    with torch.no_grad():
        expected_out, expected_last = layer(*args)
        out, last = run(*args)
    assert_close("out", out, expected_out, tol)
    assert_close("last_state", last, expected_last, tol)


def test_one_scan_node(exported):
    assert scan_nodes(exported) == 1
    assert scan_nodes(exported.run_decompositions()) == 1


@pytest.mark.parametrize(("batch", "seqlen"), [(2, 2), (5, 64), (2, 65), (4, 200)])
def test_exported_matches_eager(exported, layer, batch, seqlen):
    assert_matches_eager(exported.module(), layer, batch, seqlen)


def test_save_load_round_trip(exported, layer, tmp_path):
    path = tmp_path / "scan.pt2"
    torch.export.save(exported, path)
    loaded = torch.export.load(path)
    assert scan_nodes(loaded) == 1
    assert_matches_eager(loaded.module(), layer, batch=2, seqlen=150)


@pytest.mark.parametrize(("batch", "seqlen"), [(2, 150), (4, 9)])
def test_aoti_package_matches_eager(package, layer, batch, seqlen):
    # Inductor compiles -exp(A_log) itself: its vectorized exp may differ in the last bit.
    loaded = torch._inductor.aoti_load_package(package)
    assert_matches_eager(loaded, layer, batch, seqlen, tol=1e-5)
