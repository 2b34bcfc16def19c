"""Hardware counters of every kernel of a training step, ours and the anchor's (Nsight Compute).

    python bench/ncu_profile.py [--shapes S1,S2,...] [--anchor S1,S8] [--source S1] [--out FILE]

Per shape, a child process runs the public function's forward and backward through autograd
(as gpu_bench.py's `fwd_bwd_ms`), or at the --anchor shapes mamba's `fwd` and `bwd` on the same
inputs (bench/anchor.py builds it), twice to warm up and once under `ncu --clock-control none`
(the profiled range opened and closed around that one step with cudaProfilerStart/Stop). Every
kernel in the range is profiled, each replayed for its sections: SpeedOfLight,
ComputeWorkloadAnalysis, MemoryWorkloadAnalysis (and its tables), LaunchStats, Occupancy,
SchedulerStats, WarpStateStats, InstructionStats. Kept per kernel: time, registers, grid, waves,
occupancy, issue activity, warp instructions, XU (MUFU: exponentials and other special
functions) instructions, DRAM bytes, pipe and unit utilisation, shared-memory wavefronts and
bank conflicts, and warp stall reasons in cycles per issued instruction (`stalls`). At the
--source shapes, the step's first backward kernel (at shapes cut into ranges, the local pass)
is profiled again with SourceCounters: per source line of the kernels (Python, through the
cubin's line table), the share of the warp state samples, their stall reasons, instructions
executed and shared-memory wavefronts against the ideal (`source_lines`, the top lines by
samples). The .ncu-rep reports go to --reports when given. Kernel replay times each kernel alone
with cold caches (ncu's default cache control), so `time_us` is a little above what the same
kernel takes in a running step.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchor
from report import environment, git_commit
from shapes import SHAPES, make_bench_inputs

SECTIONS = (
    "SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
    "MemoryWorkloadAnalysis_Tables", "LaunchStats", "Occupancy", "SchedulerStats",
    "WarpStateStats", "InstructionStats",
)  # fmt: skip
# Counters the sections may not collect; dropped (with a note in the results) if ncu rejects one.
EXTRA_METRICS = (
    "smsp__inst_executed_pipe_xu.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
)
# summary key: raw metric name
NAMED = {
    "time_us": "gpu__time_duration.sum",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "waves": "launch__waves_per_multiprocessor",
    "shared_bytes_per_block": "launch__shared_mem_per_block",
    "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "warps_active_per_scheduler": "smsp__warps_active.avg.per_cycle_active",
    "warps_eligible_per_scheduler": "smsp__warps_eligible.avg.per_cycle_active",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warp_instructions": "smsp__inst_executed.sum",
    "xu_warp_instructions": "smsp__inst_executed_pipe_xu.sum",
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex_throughput_pct": "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
}
# summary key: pattern over raw metric names; the first group names the entry
PEAK = r"\.avg\.pct_of_peak_sustained_active$"
GROUPS = {
    "pipe_pct": re.compile(r"sm__inst_executed_pipe_(\w+)" + PEAK),
    "pipe_cycles_pct": re.compile(r"sm__pipe_(\w+)_cycles_active" + PEAK),
    "stalls": re.compile(r"smsp__average_(warps?_(?:latency_)?issue_stalled_\w+)\.ratio$"),
    "shared_memory": re.compile(
        r"(l1tex__data_(?:bank_conflicts|pipe_lsu_wavefronts)_\w*shared\w*\.sum)$"
    ),
}
# Units of the summary's values (us, bytes), by the unit's numerator ("Kbyte" of "Kbyte/block").
UNIT_SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
              "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}  # fmt: skip


def step_of(side: str, shape: str):
    """One training step's scan work on the shape's bench inputs: ours through autograd, or the
    anchor's kernels called directly (its forward, then its backward)."""
    from gpu_bench import fwd_bwd_step, leaf_args

    from selective_scan import selective_scan_fn

    x = make_bench_inputs(shape)
    dout = torch.randn_like(x["u"])
    if side == "ours":
        leaves = leaf_args(x)
        return lambda: fwd_bwd_step(selective_scan_fn, leaves, dout)
    module = anchor.build()
    if module is None:
        raise SystemExit("the anchor cannot be built here")
    args = anchor.anchor_inputs(x)
    return lambda: anchor.forward_backward(module, args, dout)


def run_step(side: str, shape: str) -> None:
    """The child's work: warm up, then one step inside the profiled range."""
    step = step_of(side, shape)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def number(value: str, unit: str):
    """A raw CSV cell as a number in the summary's units (us, bytes), else the text."""
    try:
        v = float(value.replace(",", ""))
    except ValueError:
        return value
    return v * UNIT_SCALE.get(unit.split("/")[0], 1.0)


def summarise(names: list[str], units: list[str], row: list[str]) -> dict:
    """The kept metrics of one kernel's raw row."""
    cells = {n: (v, u) for n, v, u in zip(names, row, units, strict=False)}
    out = {"kernel": cells.get("Kernel Name", ("?", ""))[0]}
    for key, metric in NAMED.items():
        if metric in cells:
            out[key] = number(*cells[metric])
    for key, pattern in GROUPS.items():
        found = {m.group(1): number(*cells[n]) for n in names if (m := pattern.match(n))}
        if found:
            out[key] = found
    return out


