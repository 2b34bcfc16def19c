"""Bad input gets a clear error naming the argument and what was expected, from the public
function and from the reference alike."""

import numpy as np
import pytest
import torch
from helpers import make_inputs
from torch.autograd import forward_ad

from selective_scan import selective_scan_fn, selective_scan_ref

# batch 2, dim 8, dstate 4, seqlen 10; B grouped in 2 groups, C variable; every optional input.
SHAPE = r"\(2, 8, 10\)"
# The device make_inputs puts them on (a GPU where there is one), as error messages name it.
HOME = torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu").device
FLOAT_DTYPES = r"dtype in \(float16, bfloat16, float32, float64\)"


def batched() -> dict:
    return make_inputs(seqlen=10, b_form="grouped", initial_state=True)


def packed(cu_seqlens, dtype=torch.int32, num_seqs=None) -> dict:
    """Sequences packed along seqlen (batch 1) by cu_seqlens as given, with an initial state per
    sequence (num_seqs of them, len(cu_seqlens) - 1 by default; 0 for none)."""
    num_seqs = len(cu_seqlens) - 1 if num_seqs is None else num_seqs
    inputs = make_inputs(batch=1, seqlen=10)
    return inputs | {
        "cu_seqlens": torch.tensor(cu_seqlens, dtype=dtype, device=HOME),
        "initial_state": torch.randn(num_seqs, 8, 4, device=HOME) if num_seqs else None,
    }


def case(name, make, error, match):
    return pytest.param(make, error, match, id=name)


def replace(**changes):
    """batched() inputs with some arguments replaced: each change maps the old value to the new."""
    return lambda: (x := batched()) | {k: change(x[k]) for k, change in changes.items()}


NOT_A_TENSOR = (TypeError, RuntimeError)  # ours, or the op schema's when it comes first
TIMED = {"u", "delta", "z", "B", "C"}  # the arguments with batch and seqlen dimensions

