"""Complex A (mamba_ssm's complex-valued scan): the reference against an independent loop, the
ops' gradients against finite differences, opcheck, compile and export, mamba_inner_fn, checks;
on both backends (``backend``: the PyTorch code and the Triton kernels of
kernels/complex_scan.py), and the kernels against the PyTorch code.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKENDS, DEVICE, TRITON_RUNS
from helpers import complex_inputs
from torch.library import opcheck

from selective_scan import mamba_inner_fn, ops, selective_scan_fn, selective_scan_ref
from selective_scan.kernels.launch import recording

F64, C128 = torch.float64, torch.complex128


def loop_oracle(x: dict) -> tuple:
    """mamba_ssm's complex semantics written out step by step in complex128: y = 2 Re(C h)."""
    u, z, A = x["u"].double(), x["z"].double(), x["A"].to(C128)
    delta = F.softplus(x["delta"].double() + x["delta_bias"][:, None])
    batch, dim, seqlen = u.shape

    def per_step(t):  # -> (batch, dim, dstate, seqlen) complex
        if t.dim() == 2:
            return t.to(C128)[None, :, :, None].expand(batch, dim, t.shape[1], seqlen)
        t = torch.complex(t[..., 0::2].double(), t[..., 1::2].double())
        t = t if t.dim() == 4 else t[:, None]
        return t.repeat_interleave(dim // t.shape[1], dim=1)

    B, C = per_step(x["B"]), per_step(x["C"])
    h, ys = x["initial_state"].to(C128), []
    for t in range(seqlen):
        h = (
            torch.exp(delta[..., t, None] * A) * h
            + (delta[..., t] * u[..., t])[..., None] * B[..., t]
        )
        ys.append(2 * (h * C[..., t]).sum(-1).real)
    y = torch.stack(ys, -1) + u * x["D"][:, None]
    return y * F.silu(z), h


@pytest.mark.parametrize(("form_b", "form_c"), [("variable", "constant"), ("constant", "grouped"),
                                                ("grouped", "variable")])  # fmt: skip
def test_reference_matches_loop(form_b, form_c):
    x = complex_inputs(form_b, form_c)
    out, last = selective_scan_ref(**x, delta_softplus=True, return_last_state=True)
    want_out, want_last = loop_oracle(x)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, want_last, rtol=1e-12, atol=1e-12)


# One chunk, two, three (cpu.CHUNK 64), whole Jacobians or by random projections (fast_mode);
# the kernels' three chunks: test_kernels_match_the_torch_code.
GRADCHECK_CASES = [(5, "torch", False), (70, "torch", False), (130, "torch", True),
                   (5, "triton", True), (70, "triton", True)]  # fmt: skip


@pytest.mark.parametrize(("seqlen", "backend", "fast"),
                         [c for c in GRADCHECK_CASES if c[1] in BACKENDS],
                         indirect=["backend"])  # fmt: skip
def test_op_gradients_match_finite_differences(seqlen, backend, fast):
    """The ops' backward for complex A against finite differences of the forward (gradcheck
    checks both Wirtinger derivatives), through last_state and initial_state too. Whole
    Jacobians take a forward per input element: the kernels (the interpreter runs a forward in
    tenths of a second) and the longest sequence go by random projections."""
    x = complex_inputs(batch=1, dim=2, dstate=2, seqlen=seqlen)
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]
    leaves = [x[k].detach().requires_grad_(True) for k in names]

    def scan(*tensors):
        return selective_scan_fn(*tensors[:8], delta_softplus=True, return_last_state=True,
                                 initial_state=tensors[8])  # fmt: skip

    assert torch.autograd.gradcheck(scan, leaves, atol=1e-6, rtol=1e-5, fast_mode=fast)


