"""The decode step ``selective_state_update``: float64 oracle for every option, form and dtype,
in-place state update, agreement with ``selective_scan_fn`` step by step, the operators
(opcheck), torch.compile, torch.export, the eager fast path and input validation.

The option grid runs on every backend (the Triton kernel under the interpreter carries the
"interpreter" mark there); ``test_triton_kernel_*`` is the curated interpreter suite that always
runs: odd channel counts and dstate 5, heads and groups, strided inputs, low precision.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import TRITON_RUNS
from helpers import TOLERANCE, RecordOps, assert_close, rel_err
from torch._dynamo.utils import counters

from selective_scan import selective_scan_fn
from selective_scan._state_update_checks import _LIFT
from selective_scan.state_update import _backend, selective_state_update

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_OP = torch.ops.selective_scan.state_update.default
# The operator the default backend calls on DEVICE's tensors (the Triton one on a GPU).
DEVICE_OP = _backend(torch.empty(0, device=DEVICE))[0]._opoverload
NAMES = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def step_inputs(
    batch: int = 3,
    dim: int = 37,
    dstate: int = 5,
    nheads: int | None = None,
    ngroups: int = 1,
    dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype | None = None,
    D: bool = True,
    z: bool = True,
    dt_bias: bool = True,
    seed: int = 0,
) -> dict:
    """Random step inputs, plain form (nheads None) or heads form: x, z, B, C, state ~ N(0, 1);
    dt ~ 0.5 U(0, 1); A = -(0.5 U(0, 1) + 0.1); D ~ N(0, 1); dt_bias ~ 0.5 U(0, 1). A, D and
    dt_bias are float32 (float64 when dtype is), as in mamba; state has state_dtype."""
    gen = torch.Generator().manual_seed(seed)
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    heads = () if nheads is None else (nheads,)
    groups = () if nheads is None else (ngroups,)

    def rand(*shape, dt=dtype, uniform=False):
        t = torch.rand(shape, generator=gen) if uniform else torch.randn(shape, generator=gen)
        return t.to(dt).to(DEVICE)

    return {
        "state": rand(batch, *heads, dim, dstate, dt=state_dtype or dtype),
        "x": rand(batch, *heads, dim),
        "dt": 0.5 * rand(batch, *heads, dim, uniform=True),
        "A": -(0.5 * rand(*heads, dim, dstate, dt=wdt, uniform=True) + 0.1),
        "B": rand(batch, *groups, dstate),
        "C": rand(batch, *groups, dstate),
        "D": rand(*heads, dim, dt=wdt) if D else None,
        "z": rand(batch, *heads, dim) if z else None,
        "dt_bias": 0.5 * rand(*heads, dim, dt=wdt, uniform=True) if dt_bias else None,
    }


def oracle(inputs: dict, softplus: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(new state, out) in float64, written out for both forms."""
    s = {k: None if v is None else v.double() for k, v in inputs.items()}
    state, x, dt, A, B, C = (s[k] for k in ("state", "x", "dt", "A", "B", "C"))
    if state.dim() == 4:  # heads form: head h reads group h // (nheads // ngroups)
        B = B.repeat_interleave(state.shape[1] // B.shape[1], dim=1)
        C = C.repeat_interleave(state.shape[1] // C.shape[1], dim=1)
    if s["dt_bias"] is not None:
        dt = dt + s["dt_bias"]
    if softplus:
        dt = F.softplus(dt)
    new = state * torch.exp(dt[..., None] * A) + B.unsqueeze(-2) * (dt * x)[..., None]
    out = (new * C.unsqueeze(-2)).sum(-1)
    if s["D"] is not None:
        out = out + s["D"] * x
    if s["z"] is not None:
        out = out * F.silu(s["z"])
    return new, out


def bound(inputs: dict) -> float:
    return max(TOLERANCE[t.dtype] for t in inputs.values() if t is not None)


def run_and_check(inputs: dict, softplus: bool) -> None:
    """One step: state updated in place to the oracle's, out fresh and matching, nothing else
    written."""
    expected_state, expected_out = oracle(inputs, softplus)
    before = {k: None if v is None else v.clone() for k, v in inputs.items()}
    state = inputs["state"]
    ptr, version = state.data_ptr(), state._version
    out = selective_state_update(**inputs, dt_softplus=softplus)
    tol = bound(inputs)
    assert state.data_ptr() == ptr and state._version > version
    assert_close("state", state, expected_state, tol)
    assert out.shape == inputs["x"].shape and out.dtype == inputs["x"].dtype
    assert out.is_contiguous() and out.data_ptr() != inputs["x"].data_ptr()
    assert_close("out", out, expected_out, tol)
    for name, t in inputs.items():
        if name != "state" and t is not None:
            assert torch.equal(t, before[name]), f"{name} was modified"


OPTIONS = list(itertools.product([False, True], repeat=4))  # D, z, dt_bias, softplus
DTYPES = {
    "fp32": dict(dtype=torch.float32),
    "fp64": dict(dtype=torch.float64),
    "bf16": dict(dtype=torch.bfloat16),
    "fp16": dict(dtype=torch.float16),
    "bf16-fp32state": dict(dtype=torch.bfloat16, state_dtype=torch.float32),
}
FORMS = {
    "plain": dict(dim=37),
    "heads-groups": dict(nheads=4, ngroups=2, dim=9),
}


@pytest.mark.usefixtures("poison_uninitialized")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("D", "z", "dt_bias", "softplus"), OPTIONS)
def test_matches_oracle(backend, form, dtype, D, z, dt_bias, softplus):
    inputs = step_inputs(**FORMS[form], **DTYPES[dtype], D=D, z=z, dt_bias=dt_bias)
    run_and_check(inputs, softplus)


@pytest.mark.parametrize("initial", ["zero", "random"])
def test_steps_equal_selective_scan(backend, initial):
    """Steps over a sequence (strided slices of it, as a model takes them) give the scan's out
    and last_state, from the scan's initial_state."""
    batch, dim, dstate, seqlen = 2, 11, 5, 6
    gen = torch.Generator().manual_seed(3)

    def rand(*shape, uniform=False):
        t = torch.rand(shape, generator=gen) if uniform else torch.randn(shape, generator=gen)
        return t.to(DEVICE)

    u, z = rand(batch, dim, seqlen), rand(batch, dim, seqlen)
    delta = 0.5 * rand(batch, dim, seqlen, uniform=True)
    B, C = rand(batch, dstate, seqlen), rand(batch, dstate, seqlen)
    A = -(0.5 * rand(dim, dstate, uniform=True) + 0.1)
    D, delta_bias = rand(dim), 0.5 * rand(dim, uniform=True)
    h0 = rand(batch, dim, dstate) * (initial == "random")
    out, last = selective_scan_fn(
        u, delta, A, B, C, D, z, delta_bias, delta_softplus=True, return_last_state=True,
        initial_state=h0,
    )  # fmt: skip
    state = h0.clone()
    steps = []
    for t in range(seqlen):
        args = (u[..., t], delta[..., t], A, B[..., t], C[..., t], D, z[..., t], delta_bias)
        steps.append(selective_state_update(state, *args, dt_softplus=True))
    assert_close("out", torch.stack(steps, dim=-1), out, 1e-5)
    assert_close("state", state, last, 1e-5)


# Slots of the state the rows of a batch of 4 step, as state_batch_indices: a padding row (-1)
# and one past the 6 slots touch none; slots 1, 2, 3 and 5 are named by no row.
SLOT_ROWS = [4, -1, 0, 6]
SLOTS = 6


def with_slots(inputs: dict, rows: list, dtype=torch.int32) -> tuple[dict, torch.Tensor]:
    """(inputs with a state of SLOTS random slots in place of the batch's, the rows' indices)."""
    gen = torch.Generator().manual_seed(5)
    state = inputs["state"]
    slots = torch.randn((SLOTS, *state.shape[1:]), generator=gen).to(state.dtype).to(DEVICE)
    return inputs | {"state": slots}, torch.tensor(rows, dtype=dtype, device=DEVICE)


def check_slots(inputs: dict, softplus: bool, index_dtype=torch.int32) -> None:
    """A step with state_batch_indices against the float64 oracle of the rows' own states."""
    inputs, indices = with_slots(inputs, SLOT_ROWS, index_dtype)
    slots = inputs["state"]
    kept = [0 <= i < SLOTS for i in SLOT_ROWS]
    rows = inputs | {"state": slots[[i if k else 0 for i, k in zip(SLOT_ROWS, kept, strict=True)]]}
    new, expected_out = oracle(rows, softplus)
    expected = slots.double().clone()
    for row, (i, k) in enumerate(zip(SLOT_ROWS, kept, strict=True)):
        if k:
            expected[i] = new[row]
        else:
            expected_out[row] = 0.0
    out = selective_state_update(**inputs, dt_softplus=softplus, state_batch_indices=indices)
    assert out.shape == inputs["x"].shape
    assert_close("state", slots, expected, bound(inputs))
    assert_close("out", out, expected_out, bound(inputs))
    assert all(torch.equal(out[row], torch.zeros_like(out[row])) for row in (1, 3))


@pytest.mark.usefixtures("poison_uninitialized")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_state_batch_indices(backend, form, index_dtype):
    """Rows step the slots their state_batch_indices name (mamba_ssm's argument); the other
    slots keep their values; padding rows (negative) and rows past the slots get out 0."""
    check_slots(step_inputs(batch=len(SLOT_ROWS), **FORMS[form]), True, index_dtype)


@pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (a GPU or the interpreter)")
def test_triton_kernel_takes_state_batch_indices(monkeypatch):
    """The same on the Triton kernel, in CI too (the backend-parametrized test above runs the
    Triton backend only on a GPU)."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    for form in FORMS:
        check_slots(step_inputs(batch=len(SLOT_ROWS), **FORMS[form]), False)


# ---- the operators ------------------------------------------------------------------------

OPCHECK_SAMPLES = {
    "plain-all": (dict(), True),
    "plain-none": (dict(D=False, z=False, dt_bias=False), False),
    "heads-groups-bf16": (dict(nheads=4, ngroups=2, dim=9, dtype=torch.bfloat16), True),
    "heads-2d-bc": (dict(nheads=2, dim=8, state_dtype=torch.float16), True),
    "slots": (dict(nheads=4, ngroups=2, dim=9, batch=4), True),
}


def op_args(name: str) -> tuple:
    kwargs, softplus = OPCHECK_SAMPLES[name]
    kwargs = dict(kwargs)
    flat_bc = kwargs.get("nheads") == 2  # heads form with (batch, dstate) B and C
    inputs = step_inputs(**kwargs)
    if flat_bc:
        inputs["B"], inputs["C"] = inputs["B"][:, 0], inputs["C"][:, 0]
    if name == "slots":
        inputs, indices = with_slots(inputs, SLOT_ROWS)
        return (*(inputs[k] for k in NAMES), softplus, indices)
    return (*(inputs[k] for k in NAMES), softplus)


def _ops() -> list:
    ops = [pytest.param(TORCH_OP, id="torch")]
    if torch.cuda.is_available() and hasattr(torch.ops.selective_scan, "state_update_triton"):
        # opcheck fails under the Triton interpreter (shared notes): real kernels only.
        ops.append(pytest.param(torch.ops.selective_scan.state_update_triton.default, id="triton"))
    return ops


@pytest.mark.parametrize("op", _ops())
@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck(op, sample):
    torch.library.opcheck(op, op_args(sample))


def test_schema_declares_state_mutation():
    schema = TORCH_OP._schema
    mutable = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert mutable == ["state"]


def test_eager_fast_path_matches_op():
    """Plain eager calls skip the dispatcher; the result and the version bump are the op's."""
    inputs = step_inputs(nheads=4, ngroups=2, dim=9)
    args = [inputs[k] for k in NAMES]
    state_op = args[0].clone()
    out_op = DEVICE_OP(state_op, *args[1:], True)
    version = args[0]._version
    with torch.no_grad():
        out = selective_state_update(*args, dt_softplus=True)
    assert args[0]._version > version
    assert torch.equal(out, out_op) and torch.equal(args[0], state_op)
    with torch.inference_mode():  # inference tensors have no version counter to bump
        state = args[0].clone()
        out = selective_state_update(state, *args[1:], dt_softplus=True)
    assert torch.equal(out, DEVICE_OP(state_op, *args[1:], True))
    assert torch.equal(state, state_op)


def test_dispatch_modes_see_the_op():
    """Under a dispatch mode (FakeTensorMode, tracing, profiling ones...) the op is called."""

    with torch.no_grad(), RecordOps() as mode:
        selective_state_update(**step_inputs())
    assert DEVICE_OP in mode.ops


def test_inputs_requiring_grad_take_the_op():
    """With autograd recording, the op runs (no formula: backward raises a clear error)."""
    inputs = step_inputs()
    inputs["x"].requires_grad_(True)
    out = selective_state_update(**inputs, dt_softplus=True)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


# ---- torch.compile and torch.export ------------------------------------------------------


@pytest.fixture
def hermetic_compile(monkeypatch):
    """The default backend (the PyTorch op on CPU tensors, the Triton op on CUDA tensors: the
    interpreter cannot be compiled), and no on-disk compile caches."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "auto")
    with torch._inductor.config.patch(force_disable_caches=True):
        yield


def decode_step(state, x, dt, A, B, C, D, z, dt_bias):
    return selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True) * 2


@pytest.mark.usefixtures("hermetic_compile")
def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(decode_step, backend=backend, fullgraph=True, dynamic=True)
    for seed, batch in enumerate((3, 5)):
        inputs = step_inputs(batch=batch, dim=37, dstate=5, seed=seed)
        eager_state = inputs["state"].clone()
        expected = decode_step(eager_state, *(inputs[k] for k in NAMES[1:]))
        actual = compiled(*(inputs[k] for k in NAMES))
        assert_close("out", actual, expected, 1e-6)
        assert_close("state after the call", inputs["state"], eager_state, 1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count == 1


class Decoder(torch.nn.Module):
    """A decode layer as a model holds it: parameters, and the state as a buffer it updates."""

    def __init__(self, batch: int = 3, dim: int = 37, dstate: int = 5):
        super().__init__()
        w = step_inputs(batch=batch, dim=dim, dstate=dstate, seed=100)
        self.A_log = torch.nn.Parameter(torch.log(-w["A"]))
        self.D = torch.nn.Parameter(w["D"])
        self.dt_bias = torch.nn.Parameter(w["dt_bias"])
        self.register_buffer("state", w["state"].float())

    def forward(self, x, dt, B, C, z):
        A = -torch.exp(self.A_log)
        return selective_state_update(
            self.state, x, dt, A, B, C, self.D, z, self.dt_bias, dt_softplus=True
        )


def step_args(batch: int, seed: int) -> tuple:
    inputs = step_inputs(batch=batch, seed=seed)
    return tuple(inputs[k] for k in ("x", "dt", "B", "C", "z"))


def mutation_targets(program) -> list[str]:
    """What the functional (decomposed) form of an exported program writes back."""
    signature = program.run_decompositions().graph_signature
    return [*signature.buffers_to_mutate.values(), *signature.user_inputs_to_mutate.values()]


@pytest.mark.usefixtures("hermetic_compile")
def test_export_mutates_buffer(tmp_path):
    """The exported program keeps the op (training IR) and, decomposed, writes the new state
    back into the buffer; both, and a saved and loaded one, update the buffer step by step."""
    eager = Decoder()  # the state buffer fixes the batch size
    exported = torch.export.export(Decoder(), step_args(3, seed=1))
    assert sum(node.target == DEVICE_OP for node in exported.graph.nodes) == 1
    assert mutation_targets(exported) == ["state"]
    path = tmp_path / "decoder.pt2"
    torch.export.save(exported.run_decompositions(), path)
    for program in (exported, exported.run_decompositions(), torch.export.load(path)):
        module = program.module()
        module.state.copy_(eager.state)
        for seed in range(2):  # the second step starts from the mutated buffer
            args = step_args(3, seed=seed)
            with torch.no_grad():
                expected = eager(*args)
                out = module(*args)
            assert_close("out", out, expected, 1e-6)
            assert_close("state buffer", module.state, eager.state, 1e-6)
        eager = Decoder()


class Step(torch.nn.Module):
    """The state as a user input that the program mutates."""

    def forward(self, state, x, dt, A, B, C):
        return selective_state_update(state, x, dt, A, B, C)


@pytest.mark.usefixtures("hermetic_compile")
def test_export_mutates_user_input():
    """The state as a mutated user input, with a dynamic batch size."""
    batch = torch.export.Dim("batch", min=2)
    dims = ({0: batch}, {0: batch}, {0: batch}, None, {0: batch}, {0: batch})
    inputs = step_inputs(batch=3, D=False, z=False, dt_bias=False)
    exported = torch.export.export(Step(), tuple(inputs[k] for k in NAMES[:6]), dynamic_shapes=dims)
    assert mutation_targets(exported) == ["state"]
    for batch_size in (3, 6):
        inputs = step_inputs(batch=batch_size, D=False, z=False, dt_bias=False, seed=batch_size)
        expected_state, expected_out = oracle(inputs, softplus=False)
        out = exported.module()(*(inputs[k] for k in NAMES[:6]))
        assert_close("out", out, expected_out, 1e-5)
        assert_close("state", inputs["state"], expected_state, 1e-5)


# ---- the Triton kernel under the interpreter (or on the GPU) -------------------------------

TRITON_CASES = {
    # dim 37: two blocks of 32 channels, the second one ragged; dstate 5 pads to 8.
    "plain-odd": (dict(dim=37, dstate=5), True),
    "plain-dstate16-none": (dict(dim=70, dstate=16, D=False, z=False, dt_bias=False), False),
    "heads-groups-bf16": (dict(nheads=4, ngroups=2, dim=9, dtype=torch.bfloat16), True),
    "fp16-state-fp32": (dict(dtype=torch.float32, state_dtype=torch.float16, dim=33), True),
    "float64": (dict(dtype=torch.float64, dim=5, dstate=3), True),
}


@pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (a GPU or the interpreter)")
@pytest.mark.usefixtures("poison_uninitialized")
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_kernel_matches_oracle(case, monkeypatch):
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    kwargs, softplus = TRITON_CASES[case]
    run_and_check(step_inputs(**kwargs), softplus)


@pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (a GPU or the interpreter)")
def test_triton_kernel_takes_any_strides(monkeypatch):
    """Transposed state, and x/dt/z/B/C as slices of (batch, dim, seqlen) sequences."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    inputs = step_inputs(dim=37, dstate=5)
    strided = dict(inputs)
    strided["state"] = inputs["state"].transpose(1, 2).contiguous().transpose(1, 2)
    for k in ("x", "dt", "z", "B", "C"):
        strided[k] = torch.stack([inputs[k], inputs[k]], dim=-1)[..., 1]
    strided["A"] = inputs["A"].t().contiguous().t()
    expected_state, expected_out = oracle(inputs, softplus=True)
    out = selective_state_update(**strided, dt_softplus=True)
    assert rel_err(out, expected_out) < 1e-5
    assert rel_err(strided["state"], expected_state) < 1e-5


def mixed_forms(state_form: str) -> tuple[dict, dict]:
    """(inputs in the heads form with nheads = 1, the same inputs with the state in
    ``state_form`` and every other argument in the other form), as mamba_ssm accepts them."""
    heads = step_inputs(nheads=1)
    mixed = {}
    for name, (_, axis) in zip(NAMES, _LIFT, strict=True):
        keep = (name == "state") == (state_form == "heads")  # the state's form, or the other
        mixed[name] = (heads[name] if keep else heads[name].squeeze(axis)).clone()
    return heads, mixed


@pytest.mark.parametrize("state_form", ["heads", "plain"])
def test_mixed_forms_equal_one_form(backend, state_form):
    """A plain-form argument next to a heads-form state of one head, and the reverse, give the
    one-form call's state and out bitwise; out takes the state's form."""
    heads, mixed = mixed_forms(state_form)
    out = selective_state_update(**heads, dt_softplus=True)
    mixed_out = selective_state_update(**mixed, dt_softplus=True)
    assert mixed_out.shape == mixed["state"].shape[:-1]
    assert torch.equal(mixed_out.reshape(out.shape), out)
    assert torch.equal(mixed["state"].reshape(heads["state"].shape), heads["state"])


@pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (a GPU or the interpreter)")
def test_triton_kernel_takes_mixed_forms(monkeypatch):
    """The same on the Triton kernel, in CI too (the backend-parametrized test above runs the
    Triton backend only on a GPU)."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    test_mixed_forms_equal_one_form("triton", "heads")


# ---- input validation ------------------------------------------------------------------


def _bad(name: str, value) -> dict:
    inputs = step_inputs(nheads=4, ngroups=2, dim=9) if name.startswith("heads:") else step_inputs()
    inputs[name.removeprefix("heads:")] = value(inputs)
    return inputs


BAD = [
    ("x", lambda i: i["x"][:, :-1], ValueError, r"x must have shape \(batch, dim\)"),
    ("dt", lambda i: i["dt"][:-1], ValueError, "dt must have shape"),
    ("z", lambda i: i["z"][:, None, None], ValueError, r"z must have shape \(batch, dim\) for a"),
    ("A", lambda i: i["A"][:, :-1], ValueError, r"A must have shape \(dim, dstate\)"),
    ("B", lambda i: i["B"][:, :-1], ValueError, r"B must have shape \(batch, dstate\)"),
    ("C", lambda i: i["C"].int(), TypeError, "C must have dtype"),
    ("D", lambda i: i["D"][None, None], ValueError, r"D must have shape \(dim,\)"),
    ("dt_bias", lambda i: i["dt_bias"].to("meta"), ValueError, "dt_bias is on meta"),
    ("state", lambda i: i["state"][0], ValueError, "state must have 3 or 4 dimensions"),
    ("x", lambda i: None, TypeError, "x must be a torch.Tensor"),
    ("heads:x", lambda i: i["x"][:, 0], ValueError, r"x must have shape \(batch, nheads, dim\)"),
    ("heads:A", lambda i: i["A"][0], ValueError, r"\(nheads, dim, dstate\)"),
    ("heads:B", lambda i: i["B"].repeat(1, 3, 1)[:, :3], ValueError, "3 groups, which must divide"),
    ("heads:C", lambda i: i["C"][:, 0], ValueError, "same number of groups"),
    ("heads:D", lambda i: i["D"][0], ValueError, r"D must have shape \(nheads, dim\)"),
    ("heads:B", lambda i: i["B"][:, 0, :-1], ValueError, r"B must have shape \(batch, dstate\)"),
    ("heads:B", lambda i: i["B"][:, :0], ValueError, "B must have at least one group"),
    # Written in place: rows of a broadcast state would be one memory location.
    ("state", lambda i: i["state"][:1].expand_as(i["state"]), ValueError, "must not share memory"),
    ("dt_softplus", lambda i: "no", TypeError, "dt_softplus must be a bool, got str"),
    (
        "state_batch_indices",
        lambda i: torch.zeros(3, device=DEVICE),
        TypeError,
        r"state_batch_indices must have dtype in \(int32, int64\)",
    ),
    (
        "state_batch_indices",
        lambda i: torch.zeros(3, 1, dtype=torch.int32, device=DEVICE),
        ValueError,
        "state_batch_indices must have 1 dimensions",
    ),
    (  # one index a row of x: the message names the indices, not x
        "state_batch_indices",
        lambda i: torch.zeros(2, dtype=torch.int32, device=DEVICE),
        ValueError,
        r"selective_state_update: state_batch_indices must have one entry per batch row of x",
    ),
    (
        "state_batch_indices",
        lambda i: torch.zeros(3, dtype=torch.int32, device="meta"),
        ValueError,
        "state_batch_indices is on meta but state is on",
    ),
]


@pytest.mark.parametrize(("name", "value", "error", "match"), BAD)
def test_bad_input(backend, name, value, error, match):
    with pytest.raises(error, match=match):
        selective_state_update(**{"dt_softplus": True} | _bad(name, value))


def test_leaf_state_requiring_grad_is_not_written(backend):
    """As for torch's own in-place ops: a leaf that requires grad may not be written in place
    under grad mode (it may under no_grad)."""
    inputs = step_inputs()
    state = inputs["state"].requires_grad_()
    before = state.detach().clone()
    with pytest.raises(RuntimeError, match="state is a leaf tensor that requires grad"):
        selective_state_update(**inputs)
    assert torch.equal(state.detach(), before)
    with torch.no_grad():
        selective_state_update(**inputs)
    assert not torch.equal(state.detach(), before)


@pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (a GPU or the interpreter)")
def test_triton_eager_plans_by_layout(monkeypatch):
    """Plain eager calls of one layout share a launch plan, a new layout (strides of x here)
    gets its own, and each gives the oracle's result."""
    from selective_scan.kernels import state_update as state_update_kernel  # needs triton

    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    plans = state_update_kernel._PLANS
    run_and_check(step_inputs(seed=0), softplus=True)
    known = dict(plans)
    run_and_check(step_inputs(seed=1), softplus=True)
    assert plans == known  # the same launchers, nothing added
    strided = step_inputs(seed=2)
    strided["x"] = torch.stack([strided["x"], strided["x"]], dim=-1)[..., 1]
    run_and_check(strided, softplus=True)
    assert len(set(plans) - set(known)) == 1


@pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (a GPU or the interpreter)")
@pytest.mark.parametrize(
    ("name", "value", "error", "match"),
    [bad for bad in BAD if bad[0] in ("C", "dt_bias")],  # a dtype, a device; shapes unchanged
)
def test_triton_eager_plan_keeps_the_checks(monkeypatch, name, value, error, match):
    """A call that differs from a planned one only in a dtype or a device still fails."""
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "triton")
    selective_state_update(**step_inputs(), dt_softplus=True)
    with pytest.raises(error, match=match):
        selective_state_update(**_bad(name, value), dt_softplus=True)


