"""Models built on the scan, exported to ONNX and run in ONNX Runtime against eager: the Mamba
layer, MambaLMHeadModel's forward, its prefill and decode step with greedy generation, a
VMamba-style 2D block (four scan directions through grouped B/C) and the Triton op's
translation. float32, every element within 1e-4 of the largest eager magnitude; dynamic sizes
are checked at sizes other than the traced ones."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from onnx_helpers import assert_rel_close, session, torch_backend  # noqa: E402, F401

import selective_scan.onnx as sso  # noqa: E402
from selective_scan import Mamba, MambaLMHeadModel, ops, selective_scan_fn  # noqa: E402
from selective_scan.onnx.decoding import OrtDecoder, export_decoder  # noqa: E402


def run(sess, *arrays: torch.Tensor) -> list:
    feed = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), arrays, strict=True)}
    return sess.run(None, feed)


BATCH = torch.export.Dim("batch", min=2)
SEQLEN = torch.export.Dim("seqlen", min=2)


def test_mamba_layer(tmp_path):
    torch.manual_seed(0)
    layer = Mamba(d_model=16, d_state=8).eval()
    path = tmp_path / "mamba.onnx"
    with torch.no_grad():
        sso.export(layer, (torch.randn(2, 20, 16),), path,
                   dynamic_shapes={"hidden_states": {0: BATCH, 1: SEQLEN}})  # fmt: skip
        sess = session(path)
        for shape in ((2, 20, 16), (3, 57, 16), (1, 1, 16)):
            x = torch.randn(shape)
            assert_rel_close(f"out at {shape}", run(sess, x)[0], layer(x))


class Packed(nn.Module):
    def __init__(self, layer: Mamba):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, cu_seqlens):
        return self.layer(hidden_states, cu_seqlens=cu_seqlens)


def test_mamba_layer_packed_sequences(tmp_path):
    """Sequences packed along the length (the varlen conv and cu_seqlens in the scan), the
    total length dynamic. The number of sequences is fixed: with it dynamic, torch.onnx's
    decomposition of the varlen conv's index arithmetic (a tensor plus a symbolic size) fails."""
    torch.manual_seed(4)
    model = Packed(Mamba(d_model=16, d_state=8)).eval()
    path = tmp_path / "packed.onnx"
    cu = torch.tensor([0, 7, 7, 20, 30], dtype=torch.int32)
    with torch.no_grad():
        sso.export(model, (torch.randn(1, 30, 16), cu), path,
                   dynamic_shapes=({1: SEQLEN}, None))  # fmt: skip
        sess = session(path)
        for bounds in ([0, 7, 7, 20, 30], [0, 1, 20, 20, 41], [0, 0, 3, 9, 9]):
            x = torch.randn(1, bounds[-1], 16)
            cu = torch.tensor(bounds, dtype=torch.int32)
            assert_rel_close(f"out for {bounds}", run(sess, x, cu)[0], model(x, cu))


class LayerStep(nn.Module):
    def __init__(self, layer: Mamba):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, conv_state, ssm_state):
        return self.layer.step(hidden_states, conv_state, ssm_state)


def test_mamba_layer_step_updating_its_inputs(tmp_path):
    """Mamba.step writes into the states it is given: the file returns them as outputs."""
    torch.manual_seed(5)
    layer = Mamba(d_model=16, d_state=8).eval()
    model = LayerStep(layer)
    path = tmp_path / "layer_step.onnx"
    states = [torch.randn_like(t) for t in layer.allocate_inference_cache(2, 0)]
    with torch.no_grad():
        sso.export(model, (torch.randn(2, 1, 16), *states), path,
                   dynamic_shapes=({0: BATCH}, {0: BATCH}, {0: BATCH}))  # fmt: skip
        sess = session(path)
        for batch in (2, 5):
            x = torch.randn(batch, 1, 16)
            states = [torch.randn(batch, *t.shape[1:]) for t in states]
            got = run(sess, x, *states)
            expected = model(x, *(t.clone() for t in states))
            for name, a, e in zip(("out", "conv_state", "ssm_state"), got, expected, strict=True):
                assert_rel_close(f"{name} at batch {batch}", a, e)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(1)
    return MambaLMHeadModel(d_model=16, n_layer=2, vocab_size=32, ssm_cfg={"d_state": 8}).eval()


