"""Variants of the lanes kernel (kernels/scan_fwd_lanes.py) as edits of its source, for S6's
forward: offline sm_90 SASS on any machine (`sass`), float64 checks under the Triton
interpreter (`check`), CUDA-graph timings on a GPU (`time`, one process, rounds alternating).

    python bench/experiments/lanes_variants.py sass base lanes32 lanes32@72
    TRITON_INTERPRET=1 python bench/experiments/lanes_variants.py check lanes32
    python bench/experiments/lanes_variants.py time base,lanes32,lanes32@72 [--out DIR]
        [--dstates 4,8,16]

A variant is a list of (old, new) source edits, tile overrides for scan.config, and the
register cap of eager launches (scan.LANES_MAXNREG), which NAME@CAP replaces; A+B applies both
variants' edits (A's tiles and cap); NAME:FILE edits FILE, another version of the kernel's
module (`git show REV:src/selective_scan/kernels/scan_fwd_lanes.py > FILE`) that takes the
same arguments.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from inspect_kernels import resource_usage, sass_histogram  # noqa: E402
from report import edited_module  # noqa: E402
from shapes import make_bench_inputs  # noqa: E402

from selective_scan import selective_scan_fn, selective_scan_ref  # noqa: E402
from selective_scan.kernels import scan, scan_fwd_lanes  # noqa: E402
from selective_scan.kernels.offline import compile_sm90, record_launches  # noqa: E402

# A variant's tiles and register cap are the committed kernel's unless it says.
LANES16 = {"LANES": 16, "NS": 1, "T": 16}
VARIANTS = {
    # The committed kernel, its tiles forced (CPU tensors would take the tile kernels).
    "base": dict(edits=[]),
    # A channel's 256 steps over all 32 lanes, 8 a thread, one channel a warp (session 24,
    # offline: 121 instructions a state and no spills at 64 registers, against 196 a state for
    # two channels and 6 reloads at 96).
    "lanes32": dict(
        edits=[
            ("LANES_STEPS = (16, 16)", "LANES_STEPS = (32, 8)"),
            ("(LANES == 16) & (T == 16)", "(LANES == 32) & (T == 8)"),
            ("for _ in tl.static_range(4):  # log2(S), S = 16", "for _ in tl.static_range(3):"),
        ],
        tiles={"LANES": 32, "NS": 1, "T": 8},
        maxnreg=64,
    ),
    # The per-state stores as inline PTX (Triton's coalescing pass gave them a layout of their
    # own, and `ends` a shuffle into it at every state), with the lanes' indices taken from each
    # thread's last step as `ends` is (session 25).
    "asmstore": dict(
        edits=[
            (
                "    lane = tl.arange(0, LANES)[None, :]  # [1, LANES]\n",
                "    steps_ = tl.zeros([BD, CH], tl.int32) + tl.arange(0, CH)[None, :]\n"
                "    lane = _lane_ends(steps_, BD, LANES, S) // S  # [BD, LANES]\n",
            ),
            (
                "        tl.store(ckpt_row + slot * s_kc + n, ends, mask=slot_ok)\n"
                "        tl.store(last_row + n, ends, mask=row_ok & (lane == LANES - 1))\n",
                "        tl.inline_asm_elementwise(\n"
                '            "{ .reg .pred p, q; setp.ne.u32 p, $3, 0; setp.ne.u32 q, $4, 0;"\n'
                '            " @p st.global.b32 [$1], $5; @q st.global.b32 [$2], $5;"\n'
                '            " mov.u32 $0, 0; }",\n'
                '            "=r,l,l,r,r,r",\n'
                "            [ckpt_row + slot * s_kc + n, last_row + n, slot_ok.to(tl.int32),\n"
                "             (row_ok & (lane == LANES - 1)).to(tl.int32),\n"
                "             ends.to(tl.int32, bitcast=True)],\n"
                "            dtype=tl.int32, is_pure=False, pack=1)\n",
            ),
        ],
    ),
    # Probes, wrong results: the time of the gate (z's load, silu) and of the per-state
    # checkpoint and last-state stores, by leaving them out (session 25).
    "noz": dict(
        edits=[("    if HAS_Z:\n        zz = _steps(", "    if False:\n        zz = _steps(")],
    ),
    "nostore": dict(
        edits=[
            ("        tl.store(ckpt_row + slot * s_kc + n, ends, mask=slot_ok)\n", ""),
            ("        tl.store(last_row + n, ends, mask=row_ok & (lane == LANES - 1))\n", ""),
        ],
    ),
    # The state loop unrolled twice, so that ptxas may overlap a state's exponentials with the
    # previous state's chain (session 28, offline at the cap of 96: 395 instructions for two
    # states, 12 spill reloads a state against 6, a 104-byte stack against 32; not timed).
    "unroll2": dict(
        edits=[
            ("for n in tl.range(0, DSTATE):", "for n in tl.range(0, DSTATE, loop_unroll_factor=2):")
        ]
    ),
    # Probe, wrong results: every state reads state 0's B and C rows (L1 hits after the
    # first): what the per-state loads' latency costs (session 29: -0.57 us before z's
    # prefetch landed, -0.06 after).
    "bsame": dict(
        edits=[
            ("_bc_rows(B_seq + n1 * s_Bn,", "_bc_rows(B_seq + n1 * (seqlen >> 20) * s_Bn,"),
            ("_bc_rows(C_seq + n * s_Cn,", "_bc_rows(C_seq + n * (seqlen >> 20) * s_Cn,"),
        ]
    ),
    # C's row loaded a state ahead, as B's (session 29: +2.3 us, 13 spill reloads a state).
    "cahead": dict(
        edits=[
            (
                "    b_next = _bc_rows(B_seq, B_offs, B_ok, ACC, BD, LANES, S)\n",
                "    b_next = _bc_rows(B_seq, B_offs, B_ok, ACC, BD, LANES, S)\n"
                "    c_next = _bc_rows(C_seq, C_offs, C_ok, ACC, BD, LANES, S)\n",
            ),
            (
                "        c = _bc_rows(C_seq + n * s_Cn, C_offs, C_ok, ACC, BD, LANES, S)\n",
                "        c = c_next\n"
                "        c_next = _bc_rows(C_seq + n1 * s_Cn, C_offs, C_ok, ACC, BD, LANES, S)\n",
            ),
        ]
    ),
    # The lines of the next state's B and C loads prefetched into L1 at the top of each state,
    # one line a lane: ptxas issues those loads late, under the register cap (session 29:
    # 59 us against 21.4).
    "l1pf": dict(
        edits=[
            (
                "    u_seq = u_ptr + batch * s_ub\n",
                "    pj = tl.arange(0, 32)\n"
                "    if FAST:\n"
                "        B_v: tl.constexpr = 1024 // B_ptr.dtype.element_ty.primitive_bitwidth\n"
                "        C_v: tl.constexpr = 1024 // C_ptr.dtype.element_ty.primitive_bitwidth\n"
                "        pf_line = tl.where(\n"
                "            pj < B_lines, B_start + (pj * B_v).to(tl.int64) * s_Bt,\n"
                "            C_start + ((pj - B_lines) * C_v).to(tl.int64) * s_Ct)\n"
                "        pf_state = tl.where(pj < B_lines, s_Bn, s_Cn)\n"
                "        pf_ok = (pj < B_lines + C_lines).to(tl.int32)\n"
                "    u_seq = u_ptr + batch * s_ub\n",
            ),
            (
                "        b_next = _bc_rows(B_seq + n1 * s_Bn,",
                "        if FAST:\n"
                "            pf_n = tl.where(pj < B_lines, tl.minimum(n + 2, DSTATE - 1), n1)\n"
                "            tl.inline_asm_elementwise(\n"
                '                "{ .reg .pred q; setp.ne.u32 q, $2, 0;"\n'
                '                " @q prefetch.global.L1 [$1]; mov.u32 $0, 0; }",\n'
                '                "=r,l,r", [pf_line + pf_n * pf_state, pf_ok], dtype=tl.int32,\n'
                "                is_pure=False, pack=1)\n"
                "        b_next = _bc_rows(B_seq + n1 * s_Bn,",
            ),
        ]
    ),
    # The gate's sigmoid with one reciprocal for four steps (sigmoid(z) = m / w, w = 1 + e,
    # e = exp(-|z|), m = 1 or e by z's sign; w lies in [1, 2], so a product of four cannot
    # overflow): 20 MUFU a thread in the epilogue, not 32 (session 29: +0.12 to +0.18 us).
    "gate4": dict(
        edits=[
            (
                "@triton.jit\ndef _scan_fwd_lanes_kernel(",
                "@triton.jit\n"
                "def _sigmoid4(z, BD: tl.constexpr, CH: tl.constexpr, FAST: tl.constexpr):\n"
                "    e = tl.math.exp2(-tl.abs(z) * LOG2E)\n"
                "    m = tl.where(z >= 0, 1.0, e)\n"
                "    w02, w13 = tl.split(tl.reshape(1.0 + e, [BD, CH // 4, 2, 2]))\n"
                "    w0, w2 = tl.split(w02)\n"
                "    w1, w3 = tl.split(w13)\n"
                "    p01 = w0 * w1\n"
                "    p23 = w2 * w3\n"
                "    r = reciprocal(p01 * p23, FAST)\n"
                "    r01 = r * p23\n"
                "    r23 = r * p01\n"
                "    inv = tl.join(tl.join(w1 * r01, w3 * r23), tl.join(w0 * r01, w2 * r23))\n"
                "    return m * tl.reshape(inv, [BD, CH])\n"
                "\n\n"
                "@triton.jit\ndef _scan_fwd_lanes_kernel(",
            ),
            ("out *= zz * sigmoid(zz, FAST)", "out *= zz * _sigmoid4(zz, BD, CH, FAST)"),
            ("import LOG2E, block_and_sequence,", "import LOG2E, reciprocal, block_and_sequence,"),
        ]
    ),
    # The lanes' scan without shuffling P: round d multiplies by the decay of lanes (l - d, l],
    # exp2(A log2(e) W_d(l)) with W_d the sum of delta over those lanes, the same at every
    # state and summed once before the loop (session 29: +1.4 us, 12 spill reloads a state).
    "pexp": dict(
        edits=[
            (
                '    h0, log_p = f"${3 * steps}", f"${4 * steps}"\n',
                '    h0, log_p = f"${3 * steps}", f"${4 * steps}"\n'
                '    log_w = {2: f"${5 * steps}", 4: f"${6 * steps}", 8: f"${7 * steps}"}\n',
            ),
            (
                "        lines += [\n"
                '            f"shfl.sync.up.b32 xu|p, X, {d}, {segment}, 0xffffffff;",\n'
                '            f"shfl.sync.up.b32 pu, P, {d}, {segment}, 0xffffffff;",\n'
                '            "@p fma.rn.f32 X, P, xu, X;",\n'
                '            "@p mul.f32 P, P, pu;",\n'
                "        ]\n",
                "        if d > 1:\n"
                '            lines.append(f"ex2.approx.ftz.f32 P, {log_w[d]};")\n'
                "        lines += [\n"
                '            f"shfl.sync.up.b32 xu|p, X, {d}, {segment}, 0xffffffff;",\n'
                '            "@p fma.rn.f32 X, P, xu, X;",\n'
                "        ]\n",
            ),
            ('["f"] * (4 * LANES_STEPS[1])', '["f"] * (7 * LANES_STEPS[1])'),
            (
                "        dt_sums = tl.sum(tl.reshape(dt, [BD, LANES, S]), axis=2)  # [BD, LANES]\n",
                "        dt_sums = tl.sum(tl.reshape(dt, [BD, LANES, S]), axis=2)  # [BD, LANES]\n"
                "        w2 = _window_sum(dt_sums, 1, LANES)\n"
                "        w4 = _window_sum(w2, 2, LANES)\n"
                "        w8 = _window_sum(w4, 4, LANES)\n",
            ),
            (
                "@triton.jit\ndef _scan_fwd_lanes_kernel(",
                "@triton.jit\n"
                "def _window_sum(w, d: tl.constexpr, LANES: tl.constexpr):\n"
                "    lane = tl.arange(0, LANES)[None, :]\n"
                "    back = tl.broadcast_to(tl.maximum(lane - d, 0), w.shape)\n"
                "    return w + tl.where(lane >= d, tl.gather(w, back, axis=1), 0.0)\n"
                "\n\n"
                "@triton.jit\n"
                "def _wide(v, BD: tl.constexpr, LANES: tl.constexpr, S: tl.constexpr):\n"
                "    v = tl.broadcast_to(v[:, :, None], [BD, LANES, S])\n"
                "    return tl.reshape(v, [BD, LANES * S])\n"
                "\n\n"
                "@triton.jit\ndef _scan_fwd_lanes_kernel(",
            ),
            (
                "                [a, x, tl.broadcast_to(h0, [BD, CH]), log_p],\n",
                "                [a, x, tl.broadcast_to(h0, [BD, CH]), log_p,\n"
                "                 _wide(w2 * A2_lanes, BD, LANES, S),\n"
                "                 _wide(w4 * A2_lanes, BD, LANES, S),\n"
                "                 _wide(w8 * A2_lanes, BD, LANES, S)],\n",
            ),
        ]
    ),
}


def variant_kernel(edits: list, source: str | None = None):
    """The lanes kernel with the source edits (of the file at source, else the package's)."""
    if not edits and not source:
        return scan_fwd_lanes._scan_fwd_lanes_kernel
    copy = edited_module(scan_fwd_lanes, edits, "lanes_variant", source and Path(source))
    return copy._scan_fwd_lanes_kernel


ORIGINAL_CONFIG, ORIGINAL_MAXNREG = scan.config, scan.LANES_MAXNREG


def use(spec: str) -> int:
    """Route the scan's eager launches through the variant NAME[@CAP]; its register cap."""
    names, _, cap = spec.partition("@")
    names, _, source = names.partition(":")
    parts = [VARIANTS[name] for name in names.split("+")]  # a+b: both variants' edits
    v = parts[0]
    scan._scan_fwd_lanes_kernel = variant_kernel([e for p in parts for e in p["edits"]], source)
    scan.config = scan.overridden(ORIGINAL_CONFIG, v.get("tiles", LANES16))
    scan.LANES_MAXNREG = int(cap) if cap else v.get("maxnreg", ORIGINAL_MAXNREG)
    scan._PLANS.clear()
    return scan.LANES_MAXNREG


def state_loops(sass: str) -> list[tuple[int, dict]]:
    """(instructions, top opcodes) of each loop (a backward branch) in the SASS."""
    addr = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
    lines = sass.splitlines()
    instrs, labels = [], {}
    for i, line in enumerate(lines):
        if m := addr.search(line):
            instrs.append((int(m.group(1), 16), m.group(2).strip()))
        m = re.match(r"\.(L_x_\d+):", line.strip())
        nxt = next((addr.search(x) for x in lines[i + 1 :] if addr.search(x)), None) if m else None
        if nxt:
            labels[m.group(1)] = int(nxt.group(1), 16)
    loops = []
    for a, ins in instrs:
        m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", ins)
        if m and labels.get(m.group(1), a + 1) < a:
            body = [i for b, i in instrs if labels[m.group(1)] <= b <= a]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0]
                                      for i in body)  # fmt: skip
            loops.append((len(body), dict(ops.most_common(10))))
    return loops


