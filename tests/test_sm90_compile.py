"""The kernels compile for an H100/H200 (sm_90) at configurations the GPU suite does not reach,
on any machine with triton installed (Triton ships the whole compiler, ptxas included): a
configuration that Triton cannot compile then fails here, not on a user's GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# make_inputs arguments (dtype by name).
CASES = [
    # One channel per program (dim / groups odd) and one step tile: the 2026-11-30 crash
    # (Triton's AxisInfo assertion on a hint over a one-element tensor).
    dict(
        batch=2,
        dim=2,
        dstate=2,
        seqlen=4,
        groups=2,
        b_form="grouped",
        c_form="grouped",
        dtype="float64",
    ),
    dict(
        batch=1,
        dim=6,
        dstate=1,
        seqlen=12,
        groups=2,
        b_form="grouped",
        c_form="variable",
        dtype="float32",
        z=False,
        initial_state=True,
    ),
    # Rows declared aligned (a multiple of T, not of 16) with constant B/C.
    dict(
        batch=2,
        dim=16,
        dstate=16,
        seqlen=264,
        b_form="constant",
        c_form="constant",
        dtype="float16",
    ),
    # Padded rows (an odd length) and packed sequences with an odd total.
    dict(batch=1, dim=32, dstate=16, seqlen=37, dtype="bfloat16", cu_seqlens=[0, 5, 5, 37]),
    # Sequence ranges: both launches (local pass and main pass) of each direction.
    dict(batch=1, dim=8, dstate=16, seqlen=1024, dtype="bfloat16", D=False, delta_bias=False),
]


def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    tests_dir = Path(__file__).resolve().parent
    result = subprocess.run(
        [sys.executable, str(tests_dir / "compile_sm90.py"), json.dumps(CASES)],
        capture_output=True, text=True, env=env, cwd=tests_dir, timeout=600,
    )  # fmt: skip
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, report
    assert result.stdout.count("ok ") == len(CASES), report
    assert "LOCAL=True" in result.stdout, report  # the ranges case reached the local pass