def test_lm_forward(lm, tmp_path):
    path = tmp_path / "lm.onnx"
    with torch.no_grad():
        sso.export(lm, (torch.randint(0, 32, (2, 16)),), path,
                   dynamic_shapes={"input_ids": {0: BATCH, 1: SEQLEN}})  # fmt: skip
        sess = session(path)
        for shape in ((2, 16), (3, 41), (1, 5)):
            ids = torch.randint(0, 32, shape)
            assert_rel_close(f"logits at {shape}", run(sess, ids)[0], lm(ids))


def test_lm_greedy_generation_and_decode_step(lm, tmp_path):
    prefill, step = export_decoder(lm, tmp_path)
    decoder = OrtDecoder(prefill, step)
    # Prefill and one step at a batch and prompt length other than the traced ones.
    prompt = torch.randint(0, 32, (3, 9))
    logits, states = decoder.prefill(prompt.numpy())
    with torch.no_grad():
        expected_logits, cache = lm.prefill(prompt)
        assert_rel_close("prefill logits", logits, expected_logits)
        expected_states = [t for pair in cache for t in pair]
        for i, (a, e) in enumerate(zip(states, expected_states, strict=True)):
            assert_rel_close(f"prefill state {i}", a, e)
        token = expected_logits[:, -1:].argmax(-1)
        logits, states = decoder.step(token.numpy(), states)
        expected_logits, cache = lm.step(token, cache)
        assert_rel_close("step logits", logits, expected_logits)
        for i, (a, e) in enumerate(zip(states, [t for p in cache for t in p], strict=True)):
            assert_rel_close(f"step state {i}", a, e)
        for batch in (3, 1):
            prompt = torch.randint(0, 32, (batch, 7))
            expected = lm.generate(prompt, max_new_tokens=12)
            np.testing.assert_array_equal(decoder.generate(prompt, 12), expected.numpy())


