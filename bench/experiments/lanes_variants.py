"""Variants of the lanes kernel (kernels/scan_fwd_lanes.py) as edits of its source, for S6's
forward: offline sm_90 SASS on any machine (`sass`), float64 checks under the Triton
interpreter (`check`), CUDA-graph timings on a GPU (`time`, one process, rounds alternating).

    python bench/experiments/lanes_variants.py sass base lanes32 lanes32@72
    TRITON_INTERPRET=1 python bench/experiments/lanes_variants.py check lanes32
    python bench/experiments/lanes_variants.py time base,lanes32,lanes32@72 [--out DIR]

A variant is a list of (old, new) source edits, tile overrides for scan.config, and the
register cap of eager launches (scan.LANES_MAXNREG), which NAME@CAP replaces.
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

VARIANTS = {
    # The committed kernel, its tiles forced (CPU tensors would take the tile kernels).
    "base": dict(edits=[], tiles={"LANES": 16, "NS": 1, "T": 16}, maxnreg=scan.LANES_MAXNREG),
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
}


def variant_kernel(edits: list):
    """The lanes kernel with the source edits."""
    if not edits:
        return scan_fwd_lanes._scan_fwd_lanes_kernel
    return edited_module(scan_fwd_lanes, edits, "lanes_variant")._scan_fwd_lanes_kernel


ORIGINAL_CONFIG = scan.config


def use(spec: str) -> int:
    """Route the scan's eager launches through the variant NAME[@CAP]; its register cap."""
    name, _, cap = spec.partition("@")
    v = VARIANTS[name]
    scan._scan_fwd_lanes_kernel = variant_kernel(v["edits"])
    scan.config = scan.overridden(ORIGINAL_CONFIG, v["tiles"])
    scan.LANES_MAXNREG = int(cap) if cap else v["maxnreg"]
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
        cubin = Path(tempfile.mkdtemp()) / f"{name}.cubin"
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


def time(names: list[str], out_dir: str | None, rounds: int = 5) -> None:
    from triton.testing import do_bench

    x = make_bench_inputs("S6")
    wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in x.items()}  # fmt: skip
    ref = selective_scan_ref(**wide)
    graphs, results = {}, {}
    for name in names:
        use(name)
        out = selective_scan_fn(**x)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(name, f"rel err against float64 {err:.2e}", flush=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            selective_scan_fn(**x)
        graphs[name], results[name] = graph, []
    for _ in range(rounds):
        for name in names:
            results[name].append(do_bench(graphs[name].replay, warmup=50, rep=200))
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
    args = parser.parse_args()
    names = [n for arg in args.names for n in arg.split(",")]
    if args.mode == "sass":
        sass(names)
    elif args.mode == "check":
        check(names)
    else:
        time(names, args.out)


if __name__ == "__main__":
    main()