BATCHED = ("state", "x", "dt", "B", "C", "z")  # the step inputs with a batch dimension


@pytest.mark.skipif(not TRITON_RUNS, reason="needs triton (a GPU or the interpreter)")
def test_triton_grid_takes_large_batches():
    """Batch rows share the grid's first axis (2^31 - 1 programs) with the blocks of channels,
    so a batch beyond 65535, the limit of the other axes, still launches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from selective_scan.kernels import state_update as state_update_kernel  # needs triton

    x = step_inputs(batch=1, dim=300, nheads=3)
    x = {k: v.expand(70000, *v.shape[1:]) if k in BATCHED else v for k, v in x.items()}
    with FakeTensorMode() as mode:
        big = {k: mode.from_tensor(v) for k, v in x.items()}
        grid = state_update_kernel._plan(*[big[k] for k in NAMES], True)[0]
    blocks = -(-300 // state_update_kernel.block(5)[1])
    assert grid == (blocks * 70000, 3, 1)


def test_forward_mode_ad_is_refused(backend):
    """An input with a tangent raises: the step has no forward-mode derivative, and its kernels
    would drop the tangent."""
    from torch.autograd import forward_ad

    inputs = step_inputs()
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        x = forward_ad.make_dual(inputs["x"], torch.randn_like(inputs["x"]))
        selective_state_update(**(inputs | {"x": x}), dt_softplus=True)