class SS2D(nn.Module):
    """A VMamba-style 2D selective scan block: (batch, H, W, d_model) -> same shape.

    The feature map is read in four directions (rows, columns, and both reversed); each
    direction has its own projections and is one group of B and C, so one grouped scan over
    4 * d_inner channels runs all four. The outputs are turned back to row-major order and
    summed."""

    K = 4  # directions

    def __init__(self, d_model: int = 8, d_inner: int = 12, d_state: int = 4, rank: int = 2):
        super().__init__()
        K = self.K
        self.d_inner, self.d_state, self.rank = d_inner, d_state, rank
        self.in_proj = nn.Linear(d_model, 2 * d_inner)
        self.conv = nn.Conv2d(d_inner, d_inner, 3, padding=1, groups=d_inner)
        self.x_proj = nn.Parameter(torch.randn(K, rank + 2 * d_state, d_inner) * d_inner**-0.5)
        self.dt_proj = nn.Parameter(torch.randn(K, d_inner, rank) * rank**-0.5)
        self.dt_bias = nn.Parameter(torch.rand(K * d_inner) - 4.0)
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(K * d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(K * d_inner))
        self.norm = nn.LayerNorm(d_inner)
        self.out_proj = nn.Linear(d_inner, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, H, W, _ = x.shape
        x, z = self.in_proj(x).chunk(2, dim=-1)
        x = F.silu(self.conv(x.permute(0, 3, 1, 2)))  # (batch, d, H, W)
        rows, cols = x.flatten(2), x.transpose(2, 3).flatten(2)  # (batch, d, L)
        xs = torch.stack([rows, cols, rows.flip(-1), cols.flip(-1)], dim=1)  # (b, K, d, L)
        x_dbl = torch.einsum("bkdl,kcd->bkcl", xs, self.x_proj)
        dt, B, C = x_dbl.split([self.rank, self.d_state, self.d_state], dim=2)
        dt = torch.einsum("bkrl,kdr->bkdl", dt, self.dt_proj)
        L = H * W
        y = selective_scan_fn(
            xs.reshape(batch, -1, L), dt.reshape(batch, -1, L), -torch.exp(self.A_log),
            B.contiguous(), C.contiguous(), self.D, delta_bias=self.dt_bias,
            delta_softplus=True,
        ).view(batch, self.K, self.d_inner, L)  # fmt: skip
        y_rows = y[:, 0] + y[:, 2].flip(-1)
        y_cols = y[:, 1] + y[:, 3].flip(-1)
        y_cols = y_cols.view(batch, self.d_inner, W, H).transpose(2, 3).reshape(batch, -1, L)
        y = self.norm((y_rows + y_cols).transpose(1, 2)).view(batch, H, W, -1)
        return self.out_proj(y * F.silu(z))


def test_vision_block_four_directions(tmp_path):
    torch.manual_seed(2)
    block = SS2D().eval()
    path = tmp_path / "ss2d.onnx"
    H, W = torch.export.Dim("H", min=2), torch.export.Dim("W", min=2)
    with torch.no_grad():
        sso.export(block, (torch.randn(2, 5, 6, 8),), path,
                   dynamic_shapes={"x": {0: BATCH, 1: H, 2: W}})  # fmt: skip
        sess = session(path)
        for shape in ((2, 5, 6, 8), (3, 4, 7, 8), (1, 9, 3, 8)):
            x = torch.randn(shape)
            assert_rel_close(f"out at {shape}", run(sess, x)[0], block(x))


class TritonScan(nn.Module):
    """The Triton forward op itself, all three outputs (checkpoints every 128 steps)."""

    def __init__(self, dim: int = 8, dstate: int = 4):
        super().__init__()
        self.A = nn.Parameter(-torch.rand(dim, dstate) - 0.1)
        self.D = nn.Parameter(torch.randn(dim))

    def forward(self, u, delta, B, C, z):
        return torch.ops.selective_scan.scan_fwd_triton(
            u, delta, self.A, B, C, self.D, z, None, None, None, True
        )


# Tracing the Triton op runs its kernels' launcher, which the interpreter cannot do on fake
# tensors: the Triton op exports on CUDA only.
@pytest.mark.skipif(not (ops.HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA")
def test_triton_op_translation(tmp_path, monkeypatch):
    """Exported on CUDA (the graph holds scan_fwd_triton), run in ONNX Runtime on CPU and
    compared with the eager op: out and last_state, and the checkpoints' shape."""
    torch.manual_seed(3)
    layer = TritonScan().eval().cuda()
    g = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    args = (g(2, 8, 30), g(2, 8, 30).sigmoid(), g(2, 4, 30), g(2, 4, 30), g(2, 8, 30))
    path = tmp_path / "triton.onnx"
    dims = {0: BATCH, 2: SEQLEN}
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    with torch.no_grad():
        program = sso.export(layer, args, path, dynamic_shapes=(dims,) * 5)
        assert "scan_fwd_triton" in str(program.exported_program.graph)
        args = (g(3, 8, 50), g(3, 8, 50).sigmoid(), g(3, 4, 50), g(3, 4, 50), g(3, 8, 50))
        expected = layer(*args)
    got = run(session(path), *(a.cpu() for a in args))
    for name, a, e in zip(("out", "last_state"), got, expected, strict=False):
        assert_rel_close(name, a, e.cpu())
    assert tuple(got[2].shape) == tuple(expected[2].shape)