CASES = [
    # ranks and sizes
    case("u-rank", replace(u=lambda t: t[0]), ValueError, r"u must have 3 dimensions, got 2"),
    case(
        "u-empty-seqlen",
        lambda: {k: v[..., :0] if k in TIMED else v for k, v in batched().items()},
        ValueError,
        r"u must be non-empty",
    ),
    case(
        "u-empty-batch",
        lambda: {k: v[:0] if k in {*TIMED, "initial_state"} else v for k, v in batched().items()},
        ValueError,
        r"u must be non-empty",
    ),
    case(
        "delta-seqlen",
        replace(delta=lambda t: t[..., :9]),
        ValueError,
        rf"delta must have shape \(batch, dim, seqlen\) = {SHAPE}, got \(2, 8, 9\)",
    ),
    case(
        "delta-dim",
        replace(delta=lambda t: t[:, :7]),
        ValueError,
        rf"delta must have shape \(batch, dim, seqlen\) = {SHAPE}, got \(2, 7, 10\)",
    ),
    case(
        "z-batch",
        replace(z=lambda t: t[:1]),
        ValueError,
        rf"z must have shape \(batch, dim, seqlen\) = {SHAPE}, got \(1, 8, 10\)",
    ),
    case("A-rank", replace(A=lambda t: t[None]), ValueError, r"A must have 2 dimensions, got 3"),
    case(
        "A-dim",
        replace(A=lambda t: t[:7]),
        ValueError,
        r"u \(batch, dim, seqlen\) and A \(dim, dstate\) must agree on dim, got u of shape "
        r"\(2, 8, 10\) and A of shape \(7, 4\)$",
    ),
    case(  # the error names u, not delta, when u is (batch, seqlen, dim)
        "u-transposed",
        replace(u=lambda t: t.transpose(1, 2)),
        ValueError,
        r"got u of shape \(2, 10, 8\) and A of shape \(8, 4\); u looks like \(batch, seqlen, "
        r"dim\): pass u.transpose\(1, 2\)",
    ),
    case(
        "A-dstate-0",
        replace(A=lambda t: t[:, :0], B=lambda t: t[:, :, :0], C=lambda t: t[:, :0]),
        ValueError,
        r"A must have dstate >= 1",
    ),
    case(
        "B-rank",
        replace(B=lambda t: t[None]),
        ValueError,
        r"B must have 2 or 3 or 4 dimensions, got 5",
    ),
    case(
        "B-grouped-seqlen",
        replace(B=lambda t: t[..., :9]),
        ValueError,
        r"B must have shape \(batch, groups, dstate, seqlen\) = \(2, \*, 4, 10\), "
        r"got \(2, 2, 4, 9\)",
    ),
    case(
        "B-groups-not-dividing-dim",
        replace(B=lambda t: torch.randn(2, 3, 4, 10, device=HOME)),
        ValueError,
        r"B has 3 groups, which must divide dim=8",
    ),
    case(
        "C-variable-dstate",
        replace(C=lambda t: t[:, :3]),
        ValueError,
        r"C must have shape \(batch, dstate, seqlen\) = \(2, 4, 10\), got \(2, 3, 10\)",
    ),
    case(
        "C-constant-dim",
        replace(C=lambda t: torch.randn(7, 4, device=HOME)),
        ValueError,
        r"C must have shape \(dim, dstate\) = \(8, 4\), got \(7, 4\)",
    ),
    case(
        "C-groups-0",
        replace(C=lambda t: torch.randn(2, 0, 4, 10, device=HOME)),
        ValueError,
        r"C has 0 groups, which must divide dim=8",
    ),
    case(
        "D-size",
        replace(D=lambda t: t[:7]),
        ValueError,
        r"D must have shape \(dim,\) = \(8,\), got \(7,\)",
    ),
    case("D-rank", replace(D=lambda t: t[None]), ValueError, r"D must have 1 dimensions, got 2"),
    case(
        "delta_bias-size",
        replace(delta_bias=lambda t: torch.rand(9, device=HOME)),
        ValueError,
        r"delta_bias must have shape \(dim,\) = \(8,\), got \(9,\)",
    ),
    case(
        "initial_state-shape",
        replace(initial_state=lambda t: t[..., :3]),
        ValueError,
        r"initial_state must have shape \(batch, dim, dstate\) = \(2, 8, 4\), got \(2, 8, 3\)",
    ),
    case(
        "initial_state-rank",
        replace(initial_state=lambda t: t[0]),
        ValueError,
        r"initial_state must have 3 dimensions, got 2",
    ),
    case(
        "initial_state-num_seqs",
        lambda: packed([0, 4, 10], num_seqs=3),
        ValueError,
        r"initial_state must have shape \(num_seqs, dim, dstate\) = \(2, 8, 4\)",
    ),
    # dtypes
    case(
        "u-int64",
        replace(u=lambda t: t.long()),
        TypeError,
        rf"u must have {FLOAT_DTYPES}, got int64",
    ),
    case(
        "u-complex",
        replace(u=lambda t: t.to(torch.complex64)),
        TypeError,
        rf"u must have {FLOAT_DTYPES}, got complex64",
    ),
    case(
        "delta-int32",
        replace(delta=lambda t: t.int()),
        TypeError,
        rf"delta must have {FLOAT_DTYPES}, got int32",
    ),
    case(
        "A-bool",
        replace(A=lambda t: t > 0),
        TypeError,
        r"A must have dtype in \(float16, bfloat16, float32, float64, complex64, complex128\), "
        r"got bool",
    ),
    case(
        "B-int32",
        replace(B=lambda t: t.int()),
        TypeError,
        rf"B must have {FLOAT_DTYPES}, got int32",
    ),
    case(
        "D-int64",
        replace(D=lambda t: t.long()),
        TypeError,
        rf"D must have {FLOAT_DTYPES}, got int64",
    ),
    case(
        "initial_state-int",
        replace(initial_state=lambda t: t.int()),
        TypeError,
        rf"initial_state must have {FLOAT_DTYPES}, got int32",
    ),
    # devices: "meta" stands for any other device
    case(
        "delta-meta",
        replace(delta=lambda t: t.to("meta")),
        ValueError,
        rf"delta is on meta but u is on {HOME}",
    ),
    case(  # with the triton backend forced, u's device is the first thing wrong
        "u-meta",
        replace(u=lambda t: t.to("meta")),
        (ValueError, RuntimeError),
        rf"is on {HOME} but u is on meta|triton runs on CUDA tensors.* got tensors on meta",
    ),
    case(
        "A-meta", replace(A=lambda t: t.to("meta")), ValueError, rf"A is on meta but u is on {HOME}"
    ),
    case(
        "C-meta", replace(C=lambda t: t.to("meta")), ValueError, rf"C is on meta but u is on {HOME}"
    ),
    case(
        "delta_bias-meta",
        replace(delta_bias=lambda t: t.to("meta")),
        ValueError,
        rf"delta_bias is on meta but u is on {HOME}",
    ),
    case(
        "initial_state-meta",
        replace(initial_state=lambda t: t.to("meta")),
        ValueError,
        rf"initial_state is on meta but u is on {HOME}",
    ),
    case(
        "cu_seqlens-meta",
        lambda: packed([0, 4, 10]) | {"cu_seqlens": torch.tensor([0, 4, 10], device="meta")},
        ValueError,
        rf"cu_seqlens is on meta but u is on {HOME}",
    ),
    # not tensors
    case(
        "u-list",
        replace(u=lambda t: t.tolist()),
        NOT_A_TENSOR,
        r"u must be a torch\.Tensor|argument 'u'",
    ),
    case(
        "A-numpy",
        replace(A=lambda t: t.cpu().numpy()),
        NOT_A_TENSOR,
        r"A must be a torch\.Tensor|argument 'A'",
    ),
    case(
        "B-list",
        replace(B=lambda t: t.tolist()),
        NOT_A_TENSOR,
        r"B must be a torch\.Tensor|argument 'B'",
    ),
    case(
        "D-float", replace(D=lambda t: 1.0), NOT_A_TENSOR, r"D must be a torch\.Tensor|argument 'D'"
    ),
    case(
        "initial_state-array",
        replace(initial_state=lambda t: np.zeros((2, 8, 4))),
        NOT_A_TENSOR,
        r"initial_state must be a torch\.Tensor|argument 'initial_state'",
    ),
    # cu_seqlens
    case(
        "cu_seqlens-not-sorted",
        lambda: packed([0, 6, 3, 10]),
        ValueError,
        r"cu_seqlens must be non-decreasing",
    ),
    case(
        "cu_seqlens-start",
        lambda: packed([1, 4, 10]),
        ValueError,
        r"cu_seqlens must start at 0 and end at seqlen=10, got 1 \.\.\. 10",
    ),
    case(
        "cu_seqlens-end-short",
        lambda: packed([0, 4, 9]),
        ValueError,
        r"cu_seqlens must start at 0 and end at seqlen=10, got 0 \.\.\. 9",
    ),
    case(
        "cu_seqlens-end-long",
        lambda: packed([0, 4, 11]),
        ValueError,
        r"cu_seqlens must start at 0 and end at seqlen=10, got 0 \.\.\. 11",
    ),
    case(
        "cu_seqlens-float",
        lambda: packed([0.0, 4.0, 10.0], dtype=torch.float32),
        TypeError,
        r"cu_seqlens must have dtype in \(int32, int64\), got float32",
    ),
    case(
        "cu_seqlens-int16",
        lambda: packed([0, 4, 10], dtype=torch.int16),
        TypeError,
        r"cu_seqlens must have dtype in \(int32, int64\), got int16",
    ),
    case(
        "cu_seqlens-batch-2",
        lambda: (
            batched()
            | {
                "cu_seqlens": torch.tensor([0, 10], dtype=torch.int32, device=HOME),
                "initial_state": None,
            }
        ),
        ValueError,
        r"cu_seqlens .* batch must be 1, got u of shape \(2, 8, 10\)",
    ),
    case(
        "cu_seqlens-one-entry",
        lambda: packed([0], num_seqs=0),
        ValueError,
        r"cu_seqlens must have shape \(num_seqs \+ 1,\) with num_seqs >= 1, got \(1,\)",
    ),
    case(
        "cu_seqlens-rank",
        lambda: packed([[0, 4, 10]], num_seqs=0),
        ValueError,
        r"cu_seqlens must have 1 dimensions, got 2",
    ),
]