def parse_raw_csv(text: str) -> list[dict]:
    """Kernels of `ncu --import R --csv --page raw`: a header row, a units row, a row each."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2:
        return []
    names, units = rows[0], rows[1]
    return [summarise(names, units, row) for row in rows[2:]]


def run_ncu(report: Path, options: list[str], side: str, shape: str) -> dict | None:
    """ncu with `options` on a child running `side`'s step at `shape`, its report written to
    report.ncu-rep: None, or {error, log} where ncu failed."""
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", *options, "-f",
           "-o", str(report), sys.executable, __file__, "--child", side, shape]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 or not report.with_suffix(".ncu-rep").exists():
        return {"error": f"ncu exited {run.returncode}", "log": (run.stdout + run.stderr)[-4000:]}
    return None


def ncu_page(report: Path, *options: str) -> subprocess.CompletedProcess:
    """`ncu --import report.ncu-rep --csv` with the page `options`."""
    cmd = ["ncu", "--import", str(report.with_suffix(".ncu-rep")), "--csv", *options]
    return subprocess.run(cmd, capture_output=True, text=True)


def profile(side: str, shape: str, reports: Path, extra: tuple[str, ...]) -> dict:
    """ncu on a child running `side`'s step at `shape`: {kernels, seconds} or {error}."""
    report = reports / f"{side}_{shape}"
    options = [arg for section in SECTIONS for arg in ("--section", section)]
    if extra:
        options += ["--metrics", ",".join(extra)]
    t0 = time.perf_counter()
    failed = run_ncu(report, options, side, shape)
    seconds = round(time.perf_counter() - t0, 1)
    if failed:
        return failed | {"seconds": seconds}
    raw = ncu_page(report, "--page", "raw")
    kernels = parse_raw_csv(raw.stdout)
    if not kernels:
        return {"error": "no kernels in the report", "log": raw.stderr[-2000:]}
    return {"kernels": kernels, "seconds": seconds}


def _float(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def parse_source_csv(text: str, top: int = 30) -> dict:
    """Per source line of `ncu --import R --page source --csv --print-source cuda,sass`: each
    file's "Line No" rows carry that line's totals over its SASS instructions. The `top` lines
    by warp state samples, each with its share of the samples, stall reasons (share of the
    line's samples, those over 5%), instructions executed and shared-memory wavefronts."""
    lines, header, path = [], None, "?"
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[0] == "File Path":
            path = row[1].rsplit("/", 1)[-1]
        elif row and row[0] == "Line No":
            header = row
        elif header and len(row) == len(header) and row[0] and row[2] == "-":
            cells = dict(zip(header, row, strict=True))
            cells["where"] = f"{path}:{row[0]}"
            cells["code"] = row[1].strip()[:90]
            lines.append(cells)
    if not lines:
        return {}
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(_float(c[samples]) for c in lines)
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    kept = []
    for c in sorted(lines, key=lambda c: -_float(c[samples]))[:top]:
        n = _float(c[samples]) or 1.0
        stalls = {h[6:]: round(100 * _float(c[h]) / n) for h in reasons}
        kept.append({
            "line": c["where"], "code": c["code"],
            "samples_pct": round(100 * _float(c[samples]) / total, 2),
            "stalls_pct": {k: v for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]) if v > 5},
            "instructions": _float(c["Instructions Executed"]),
            "shared_wavefronts": _float(c["L1 Wavefronts Shared"]),
            "shared_wavefronts_ideal": _float(c["L1 Wavefronts Shared Ideal"]),
        })  # fmt: skip
    return {
        "samples": total,
        "instructions": sum(_float(c["Instructions Executed"]) for c in lines),
        "shared_wavefronts": sum(_float(c["L1 Wavefronts Shared"]) for c in lines),
        "lines": kept,
    }


def profile_source(shape: str, reports: Path) -> dict:
    """ncu's SourceCounters of the first backward kernel of our step at `shape`."""
    report = reports / f"source_{shape}"
    options = ["-k", "regex:_scan_bwd_kernel", "-c", "1", "--section", "SourceCounters",
               "--section", "WarpStateStats", "--import-source", "yes"]  # fmt: skip
    if failed := run_ncu(report, options, "ours", shape):
        return failed
    page = ncu_page(report, "--page", "source", "--print-source", "cuda,sass")
    return parse_source_csv(page.stdout) or {"error": "no source lines", "log": page.stderr}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--anchor", default="", help="shapes to profile the anchor's kernels at")
    parser.add_argument("--source", default="", help="shapes to profile the backward by line at")
    parser.add_argument("--out", default="ncu.json")
    parser.add_argument("--reports", default=None, help="keep the .ncu-rep files here")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_step(*args.child)
        return
    reports = Path(args.reports or tempfile.mkdtemp())
    reports.mkdir(parents=True, exist_ok=True)
    build = None
    if args.anchor:  # built (or found built) in the background while ours are profiled
        build = subprocess.Popen([sys.executable, "-c", "import anchor; anchor.build()"],
                                 cwd=Path(__file__).resolve().parent)  # fmt: skip
    results = environment("cuda") | {
        "commit": git_commit(),
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "shapes": {},
    }
    extra = EXTRA_METRICS
    runs = [("ours", s) for s in args.shapes.split(",") if s]
    runs += [("anchor", s) for s in args.anchor.split(",") if s]
    for side, shape in runs:
        if side == "anchor":
            build.wait()
        found = profile(side, shape, reports, extra)
        if "error" in found and extra and "metric" in found["log"].lower():
            results["extra_metrics_dropped"] = list(extra)
            extra = ()
            found = profile(side, shape, reports, extra)
        results["shapes"].setdefault(shape, {})[side] = found
        kernels = len(found.get("kernels", []))
        print(f"{side} {shape}: {found.get('seconds')} s, {kernels} kernels",
              found.get("error", ""), flush=True)  # fmt: skip
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for shape in (s for s in args.source.split(",") if s):
        results.setdefault("source_lines", {})[shape] = profile_source(shape, reports)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