@pytest.mark.parametrize(("form_b", "form_c", "options"), [
    ("variable", "constant", {}), ("constant", "grouped", {}), ("grouped", "variable", {}),
    ("variable", "variable", dict(D=None)), ("constant", "constant", dict(z=None, delta_bias=None)),
    ("grouped", "grouped", dict(initial_state=None)),
], ids=["var-const", "const-grouped", "grouped-var", "no-D", "no-z-bias", "no-h0"])  # fmt: skip
@pytest.mark.usefixtures("poison_uninitialized")
def test_kernels_match_the_torch_code(form_b, form_c, options, monkeypatch):
    """The Triton kernels' forward and every gradient (with dlast_state) equal the PyTorch
    code's in float64, across three chunks, with outputs poisoned before the kernels write."""
    if not TRITON_RUNS:
        pytest.skip("needs triton on a GPU or under the interpreter")
    x = complex_inputs(form_b, form_c, seqlen=130) | options
    names = [k for k, v in x.items() if v is not None]
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", backend)
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in x.items() if v is not None}
        out, last = selective_scan_fn(**leaves, delta_softplus=True, return_last_state=True)
        gen = torch.Generator().manual_seed(1)
        w_out = torch.randn(out.shape, generator=gen, dtype=F64).to(DEVICE)
        w_last = torch.randn(last.shape, generator=gen, dtype=C128).to(DEVICE)
        loss = (out * w_out).sum() + (last * w_last.conj()).real.sum()
        results[backend] = (out, last, *torch.autograd.grad(loss, [leaves[k] for k in names]))
    for name, got, want in zip(["out", "last", *names], results["triton"], results["torch"],
                               strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11, msg=name)


@pytest.mark.usefixtures("poison_uninitialized")
def test_kernels_match_the_torch_code_in_float32_and_bfloat16(monkeypatch):
    """float32 then bfloat16 inputs of one shape in one process (a launcher compiled for one
    dtype must not serve the other), channels-last u, delta and z, several blocks of channels,
    17 states (padded to 32), constant C and grouped B: the kernels against the PyTorch code,
    both computing in float32. One sequence (the interpreter runs a program at a time)."""
    if not TRITON_RUNS:
        pytest.skip("needs triton on a GPU or under the interpreter")
    base = complex_inputs("grouped", "constant", batch=1, dim=40, dstate=17, seqlen=70,
                          dtype=torch.float32)  # fmt: skip
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        x = dict(base)
        for name in ("u", "delta", "z"):  # (batch, dim, seqlen) views of (batch, seqlen, dim)
            x[name] = x[name].to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
        x["B"] = x["B"].to(dtype)
        results = {}
        for backend in ("torch", "triton"):
            monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", backend)
            leaves = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
            out, last = selective_scan_fn(**leaves, delta_softplus=True, return_last_state=True)
            gen = torch.Generator().manual_seed(1)
            w = torch.randn(out.shape, generator=gen).to(DEVICE)
            loss = (out.float() * w).sum() + last.abs().sum()
            results[backend] = (out, last, *torch.autograd.grad(loss, list(leaves.values())))
        names = ["out", "last", *x]
        for name, got, want in zip(names, results["triton"], results["torch"], strict=True):
            assert got.dtype == want.dtype, name
            err = (got - want).abs().max() / want.abs().max()
            assert err < tol, f"{dtype} {name}: relative error {err:.2e}"


def test_float32_matches_oracle(backend):
    x = complex_inputs(seqlen=150, dtype=torch.float32, form_b="grouped", form_c="variable")
    out, last = selective_scan_fn(**x, delta_softplus=True, return_last_state=True)
    assert out.dtype == torch.float32 and last.dtype == torch.complex64
    want_out, want_last = loop_oracle(x)
    assert (out.double() - want_out).norm() / want_out.norm() < 1e-5
    assert (last.to(C128) - want_last).norm() / want_last.norm() < 1e-5


def test_opcheck(backend):
    x = complex_inputs(seqlen=70)
    args = (*x.values(), None, True)
    opcheck(ops.scan_fwd, args)
    out, last, ckpt = ops.scan_fwd(*args)
    assert ckpt.dtype == C128 and ckpt.shape == (2, 4, 3, 3)
    bwd = (torch.randn_like(out), torch.randn_like(last), *x.values(), None, ckpt, True)
    opcheck(ops.scan_bwd, bwd)


def test_compile_and_export(tmp_path, backend):
    x = complex_inputs(seqlen=20)

    def scan(u, delta, A, B, C):
        return selective_scan_fn(u, delta, A, B, C, delta_softplus=True)

    args = [x[k] for k in ("u", "delta", "A", "B", "C")]
    want = scan(*args)
    compiled = torch.compile(scan, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*args), want, rtol=0, atol=0)

    class Scan(torch.nn.Module):
        def forward(self, u, delta, A, B, C):
            return scan(u, delta, A, B, C)

    path = tmp_path / "complex.pt2"
    torch.export.save(torch.export.export(Scan(), tuple(args)), path)
    torch.testing.assert_close(torch.export.load(path).module()(*args), want, rtol=0, atol=0)