@pytest.mark.parametrize("fn", [selective_scan_fn, selective_scan_ref], ids=["fn", "ref"])
@pytest.mark.parametrize(("make", "error", "match"), CASES)
def test_bad_input(backend, fn, make, error, match):
    with pytest.raises(error, match=match):
        fn(**make(), delta_softplus=True, return_last_state=True)


@pytest.mark.parametrize(("make", "error", "match"), CASES)
def test_bad_input_default_backend(monkeypatch, make, error, match):
    """Without SELECTIVE_SCAN_BACKEND, the wrapper picks the backend from u itself."""
    monkeypatch.delenv("SELECTIVE_SCAN_BACKEND", raising=False)
    with pytest.raises(error, match=match):
        selective_scan_fn(**make(), delta_softplus=True, return_last_state=True)


@pytest.mark.parametrize("fn", [selective_scan_fn, selective_scan_ref], ids=["fn", "ref"])
def test_good_input_passes(backend, fn):
    """The bases of the cases above are valid: each case fails for its own reason."""
    for inputs in (batched(), packed([0, 4, 10])):
        out, last = fn(**inputs, delta_softplus=True, return_last_state=True)
        assert torch.isfinite(out).all()
        assert torch.isfinite(last).all()


FLAGS = [("delta_softplus", "no"), ("delta_softplus", None), ("return_last_state", 1)]