def sass(names: list[str]) -> None:
    x = make_bench_inputs("S6", device="cpu")
    softplus = x.pop("delta_softplus")
    for name in names:
        cap = use(name)
        launches = record_launches(lambda: scan.scan_fwd(**x, delta_softplus=softplus))
        kernel, _, args, kwargs = next(launch for launch in launches
                                       if launch[0] is scan._scan_fwd_lanes_kernel)  # fmt: skip
        compiled = compile_sm90(kernel, args, dict(kwargs, maxnreg=cap))
        cubin = Path(tempfile.mkdtemp()) / (re.sub(r"[^\w@+]", "_", name) + ".cubin")
        sass_histogram(compiled.asm["cubin"], cubin)  # writes the cubin and its .sass
        text = cubin.with_suffix(".sass").read_text()
        print(name, f"cap {cap}", resource_usage(cubin), "state loop", state_loops(text),
              flush=True)  # fmt: skip


def check(names: list[str]) -> None:
    """Each variant against the float64 reference on small inputs (interpreter or GPU)."""
    sys.path.insert(0, str(BENCH.parent / "tests"))
    from helpers import make_inputs

    os.environ["SELECTIVE_SCAN_BACKEND"] = "triton"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in names:
        use(name)
        for case in (dict(seqlen=256, dstate=16, initial_state=True),
                     dict(seqlen=48, dtype=torch.bfloat16, dstate=5, b_form="grouped",
                          c_form="grouped"),
                     dict(seqlen=144, dim=7)):  # fmt: skip
            x = make_inputs(device=device, batch=2, **{"dim": 8, **case})
            out, last = selective_scan_fn(**x, delta_softplus=True, return_last_state=True)
            wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                    for k, v in x.items()}  # fmt: skip
            ref, ref_last = selective_scan_ref(**wide, delta_softplus=True, return_last_state=True)
            err = max(((out.double() - ref).norm() / ref.norm()).item(),
                      ((last.double() - ref_last).norm() / ref_last.norm()).item())  # fmt: skip
            print(name, case, f"rel err {err:.2e}", flush=True)


