"""The registered operators themselves: torch.library.opcheck, fake vs real outputs, aliasing."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import SCAN_INPUTS, RecordOps, make_inputs
from torch._subclasses.fake_tensor import FakeTensorMode

from selective_scan import ops, selective_scan_fn
from selective_scan.interface import scan_ops

FWD = torch.ops.selective_scan.scan_fwd.default
BWD = torch.ops.selective_scan.scan_bwd.default

# (make_inputs arguments, delta_softplus): each B/C form, optional inputs present and absent,
# initial_state, cu_seqlens (int32 and int64, with an empty sequence), several chunks, one step.
SAMPLES = [
    pytest.param(dict(b_form="constant", c_form="constant", seqlen=33), True, id="constant-all"),
    pytest.param(dict(D=False, z=False, delta_bias=False, seqlen=33), False, id="variable-none"),
    pytest.param(
        dict(b_form="grouped", c_form="grouped", initial_state=True, seqlen=129),
        True,
        id="grouped-init-3chunks",
    ),
    pytest.param(
        dict(b_form="grouped", c_form="constant", D=False, delta_bias=False),
        False,
        id="mixed-forms-z",
    ),
    pytest.param(dict(seqlen=1, initial_state=True), True, id="one-step"),
    pytest.param(
        dict(batch=1, seqlen=70, b_form="grouped", initial_state=True, cu_seqlens=[0, 5, 5, 70]),
        True,
        id="varlen",
    ),
    pytest.param(
        dict(batch=1, seqlen=40, z=False, cu_seqlens=[0, 17, 40], index_dtype=torch.int64),
        False,
        id="varlen-int64",
    ),
    pytest.param(dict(dtype=torch.bfloat16, initial_state=True, seqlen=65), True, id="bfloat16"),
]


def inputs_for(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    index_dtype = kwargs.pop("index_dtype", torch.int32)
    inputs = make_inputs(**kwargs)
    if inputs["cu_seqlens"] is not None:
        inputs["cu_seqlens"] = inputs["cu_seqlens"].to(index_dtype)
    return inputs


def fwd_args(inputs: dict, softplus: bool, requires_grad: bool = False) -> tuple:
    """The forward's arguments in schema order."""
    tensors = [inputs[k] for k in SCAN_INPUTS]
    if requires_grad:
        tensors = [
            t.detach().requires_grad_(True) if t is not None and t.is_floating_point() else t
            for t in tensors
        ]
    return (*tensors, softplus)


def bwd_args(inputs: dict, softplus: bool, with_dlast: bool = True) -> tuple:
    """The backward's arguments in schema order, with the checkpoints of a real forward."""
    out, last, checkpoints = FWD(*fwd_args(inputs, softplus))
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=gen).to(out)
    dlast = torch.randn(last.shape, generator=gen).to(last) if with_dlast else None
    return (dout, dlast, *(inputs[k] for k in SCAN_INPUTS), checkpoints, softplus)


@pytest.mark.parametrize(("kwargs", "softplus"), SAMPLES)
def test_opcheck_fwd(kwargs, softplus):
    torch.library.opcheck(FWD, fwd_args(inputs_for(kwargs), softplus, requires_grad=True))


@pytest.mark.parametrize(("kwargs", "softplus"), SAMPLES[:3])
def test_opcheck_fwd_without_grad(kwargs, softplus):
    torch.library.opcheck(FWD, fwd_args(inputs_for(kwargs), softplus))


@pytest.mark.parametrize("with_dlast", [True, False], ids=["dlast", "no_dlast"])
@pytest.mark.parametrize(("kwargs", "softplus"), SAMPLES)
def test_opcheck_bwd(kwargs, softplus, with_dlast):
    torch.library.opcheck(BWD, bwd_args(inputs_for(kwargs), softplus, with_dlast))


def layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset(), t.dtype, t.device


def assert_same_layout(fake: tuple, real: tuple) -> None:
    assert len(fake) == len(real)
    for i, (f, r) in enumerate(zip(fake, real, strict=True)):
        assert layout(f) == layout(r), f"output {i}: fake {layout(f)} != real {layout(r)}"


