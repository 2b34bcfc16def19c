"""Why does loading an AOTInductor package crash on the GPU machine's image?

Builds a package of a trivial model (x.sin() + 1) for CPU and for CUDA, then loads each in a
fresh process and reports how that process ended. With --backtrace, the crashing load runs
under cuda-gdb (the image has no gdb) to print where it died.

    python scripts/aoti_probe.py --out DIR [--backtrace]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch


class SinPlusOne(torch.nn.Module):
    def forward(self, x):
        return x.sin() + 1


def build(device: str, out: Path) -> Path:
    x = torch.randn(8, 16, device=device)
    ep = torch.export.export(SinPlusOne(), (x,))
    return Path(
        torch._inductor.aoti_compile_and_package(ep, package_path=str(out / f"sin_{device}.pt2"))
    )


LOAD = textwrap.dedent("""
    import sys, torch
    m = torch._inductor.aoti_load_package(sys.argv[1])
    x = torch.randn(8, 16, device=sys.argv[2])
    print("max error", (m(x) - (x.sin() + 1)).abs().max().item())
""")


def load_in_fresh_process(path: Path, device: str, backtrace: bool) -> dict:
    cmd = [sys.executable, "-c", LOAD, str(path), device]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    rc = result.returncode
    report = {
        "returncode": rc,
        "signal": signal.Signals(-rc).name if rc < 0 else None,
        "stdout": result.stdout[-2000:],
        "stderr": result.stderr[-3000:],
    }
    gdb = shutil.which("cuda-gdb")
    if rc != 0 and backtrace and gdb:
        script = path.with_suffix(".load.py")
        script.write_text(LOAD)
        bt = subprocess.run(
            [
                gdb,
                "-batch",
                "-ex",
                "run",
                "-ex",
                "bt 30",
                "--args",
                sys.executable,
                str(script),
                str(path),
                device,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        report["cuda_gdb_backtrace"] = bt.stdout[-6000:]
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backtrace", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"torch": torch.__version__}
    for device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        try:
            path = build(device, out)
            report[device] = {"built": str(path)}
            report[device].update(load_in_fresh_process(path, device, args.backtrace))
        except Exception as e:
            report[device] = {"error": repr(e)}
        (out / "aoti_probe.json").write_text(json.dumps(report, indent=1))
    try:
        report["gcc"] = subprocess.run(
            ["gcc", "--version"], capture_output=True, text=True
        ).stdout.split("\n")[0]
    except OSError as e:
        report["gcc"] = repr(e)
    (out / "aoti_probe.json").write_text(json.dumps(report, indent=1))
    print(
        json.dumps(
            {
                k: (v if not isinstance(v, dict) else {kk: str(vv)[:300] for kk, vv in v.items()})
                for k, v in report.items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
