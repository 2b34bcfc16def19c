"""ONNX export of the scan and of the decode step, run in ONNX Runtime and checked against eager.

Each case exports a module with dynamic sizes, then runs the file in ONNX Runtime at the traced
sizes and at others, and compares with the eager module: float32, every element within 1e-4 of
the largest eager magnitude (max |onnx - eager| <= 1e-4 max |eager|).
"""

import subprocess
import sys

import pytest
import torch
from helpers import SCAN_INPUTS, make_inputs, pairwise

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from onnx_helpers import assert_rel_close, session, torch_backend  # noqa: E402, F401

import selective_scan.onnx as sso  # noqa: E402
from selective_scan import selective_scan_fn, selective_state_update  # noqa: E402
from selective_scan.onnx import scan as onnx_scan  # noqa: E402


def run(sess, tensors: dict) -> list:
    """Run with the session's inputs taken from ``tensors`` by name."""
    feed = {i.name: tensors[i.name].numpy() for i in sess.get_inputs()}
    return sess.run(None, feed)


class Scan(torch.nn.Module):
    """selective_scan_fn on its inputs, returning (out, last_state)."""

    def __init__(self, delta_softplus: bool):
        super().__init__()
        self.delta_softplus = delta_softplus

    def forward(self, u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens):
        return selective_scan_fn(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus=self.delta_softplus,
            return_last_state=True, initial_state=initial_state, cu_seqlens=cu_seqlens,
        )  # fmt: skip


CASES = pairwise(
    {
        "b_form": ["variable", "constant", "grouped"],
        "c_form": ["variable", "constant", "grouped"],
        "D": [True, False],
        "z": [True, False],
        "delta_bias": [True, False],
        "delta_softplus": [True, False],
        "initial_state": [False, True],
        "packed": [False, True],
    }
)


def case_id(case: dict) -> str:
    flags = [k for k, v in case.items() if v is True]
    return f"B-{case['b_form']}-C-{case['c_form']}-" + "-".join(flags)


def scan_dynamic_shapes(inputs: dict, packed: bool) -> dict:
    """Dynamic seqlen, and batch unpacked or the number of sequences packed."""
    length = torch.export.Dim("seqlen", min=2)
    rows = None if packed else torch.export.Dim("batch", min=2)
    seqs = torch.export.Dim("seqs", min=2)
    per_step = {2: length} if packed else {0: rows, 2: length}
    shapes = {}
    for name in SCAN_INPUTS:
        t = inputs[name]
        constant = name in ("A", "D", "delta_bias") or (name in ("B", "C") and t.dim() == 2)
        if t is None or constant:
            shapes[name] = None
        elif name in ("B", "C") and t.dim() == 4:  # grouped: (batch, groups, dstate, seqlen)
            shapes[name] = {3: length} if packed else {0: rows, 3: length}
        elif name == "initial_state":
            shapes[name] = {0: seqs} if packed else {0: rows}
        elif name == "cu_seqlens":
            shapes[name] = {0: seqs + 1}
        else:
            shapes[name] = per_step
    return shapes


