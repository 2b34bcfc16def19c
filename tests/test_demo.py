"""The demo (`python -m selective_scan.apps.demo`) end to end at a tiny size.

Every mode runs, including an AOTInductor compile (tens of seconds on a 2-core CPU).
"""

from selective_scan.apps import demo


def test_demo_passes_and_writes_files(tmp_path, capsys, monkeypatch):
    # The PyTorch ops on CPU tensors, whatever TRITON_INTERPRET the test session set.
    monkeypatch.setenv("SELECTIVE_SCAN_BACKEND", "torch")
    out_dir = tmp_path / "artifacts"
    argv = ["--device", "cpu", "--batch", "2", "--dim", "16", "--dstate", "4", "--seqlen", "40"]
    status = demo.main([*argv, "--out", str(out_dir), "--repeats", "1"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    for mode in ("eager", "eager fwd+bwd", "torch.compile", "torch.export", "AOTInductor"):
        assert f"\n{mode} " in printed, printed
    assert "all checks passed" in printed
    assert (out_dir / "scan_exported.pt2").stat().st_size > 0
    assert (out_dir / "scan_aoti.pt2").stat().st_size > 0


def test_demo_exits_nonzero_when_an_error_exceeds_its_bound(capsys):
    rows = [demo.Row("eager", 0.0, 1.0, 1e-7, 1e-5), demo.Row("AOTInductor", 9.0, 1.0, 3e-4, 1e-5)]
    assert "NO" in demo.format_table(rows)
    assert demo.exit_status(rows) == 1
    assert "AOTInductor" in capsys.readouterr().err
    assert demo.exit_status(rows[:1]) == 0