def test_triton_backend_runs_complex_a_on_the_complex_kernels(monkeypatch):
    """With the Triton backend, complex A goes to the PyTorch ops, whose implementation runs the
    complex kernels; the real-valued Triton op refuses complex A rather than computing garbage."""
    if not TRITON_RUNS:
        pytest.skip("needs triton on a GPU or under the interpreter")
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    x = complex_inputs()
    with recording(launch=True) as launches:
        out = selective_scan_fn(**x, delta_softplus=True)
    assert [kernel.__name__ for kernel, *_ in launches] == ["_complex_scan_fwd_kernel"]
    torch.testing.assert_close(out, loop_oracle(x)[0], rtol=1e-12, atol=1e-12)
    fwd, _ = ops.triton_ops()
    with pytest.raises(NotImplementedError, match="complex A runs on the PyTorch ops"):
        fwd(*x.values(), None, True)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(B=lambda t: t[..., :9]), ValueError, r"B must have shape \(batch, dstate, 2 \* seq"),
        (dict(C=lambda t: t.real), TypeError, r"C must have dtype in \(complex64, complex128\)"),
        (dict(initial_state=lambda t: t.real), TypeError, r"initial_state must have dtype in \(co"),
        (dict(cu_seqlens=lambda _: torch.tensor([0, 4, 9], device=DEVICE)), ValueError,
         r"complex A with cu_seq"),
    ],
    ids=["B-steps", "C-real", "state-real", "cu_seqlens"],
)  # fmt: skip
def test_checks(change, error, match):
    x = complex_inputs(batch=1)
    for name, make in change.items():
        x[name] = make(x.get(name))
    with pytest.raises(error, match=match):
        selective_scan_fn(**x)


@pytest.mark.parametrize("checkpoint_lvl", [0, 1])
def test_mamba_inner_fn(checkpoint_lvl, backend):
    """mamba_inner_fn with complex A: x_proj gives each variable B/C state's real and imaginary
    parts side by side, which reach the scan interleaved in time (mamba_ssm's layout); forward
    and gradients equal the path written out with the reference."""
    gen = torch.Generator().manual_seed(0)
    batch, d_inner, d_model, seqlen, N, rank, width = 2, 6, 5, 11, 3, 2, 4

    def rand(*shape, scale=0.5):
        return (scale * torch.randn(*shape, generator=gen, dtype=F64)).to(DEVICE).requires_grad_()

    xz = rand(batch, 2 * d_inner, seqlen, scale=1.0)
    conv_w, conv_b = rand(d_inner, 1, width), rand(d_inner)
    x_proj = rand(rank + 4 * N, d_inner)  # B and C: 2 N columns each
    dt_proj, out_proj = rand(d_inner, rank), rand(d_model, d_inner)
    A = torch.complex(-torch.rand(d_inner, N, generator=gen, dtype=F64) - 0.1,
                      torch.randn(d_inner, N, generator=gen, dtype=F64)).to(DEVICE)  # fmt: skip
    A.requires_grad_(True)
    D, dt_bias = rand(d_inner), rand(d_inner)
    leaves = [xz, conv_w, conv_b, x_proj, dt_proj, out_proj, A, D, dt_bias]

    out = mamba_inner_fn(xz, conv_w, conv_b, x_proj, dt_proj, out_proj, None, A, D=D,
                         delta_bias=dt_bias, checkpoint_lvl=checkpoint_lvl)  # fmt: skip

    x, z = xz.chunk(2, dim=1)
    x = F.silu(F.conv1d(x, conv_w, conv_b, padding=width - 1, groups=d_inner)[..., :seqlen])
    x_dbl = F.linear(x.transpose(1, 2), x_proj)  # (batch, seqlen, rank + 4 N)

    def interleaved(cols):  # (batch, seqlen, 2 N) -> (batch, N, 2 seqlen), parts along time
        return cols.reshape(batch, seqlen, N, 2).permute(0, 2, 1, 3).reshape(batch, N, 2 * seqlen)

    delta = F.linear(x_dbl[..., :rank], dt_proj).transpose(1, 2)
    B, C = interleaved(x_dbl[..., rank : rank + 2 * N]), interleaved(x_dbl[..., rank + 2 * N :])
    y = selective_scan_ref(x, delta, A, B, C, D, z, dt_bias, delta_softplus=True)
    want = F.linear(y.transpose(1, 2), out_proj)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    w = torch.randn(out.shape, generator=gen, dtype=F64).to(DEVICE)
    got = torch.autograd.grad((out * w).sum(), leaves)
    expected = torch.autograd.grad((want * w).sum(), leaves)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)