@pytest.mark.parametrize("fn", [selective_scan_fn, selective_scan_ref], ids=["fn", "ref"])
@pytest.mark.parametrize(("flag", "value"), FLAGS)
def test_flags_must_be_bools(fn, flag, value):
    """A flag taken by its truth value would turn softplus on for delta_softplus="no"."""
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got {type(value).__name__}"):
        fn(**batched(), **{flag: value})


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch, device):
    """Forcing Triton on tensors it cannot run on says so, instead of failing inside Triton."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batched().items()}
    match = rf"triton runs on CUDA tensors.*got tensors on {device}"
    with pytest.raises(RuntimeError, match=match):
        selective_scan_fn(**inputs)


@pytest.mark.parametrize("transform", ["jvp", "dual"])
def test_forward_mode_ad_is_refused(backend, transform):
    """Forward-mode AD is not supported: an input with a tangent raises instead of the kernels
    dropping it (torch.func.jvp through the op gave a zero derivative); inside a dual level,
    inputs without tangents run as usual."""
    x = make_inputs(seqlen=10)
    tangent = torch.randn_like(x["u"])

    def scan(u):
        return selective_scan_fn(**(x | {"u": u}), delta_softplus=True)

    with pytest.raises(NotImplementedError, match="selective_scan_fn: forward-mode AD"):
        if transform == "jvp":
            torch.func.jvp(scan, (x["u"],), (tangent,))
        else:
            with forward_ad.dual_level():
                scan(forward_ad.make_dual(x["u"], tangent))
    expected = scan(x["u"])
    with forward_ad.dual_level():
        forward_ad.make_dual(x["u"].clone(), tangent)  # a dual tensor that is not an input
        assert torch.equal(scan(x["u"]), expected)