def time(names: list[str], out_dir: str | None, dstates: list[int], rounds: int = 5) -> None:
    """CUDA-graph replays of S6's forward through each variant, at each count of states (the
    first dstate of S6's A, B, C: the time a state takes, and the rest)."""
    from triton.testing import do_bench

    full = make_bench_inputs("S6")
    graphs, results = {}, {}
    for dstate in dstates:
        x = dict(full, A=full["A"][:, :dstate], B=full["B"][:, :dstate], C=full["C"][:, :dstate])
        wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in x.items()}  # fmt: skip
        ref = selective_scan_ref(**wide)
        for name in names:
            key = name if dstates == [16] else f"{name} dstate {dstate}"
            use(name)
            out = selective_scan_fn(**x)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(key, f"rel err against float64 {err:.2e}", flush=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                selective_scan_fn(**x)
            graphs[key], results[key] = graph, []
    for _ in range(rounds):
        for key, graph in graphs.items():
            results[key].append(do_bench(graph.replay, warmup=50, rep=200))
        print({n: round(r[-1] * 1e3, 2) for n, r in results.items()}, flush=True)
    summary = {n: statistics.median(r) * 1e3 for n, r in results.items()}
    print("graph medians (us):", summary)
    if out_dir:
        Path(out_dir, "lanes_variants.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["sass", "check", "time"])
    parser.add_argument("names", nargs="+")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--dstates", default="16", help="time: comma-separated state counts")
    args = parser.parse_args()
    names = list(dict.fromkeys(n for arg in args.names for n in arg.split(",")))  # once each
    if args.mode == "sass":
        sass(names)
    elif args.mode == "check":
        check(names)
    else:
        time(names, args.out, [int(n) for n in args.dstates.split(",")])


if __name__ == "__main__":
    main()