def run_fake(op, args: tuple) -> tuple:
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        return op(*fake_args)


@pytest.mark.parametrize("seqlen", [1, 64, 65, 200])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(b_form="grouped", c_form="constant", initial_state=True),
        dict(D=False, z=False, delta_bias=False),
        dict(batch=1, varlen=True, initial_state=True),
        dict(dtype=torch.float16, b_form="constant"),
        dict(dtype=torch.float64),
    ],
    ids=["grouped-constant-init", "no-optional", "varlen", "float16", "float64"],
)
def test_fake_matches_real(kwargs, seqlen):
    """Inductor asserts the fake's sizes and strides on the real outputs: they must agree."""
    kwargs = dict(kwargs)
    if kwargs.pop("varlen", False):
        kwargs["cu_seqlens"] = [0, seqlen // 2, seqlen]  # two sequences, one empty when seqlen=1
    inputs = make_inputs(seqlen=seqlen, **kwargs)
    args = fwd_args(inputs, True)
    assert_same_layout(run_fake(FWD, args), FWD(*args))
    args = bwd_args(inputs, True)
    assert_same_layout(run_fake(BWD, args), BWD(*args))


def storages(tensors) -> list[int]:
    """Storage addresses of the non-empty tensors (empty placeholders own no memory)."""
    return [
        t.untyped_storage().data_ptr()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.numel() > 0
    ]


@pytest.mark.parametrize(("kwargs", "softplus"), SAMPLES)
def test_outputs_do_not_alias(kwargs, softplus):
    inputs = inputs_for(kwargs)
    for op, args in [(FWD, fwd_args(inputs, softplus)), (BWD, bwd_args(inputs, softplus))]:
        outputs = storages(op(*args))
        assert len(set(outputs)) == len(outputs), f"{op}: outputs share memory"
        assert not set(outputs) & set(storages(args)), f"{op}: an output shares an input's memory"


def _swap(position: int, make):
    """bwd_args with argument ``position`` (0 dout, 1 dlast_state, 12 checkpoints) replaced."""

    def bad(args: tuple) -> tuple:
        return (*args[:position], make(args[position]), *args[position + 1 :])

    return bad


BAD_GRADS = [
    (_swap(0, lambda t: t[:, :-1]), r"dout must have shape \(batch, dim, seqlen\)"),
    (_swap(0, lambda t: t.to("meta")), r"dout is on meta but u is on (cpu|cuda:0)"),
    (_swap(1, lambda t: t[:1]), r"dlast_state must have shape \(batch, dim, dstate\)"),
    # A batch-1 checkpoint tensor would be broadcast over the batch.
    (_swap(12, lambda t: t[:1]), r"checkpoints must have shape .* as the forward returned"),
    (_swap(12, lambda t: t[:, :, :1]), r"checkpoints must have shape"),
    (_swap(12, lambda t: t.double()), r"checkpoints must have dtype in \(float32\)"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize(("change", "match"), BAD_GRADS)
def test_backward_checks_its_own_inputs(change, match, fake):
    """dout, dlast_state and checkpoints are checked like the forward's inputs, by the real
    implementation and the fake alike (autograd passes them right; a direct call may not)."""
    args = change(bwd_args(inputs_for(dict(seqlen=70)), True))
    with pytest.raises((ValueError, TypeError), match=match):
        run_fake(BWD, args) if fake else BWD(*args)


# ---- selective_scan_fn's direct calls ------------------------------------------------------


def _record_direct_calls(monkeypatch) -> list:
    """Record the forward implementations that selective_scan_fn calls directly (not through
    their op)."""
    calls = []
    for op, implementation in list(ops.FORWARD_IMPLEMENTATIONS.items()):

        def recorded(*args, implementation=implementation):
            calls.append(implementation)
            return implementation(*args)

        monkeypatch.setitem(ops.FORWARD_IMPLEMENTATIONS, op, recorded)
    return calls


def test_eager_calls_without_grad_skip_the_op(backend, monkeypatch):
    """With nothing to differentiate, a plain eager call runs the forward's implementation
    without the dispatcher, and gives the op's result bit for bit; under a dispatch mode
    (tracing, FakeTensorMode, profiling modes) it takes the op."""

    x = make_inputs(seqlen=33, initial_state=True)
    calls = _record_direct_calls(monkeypatch)
    with torch.no_grad():
        direct = selective_scan_fn(**x, delta_softplus=True, return_last_state=True)
    assert len(calls) == 1
    with torch.no_grad(), RecordOps() as mode:
        selective_scan_fn(**x, delta_softplus=True)
    assert len(calls) == 1
    fwd = scan_ops(x["u"])[0]
    assert fwd._opoverload in mode.ops
    via_op = fwd(*[x.get(k) for k in SCAN_INPUTS], True)
    for a, b in zip(direct, via_op, strict=False):
        assert torch.equal(a, b)


def _grad_call(x: dict, names=("u", "delta", "A", "B", "D", "z", "delta_bias", "initial_state")):
    """selective_scan_fn's out, last_state and gradients (from fixed cotangents) with the
    inputs `names` as leaves, and the autograd node of its outputs."""
    leaves = {k: x[k].clone().requires_grad_() for k in names}
    out, last = selective_scan_fn(**(x | leaves), delta_softplus=True, return_last_state=True)
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(t.shape, generator=gen).to(t) for t in (out, last)]
    torch.autograd.backward((out, last), cotangents)
    return [out.detach(), last.detach(), *[t.grad for t in leaves.values()]], out.grad_fn


def test_eager_calls_with_grad_skip_the_dispatcher(backend):
    """A plain eager call that records autograd runs the forward's implementation in an
    autograd.Function of its own (ops.EAGER_FUNCTIONS), not through the op: same outputs and
    gradients bit for bit as the op's registered autograd, which a dispatch mode still takes."""
    x = make_inputs(seqlen=33, initial_state=True)
    fwd = scan_ops(x["u"])[0]
    eager, node = _grad_call(x)
    assert type(node).__name__ == "EagerSelectiveScanBackward"
    with RecordOps() as mode:
        via_op, op_node = _grad_call(x)
    assert fwd._opoverload in mode.ops
    assert type(op_node).__name__ != "EagerSelectiveScanBackward"
    for a, b in zip(eager, via_op, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optional", [True, False], ids=["optional_inputs", "none"])
def test_eager_backward_skips_the_op(backend, monkeypatch, optional):
    """An eager backward runs the backward op's implementation without the dispatcher (the
    Triton one without the checks autograd has made, and None for absent inputs) and gives the
    op's gradients bit for bit; under a dispatch mode (tracing, profiling modes) it takes the
    op. With and without the optional inputs (D, z, delta_bias, initial_state)."""
    x = make_inputs(seqlen=33, initial_state=optional, D=optional, z=optional,
                    delta_bias=optional)  # fmt: skip
    _, bwd_op = scan_ops(x["u"])
    implementation = ops.BACKWARD_IMPLEMENTATIONS[bwd_op]
    calls = []

    def recorded(*args):
        calls.append(args)
        return implementation(*args)

    monkeypatch.setitem(ops.BACKWARD_IMPLEMENTATIONS, bwd_op, recorded)

    names = ("u", "delta", "A", "B", "initial_state")[: 5 if optional else 4]
    direct, _ = _grad_call(x, names)
    assert len(calls) == 1
    with RecordOps() as mode:
        via_op, _ = _grad_call(x, names)
    assert len(calls) == 1 and bwd_op._opoverload in mode.ops
    for a, b in zip(direct, via_op, strict=True):
        assert torch.equal(a, b)


def test_package_works_without_triton():
    """The CPU wheel of torch ships no triton, and the main job installs none: importing the
    package, the public functions and their ops must not need it (a fresh process in which
    `import triton` fails)."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, selective_scan\n"
        "from selective_scan import ops, selective_scan_fn\n"
        "assert not ops.HAS_TRITON\n"
        "u = torch.randn(1, 4, 8)\n"
        "out = selective_scan_fn(u, torch.rand(1, 4, 8), -torch.rand(4, 2), torch.randn(1, 2, 8),"
        " torch.randn(1, 2, 8))\n"
        "print(tuple(out.shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300)  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "(1, 4, 8)", result.stderr[-2000:]
