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


def z_prefetch_at(state: str) -> list:
    """Edits: z's rows prefetched into L2 (see zpf) when the state loop reaches `state`, by a
    predicate (a branch in the loop took it to 281 instructions a state)."""
    return [
        (
            "    y = tl.zeros([BD, CH], ACC)\n",
            "    y = tl.zeros([BD, CH], ACC)\n"
            "    if FAST & HAS_Z:\n"
            "        z_lines = (seqlen * z_ptr.dtype.element_ty.primitive_bitwidth + 1023)"
            " // 1024\n"
            "        zj = tl.arange(0, 32)\n"
            "        z_line = (z_ptr + batch * s_zb"
            " + (blk * BD + zj // z_lines).to(tl.int64) * s_zd"
            " + ((zj % z_lines) * (1024 // z_ptr.dtype.element_ty.primitive_bitwidth))"
            ".to(tl.int64) * s_zt)\n"
            "        z_ok = zj < tl.minimum(BD, dim - blk * BD) * z_lines\n",
        ),
        (
            "        b = b_next\n",
            "        if FAST & HAS_Z:\n"
            "            tl.inline_asm_elementwise(\n"
            '                "{ .reg .pred q; setp.ne.u32 q, $2, 0; @q prefetch.global.L2 [$1];'
            ' mov.u32 $0, 0; }",\n'
            '                "=r,l,r", [z_line, (z_ok & (n == ' + state + ")).to(tl.int32)],"
            " dtype=tl.int32, is_pure=False, pack=1)\n"
            "        b = b_next\n",
        ),
    ]


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
    # z's rows prefetched into L2 at the start (session 25): the epilogue's z load then hits
    # L2 instead of waiting on DRAM with every warp at once.
    "zpf": dict(
        edits=[
            ("s_t, DSTATE: tl.constexpr, LPR):", "s_t, DSTATE, LPR):"),
            (
                "            _prefetch_rows(C_start, k, s_Cn, s_Ct, DSTATE, C_lines)\n",
                "            _prefetch_rows(C_start, k, s_Cn, s_Ct, DSTATE, C_lines)\n"
                "        if HAS_Z:\n"
                "            z_lines = (seqlen * z_ptr.dtype.element_ty.primitive_bitwidth + 1023)"
                " // 1024\n"
                "            z_rows = z_ptr + batch * s_zb + (blk * BD).to(tl.int64) * s_zd\n"
                "            _prefetch_rows(z_rows, 0, s_zd, s_zt, tl.minimum(BD, dim - blk * BD),"
                " z_lines)\n",
            ),
        ],
    ),
    # The same, later: at the start, z's lines queued behind delta's and u's (all programs
    # load theirs at once); mid-loop, DRAM is idle (session 25).
    "zmid": dict(edits=z_prefetch_at("DSTATE // 2")),
    "z3q": dict(edits=z_prefetch_at("DSTATE * 3 // 4")),
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