def scan_inputs(case: dict, batch: int, seqlen: int, seed: int) -> dict:
    bounds = None
    if case["packed"]:  # empty sequences and one of one step included
        bounds = [0, 5, 5, 6, seqlen] if seed == 0 else [0, seqlen // 3, seqlen, seqlen]
    options = {k: case[k] for k in ("b_form", "c_form", "D", "z", "delta_bias", "initial_state")}
    return make_inputs(
        batch=1 if case["packed"] else batch, dim=8, dstate=4, seqlen=seqlen,
        cu_seqlens=bounds, seed=seed, device="cpu", **options,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_scan_matches_eager(case, tmp_path):
    model = Scan(case["delta_softplus"])
    traced = scan_inputs(case, batch=2, seqlen=33, seed=0)
    path = tmp_path / "scan.onnx"
    names = [k for k in SCAN_INPUTS if traced[k] is not None]
    sso.export(
        model, tuple(traced[k] for k in SCAN_INPUTS), path,
        dynamic_shapes=scan_dynamic_shapes(traced, case["packed"]), input_names=names,
    )  # fmt: skip
    sess = session(path)
    # The traced sizes, then other batch, length and number of sequences; length 1 too.
    for batch, seqlen, seed in ((2, 33, 0), (3, 70, 1), (1, 1, 2)):
        if case["packed"] and seqlen == 1:
            continue
        inputs = scan_inputs(case, batch, seqlen, seed)
        with torch.no_grad():
            expected = model(*(inputs[k] for k in SCAN_INPUTS))
        got = run(sess, inputs)
        for name, a, e in zip(("out", "last_state"), got, expected, strict=True):
            assert_rel_close(f"{name} at {batch}x{seqlen}", a, e)


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_chunk_length_variable_must_be_positive(value, monkeypatch):
    monkeypatch.setenv(onnx_scan.CHUNK_VARIABLE, value)
    with pytest.raises(ValueError, match="must be a positive integer"):
        onnx_scan.chunk_length(8, 4)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunk_lengths_agree(chunk, tmp_path, monkeypatch):
    """A per-step Scan (chunk 1), a chunk that does not divide the length, a chunk longer
    than the sequence."""
    monkeypatch.setenv(onnx_scan.CHUNK_VARIABLE, str(chunk))
    case = dict(CASES[0], initial_state=True, packed=False)
    model = Scan(delta_softplus=True)
    inputs = scan_inputs(case, batch=2, seqlen=33, seed=3)
    path = tmp_path / "scan.onnx"
    names = [k for k in SCAN_INPUTS if inputs[k] is not None]
    args = tuple(inputs[k] for k in SCAN_INPUTS)
    sso.export(model, args, path, input_names=names)
    with torch.no_grad():
        expected = model(*args)
    for name, a, e in zip(("out", "last_state"), run(session(path), inputs), expected, strict=True):
        assert_rel_close(name, a, e)


class RawScan(torch.nn.Module):
    """The forward op itself, all three outputs."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, u, delta, A, B, C):
        return self.op(u, delta, A, B, C, None, None, None, None, None, False)


@pytest.mark.parametrize("seqlen", [33, 200])
def test_outputs_keep_the_ops_shapes(seqlen, tmp_path):
    """Every output, checkpoints included (zeros in ONNX), has the eager op's shape and dtype
    at a length other than the traced one."""
    inputs = make_inputs(batch=2, seqlen=40, device="cpu", D=False, z=False, delta_bias=False)
    args = tuple(inputs[k] for k in ("u", "delta", "A", "B", "C"))
    path = tmp_path / "raw.onnx"
    length = torch.export.Dim("seqlen", min=2)
    per_step = {2: length}
    shapes = (per_step, per_step, None, per_step, per_step)
    sso.export(RawScan(torch.ops.selective_scan.scan_fwd), args, path, dynamic_shapes=shapes)
    inputs = make_inputs(batch=2, seqlen=seqlen, device="cpu", seed=1)
    args = tuple(inputs[k] for k in ("u", "delta", "A", "B", "C"))
    sess = session(path)
    got = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args, strict=True)})
    expected = RawScan(torch.ops.selective_scan.scan_fwd)(*args)
    for a, e in zip(got, expected, strict=True):
        assert tuple(a.shape) == tuple(e.shape)
        assert str(a.dtype) == str(e.dtype).replace("torch.", "")
    assert_rel_close("out", got[0], expected[0])
    assert_rel_close("last_state", got[1], expected[1])


def test_float64_computes_in_float64(tmp_path):
    inputs = make_inputs(batch=2, seqlen=20, dtype=torch.float64, device="cpu")
    model = Scan(delta_softplus=True)
    args = tuple(inputs[k] for k in SCAN_INPUTS)
    path = tmp_path / "scan64.onnx"
    sso.export(model, args, path, input_names=[k for k in SCAN_INPUTS if inputs[k] is not None])
    got = run(session(path), inputs)
    expected = model(*args)
    assert got[0].dtype.name == "float64"
    for name, a, e in zip(("out", "last_state"), got, expected, strict=True):
        assert_rel_close(name, a, e, rtol=1e-10)


def test_a_wrong_translation_is_caught(tmp_path):
    """The comparison is not vacuous: a translation that drops D fails it."""
    inputs = make_inputs(batch=2, seqlen=20, device="cpu")
    model = Scan(delta_softplus=True)
    args = tuple(inputs[k] for k in SCAN_INPUTS)

    def without_d(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens, softplus):
        return sso.scan_fwd(u, delta, A, B, C, None, z, delta_bias, initial_state, cu_seqlens,
                            softplus)  # fmt: skip

    path = tmp_path / "wrong.onnx"
    table = {torch.ops.selective_scan.scan_fwd.default: without_d}
    sso.export(model, args, path, custom_translation_table=table,
               input_names=[k for k in SCAN_INPUTS if inputs[k] is not None])  # fmt: skip
    got = run(session(path), inputs)
    with pytest.raises(AssertionError, match="max error"):
        assert_rel_close("out", got[0], model(*args)[0])


class Step(torch.nn.Module):
    """selective_state_update on a copy of the state: (out, new state)."""

    def __init__(self, dt_softplus: bool):
        super().__init__()
        self.dt_softplus = dt_softplus

    def forward(self, state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices):
        state = state.clone()
        out = selective_state_update(
            state, x, dt, A, B, C, D, z, dt_bias, self.dt_softplus, state_batch_indices
        )
        return out, state


STEP_ARGS = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")


def step_inputs(form: str, batch: int, optional: bool, indices: bool, seed: int) -> dict:
    """Plain (batch, dim, dstate) or heads (batch, nheads, dim, dstate) with 2 groups."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    heads = (3, 4) if form == "heads" else ()  # (nheads = 4, ngroups = 2) below
    nheads, dim, dstate = 4, 6, 5
    h = (nheads,) if heads else ()
    slots = batch + 2 if indices else batch
    return {
        "state": r(slots, *h, dim, dstate),
        "x": r(batch, *h, dim),
        "dt": r(batch, *h, dim),
        "A": -torch.rand(*h, dim, dstate, generator=gen) - 0.1,
        "B": r(batch, 2, dstate) if heads else r(batch, dstate),
        "C": r(batch, 2, dstate) if heads else r(batch, dstate),
        "D": r(*h, dim) if optional else None,
        "z": r(batch, *h, dim) if optional else None,
        "dt_bias": r(*h, dim) if optional else None,
        # a padding row (-1) and rows out of order
        "state_batch_indices": torch.tensor([slots - 1, -1, 0, 2][:batch]) if indices else None,
    }


@pytest.mark.parametrize(
    ("form", "optional", "indices"),
    [
        ("plain", True, False),
        ("heads", False, False),
        ("heads", True, True),
        ("plain", False, True),
    ],
)
def test_state_update_matches_eager(form, optional, indices, tmp_path):
    model = Step(dt_softplus=optional)
    traced = step_inputs(form, 3, optional, indices, seed=0)
    batch = torch.export.Dim("batch", min=2)
    slots = torch.export.Dim("slots", min=2)
    shapes = {k: None for k in STEP_ARGS}
    for name in ("x", "dt", "B", "C", "z", "state_batch_indices"):
        if traced[name] is not None:
            shapes[name] = {0: batch}
    shapes["state"] = {0: slots if indices else batch}
    path = tmp_path / "step.onnx"
    names = [k for k in STEP_ARGS if traced[k] is not None]
    args = tuple(traced[k] for k in STEP_ARGS)
    sso.export(model, args, path, dynamic_shapes=shapes, input_names=names)
    sess = session(path)
    for batch_size, seed in ((3, 0), (4, 1)):
        inputs = step_inputs(form, batch_size, optional, indices, seed)
        expected = model(*(inputs[k] for k in STEP_ARGS))
        for name, a, e in zip(("out", "state"), run(sess, inputs), expected, strict=True):
            assert_rel_close(f"{name} at batch {batch_size}", a, e)


def test_translation_table_names_the_ops():
    table = sso.translation_table()
    assert torch.ops.selective_scan.scan_fwd.default in table
    assert torch.ops.selective_scan_onnx.state_update_values.default in table
    if hasattr(torch.ops.selective_scan, "scan_fwd_triton"):
        assert torch.ops.selective_scan.scan_fwd_triton.default in table


def test_torch_onnx_export_with_the_table(tmp_path):
    """The table alone, given to torch.onnx.export, exports a model that calls the scan."""
    inputs = make_inputs(batch=2, seqlen=20, device="cpu")
    model = Scan(delta_softplus=True)
    args = tuple(inputs[k] for k in SCAN_INPUTS)
    program = torch.onnx.export(
        model, args, dynamo=True, custom_translation_table=sso.translation_table(),
        input_names=[k for k in SCAN_INPUTS if inputs[k] is not None], verbose=False,
    )  # fmt: skip
    program.save(tmp_path / "direct.onnx")
    domains = {node.domain for node in program.model_proto.graph.node}
    assert domains <= {"", "ai.onnx"}, f"non-standard domains {domains}"
    got = run(session(tmp_path / "direct.onnx"), inputs)
    assert_rel_close("out", got[0], model(*args)[0])


def test_importing_selective_scan_does_not_import_onnx():
    code = (
        "import sys, selective_scan\n"
        "names = ('onnx', 'onnxscript', 'onnxruntime', 'onnx_ir')\n"
        "loaded = [m for m in names if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
