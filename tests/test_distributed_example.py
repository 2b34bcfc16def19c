"""The distributed copying example runs under torchrun: 2 CPU processes, gloo, tensor
parallelism x FSDP2, a few steps and a checkpoint that loads into the single-process model."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from distributed_helpers import WORKER_ENV, free_port


def test_copying_distributed_runs_under_torchrun(tmp_path):
    env = {**os.environ, **WORKER_ENV}
    env.pop("TRITON_INTERPRET", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "selective_scan.apps.copying_distributed",
        "--tp", "2", "--steps", "3", "--save", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "step     3  loss" in run.stdout, run.stdout

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from selective_scan.apps.copying_task import SelectiveCopying
    from selective_scan.apps.copying_train import PRESETS, build_model

    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "whole.pt")
    settings = PRESETS["cpu"]
    task = SelectiveCopying(settings.context_len, settings.num_data, settings.num_symbols)
    model = build_model(settings, task.vocab_size, torch.device("cpu"), seed=0)
    model.load_state_dict(torch.load(tmp_path / "whole.pt"), strict=True)
