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

GROUPED = dict(b_form="grouped", c_form="grouped", groups=2)
# make_inputs arguments (dtype by name).
CASES = [
    # One channel per program (channels per group odd), one tile: the 2026-11-30 crash (Triton's
    # AxisInfo assertion on a hint over a one-element tensor), in float64 and with dstate 1.
    {**GROUPED, "batch": 2, "dim": 2, "dstate": 2, "seqlen": 4, "dtype": "float64"},
    {**GROUPED, "batch": 1, "dim": 6, "dstate": 1, "seqlen": 12, "dtype": "float32", "z": False},
    # Rows declared aligned (a multiple of T, not of 16), constant B/C.
    dict(dim=16, dstate=16, seqlen=264, b_form="constant", c_form="constant", dtype="float16"),
    # Padded rows (an odd length) and packed sequences with an odd total.
    dict(batch=1, dim=32, dstate=16, seqlen=37, dtype="bfloat16", cu_seqlens=[0, 5, 5, 37]),
    # Sequence ranges: both launches (local pass and main pass) of each direction.
    dict(batch=1, dim=8, dstate=16, seqlen=1024, dtype="bfloat16", initial_state=True),
    # The lanes kernel (inline PTX scan): bfloat16 B/C in groups (widened by bit operations),
    # padded states, masked steps; float32 B/C and an odd channel count.
    {**GROUPED, "batch": 2, "dim": 8, "dstate": 5, "seqlen": 48, "dtype": "bfloat16"},
    dict(batch=1, dim=7, dstate=16, seqlen=144, dtype="float32", initial_state=True),
    # Grouped B/C with fewer channels a group than a tile has rows, cut into ranges (dim 4,
    # groups 2: each program covers 2 channels). Its tiles once had as few rows, Triton spread
    # them over lanes with values replicated, and the backward's local pass scanned such a
    # layout wrongly on the H200 (wrong du, ddelta, dA, dB from 512 steps on); odd groups too.
    {**GROUPED, "batch": 2, "dim": 4, "dstate": 8, "seqlen": 512, "dtype": "float32"},
    {**GROUPED, "groups": 4, "dim": 12, "dstate": 4, "seqlen": 640, "dtype": "bfloat16"},
    # 256 states, mamba's limit, split over a warp in every pass (scan.STATE_LANES), over ranges
    # (the earlier tiles held 64 to 128 a thread; with 64 states, 16 to 64 a thread, a case like
    # this compiled in 4.6 minutes).
    dict(batch=1, dim=4, dstate=256, seqlen=1024, dtype="bfloat16"),
    # Complex A's kernels: float32 and float64, each form of B/C, padded states.
    dict(complex=True, form_b="variable", form_c="constant", dstate=5, seqlen=70, dtype="float32"),
    dict(complex=True, form_b="grouped", form_c="variable", dstate=3, seqlen=9, dtype="float64"),
]


def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    tests_dir = Path(__file__).resolve().parent
    # Two processes, each compiling every other case: the compiles take minutes of one core,
    # and this test often runs last, beside an idle core.
    command = [sys.executable, str(tests_dir / "compile_sm90.py")]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes = [
        subprocess.Popen([*command, json.dumps(CASES[i::2])], env=env, cwd=tests_dir, **pipes)
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=600) for p in processes]
    finally:  # none left running after a timeout
        for p in processes:
            p.kill()
    stdout = "".join(out for out, _ in outputs)
    report = stdout + "".join(err[-1500:] for _, err in outputs)
    assert [p.returncode for p in processes] == [0, 0], report
    assert stdout.count("ok ") == len(CASES), report
    assert "LOCAL=True" in stdout, report  # the ranges case reached the local pass
    assert stdout.count("_scan_fwd_lanes_kernel") == 2, report
    assert stdout.count("_complex_scan_bwd_kernel") == 2, report
