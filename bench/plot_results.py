"""Plot time vs seqlen from bench/results/h200.json (ours) with the anchor figures.

python bench/plot_results.py [--results bench/results/h200.json] [--out ...png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# Anchor figures (shared/anchors.md), H200, 2026-11-29: batch 8, dim 1536, dstate 16, bf16.
ANCHOR_CUDA = {"fwd": {2048: 0.449}, "bwd": {2048: 1.777}}
ANCHOR_MAMBAPY_FWD = {2048: 31.5}  # mambapy 1.2.0 parallel scan, forward only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default="bench/results/h200.json")
    parser.add_argument("--out", default="bench/results/h200_seqlen.png")
    args = parser.parse_args()
    results = json.loads(Path(args.results).read_text())
    sweep = {int(k): v for k, v in results["seqlen_sweep_S1"].items() if "error" not in v}
    lengths = sorted(L for L in sweep if L & (L - 1) == 0)  # the odd lengths are not a curve
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, style in (("fwd_ms", "o-"), ("bwd_ms", "s-")):
        ax.plot(lengths, [sweep[L][key] for L in lengths], style,
                label=f"selective-scan Triton {key[:3]}")  # fmt: skip
    for direction, marker in (("fwd", "o"), ("bwd", "s")):
        points = ANCHOR_CUDA[direction]
        ax.plot(list(points), list(points.values()), marker, markerfacecolor="none",
                markersize=10, color="k", label=f"mamba_ssm CUDA {direction} (anchor)")  # fmt: skip
    ax.plot(list(ANCHOR_MAMBAPY_FWD), list(ANCHOR_MAMBAPY_FWD.values()), "^", color="tab:red",
            label="mambapy pscan fwd (pure PyTorch, anchor)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("seqlen (batch 8, dim 1536, dstate 16, bf16, variable B/C)")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"{results['device']}, torch {results['torch']}, triton {results['triton']}, "
                 f"{results['date']}", fontsize=9)  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
