"""The selective-copying main job (`python -m selective_scan.apps.copying`): its data, its pieces,
and one end-to-end run at a tiny size (a few training steps, an AOTInductor build: about a
minute on a 2-core CPU)."""

import importlib.util
import io

import pytest
import torch

from selective_scan.apps import copying, copying_train
from selective_scan.apps.copying_task import BLANK, FIRST_SYMBOL, MARKER, SelectiveCopying, as_text
from selective_scan.apps.progress import ProgressBar
from selective_scan.models import MambaLMHeadModel

TASK = SelectiveCopying(context_len=20, num_data=5, num_symbols=6)


def sample(seed: int, batch: int = 64, task: SelectiveCopying = TASK) -> torch.Tensor:
    return task.sample(batch, torch.Generator().manual_seed(seed))


def test_rows_have_the_task_layout():
    rows = sample(seed=0)
    assert rows.shape == (64, 20 + 1 + 5) == (64, TASK.seqlen)
    assert rows.dtype == torch.int64
    assert (rows[:, 20] == MARKER).all()
    context, answer = rows[:, :20], TASK.answer(rows)
    assert ((context == BLANK) | (context >= FIRST_SYMBOL)).all()
    assert ((answer >= FIRST_SYMBOL) & (answer < TASK.vocab_size)).all()
    assert torch.equal(TASK.prompt(rows), rows[:, :21])


def test_answer_is_the_data_tokens_in_order():
    rows = sample(seed=1)
    for row in rows:
        context = row[: TASK.context_len]
        data = context[context != BLANK]
        assert len(data) == TASK.num_data
        assert torch.equal(data, TASK.answer(row[None])[0])


def test_positions_and_symbols_vary():
    rows = sample(seed=2, batch=256)
    positions = (rows[:, : TASK.context_len] != BLANK).float().mean(0)
    assert (positions > 0).all(), "every context position should hold data in some row"
    assert set(TASK.answer(rows).unique().tolist()) == set(range(FIRST_SYMBOL, TASK.vocab_size))


def test_sampling_is_deterministic_per_seed():
    assert torch.equal(sample(seed=3), sample(seed=3))
    assert not torch.equal(sample(seed=3), sample(seed=4))


def test_data_can_fill_the_whole_context():
    task = SelectiveCopying(context_len=4, num_data=4, num_symbols=3)
    rows = sample(seed=5, task=task)
    assert torch.equal(rows[:, :4], task.answer(rows))


@pytest.mark.parametrize(("num_data", "num_symbols"), [(0, 4), (21, 4), (3, 0)])
def test_bad_sizes_are_refused(num_data, num_symbols):
    with pytest.raises(ValueError, match="SelectiveCopying"):
        SelectiveCopying(context_len=20, num_data=num_data, num_symbols=num_symbols)


def one_hot_logits(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return 10.0 * torch.nn.functional.one_hot(tokens, vocab).float()


def test_loss_and_accuracy_read_the_answer_positions():
    rows = sample(seed=6, batch=8)
    # Logits that predict each next token of the row exactly, as a perfect model's would.
    perfect = one_hot_logits(rows[:, 1:], TASK.vocab_size)
    loss, accuracy = TASK.loss_and_accuracy(perfect, rows)
    assert accuracy.item() == 1.0
    assert loss.item() < 1e-3
    # One position late: the answer logits then hold the marker and the wrong symbols.
    late = one_hot_logits(rows[:, :-1], TASK.vocab_size)
    assert TASK.loss_and_accuracy(late, rows)[1].item() < 0.5


def test_as_text():
    assert as_text(torch.tensor([BLANK, FIRST_SYMBOL + 2, BLANK, MARKER, FIRST_SYMBOL])) == ".C.|A"
    assert as_text(torch.tensor([FIRST_SYMBOL + 30, FIRST_SYMBOL])) == "32 2"


@torch.no_grad()
def test_greedy_answers_with_the_full_forward_match_generate():
    torch.manual_seed(0)
    model = MambaLMHeadModel(16, 1, TASK.vocab_size, ssm_cfg={"d_state": 4}).eval()
    prompt = TASK.prompt(sample(seed=7, batch=3))
    generated = model.generate(prompt, TASK.num_data)[:, prompt.shape[1] :]
    assert torch.equal(copying.greedy_answers(model, prompt, TASK.num_data), generated)


def test_learning_rate_warms_up_holds_then_decays():
    factor = copying_train.warmup_stable_decay(steps=100)
    assert [factor(i) for i in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(factor(i) == 1.0 for i in range(5, 71))
    assert all(factor(i) > factor(i + 1) for i in range(70, 99))
    assert 0 < factor(99) < 0.01


def test_flags_override_the_preset():
    args = copying.parse_args(["--steps", "7", "--d-model", "32"])
    settings = copying.settings_from(args, torch.device("cpu"))
    expected = copying_train.PRESETS["cpu"]
    assert (settings.steps, settings.d_model) == (7, 32)
    assert (settings.context_len, settings.lr) == (expected.context_len, expected.lr)


def test_too_short_a_context_is_refused():
    with pytest.raises(SystemExit):
        copying.parse_args(["--seqlen", str(copying.MIN_EXPORT_SEQLEN - 2)])


def test_progress_bar_writes_a_line_per_tenth_off_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(50, stream)
    for step in range(1, 51):
        if bar.due(step):
            bar.update(step, loss=1.0 / step)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[-1].startswith("50/50 [########################] loss 0.0200")


def row(mode: str, max_diff: float, accuracy: float, ok: bool) -> copying.Row:
    return copying.Row(mode, 1.0, 1.0, 1.0, max_diff, accuracy, ok)


def test_failures_name_each_failed_check():
    answers = {"expected": torch.tensor([[2, 3]]), "generate": torch.tensor([[2, 3]])}
    good = [row("eager", 0.0, 0.99, True), row("AOTInductor", 1e-6, 0.99, True)]
    assert copying.find_failures(good, answers, min_accuracy=0.95) == []
    assert "accuracy" in copying.find_failures(good, answers, min_accuracy=0.999)[0]
    off = [good[0], row("AOTInductor", 0.5, 0.99, False)]
    assert "AOTInductor" in copying.find_failures(off, answers, min_accuracy=0.95)[0]
    disagreeing = answers | {"torch.export": torch.tensor([[2, 4]])}
    assert "greedy" in copying.find_failures(good, disagreeing, min_accuracy=0.95)[0]


def test_a_failed_check_exits_nonzero(capsys):
    assert copying.exit_status(["AOTInductor differs from eager"]) == 1
    assert "FAILED: AOTInductor differs" in capsys.readouterr().err
    assert copying.exit_status([]) == 0


TINY = [
    "--device", "cpu", "--seqlen", "15", "--num-data", "2", "--symbols", "3", "--d-model", "16",
    "--layers", "1", "--d-state", "4", "--steps", "3", "--batch", "4", "--eval-batch", "6",
    "--examples", "2", "--repeats", "1", "--min-accuracy", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run of the main job at a tiny size: (exit status, stdout, output folder)."""
    out_dir = tmp_path_factory.mktemp("copying")
    stdout = io.StringIO()
    # The PyTorch ops on CPU tensors, whatever TRITON_INTERPRET the test session set.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELECTIVE_SCAN_BACKEND", "torch")
        mp.setattr("sys.stdout", stdout)
        status = copying.main([*TINY, "--out", str(out_dir)])
    return status, stdout.getvalue(), out_dir


def test_tiny_run_passes_and_reports_every_mode(tiny_run):
    status, printed, _ = tiny_run
    assert status == 0, printed
    modes = ["eager", "torch.compile", "torch.export", "AOTInductor"]
    if importlib.util.find_spec("onnxruntime") and importlib.util.find_spec("onnxscript"):
        modes.append("ONNX Runtime")
    for mode in modes:
        assert f"\n{mode} " in printed, printed
    assert "NO" not in printed
    assert "all checks passed" in printed


def test_tiny_run_artifacts_match_the_trained_weights(tiny_run):
    """The saved files, loaded here as a user would, against the saved weights run eagerly on
    rows the job never saw (another batch size and length than the export example)."""
    _, _, out_dir = tiny_run
    task = SelectiveCopying(context_len=15, num_data=2, num_symbols=3)
    model = MambaLMHeadModel(16, 1, task.vocab_size, ssm_cfg={"d_state": 4})
    model.load_state_dict(torch.load(out_dir / "copying_weights.pt"))
    model.eval()
    ids = TASK.sample(3, torch.Generator().manual_seed(8))[:, :-1].clamp(max=task.vocab_size - 1)
    exported = torch.export.load(out_dir / "copying_exported.pt2").module()
    package = torch._inductor.aoti_load_package(str(out_dir / "copying_aoti.pt2"))
    with torch.no_grad():
        expected = model(ids)
        torch.testing.assert_close(exported(ids), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(package(ids), expected, rtol=0, atol=1e-5)
    if (out_dir / "copying.onnx").exists():
        import onnxruntime

        session = onnxruntime.InferenceSession(str(out_dir / "copying.onnx"))
        logits = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]
        torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=0, atol=1e-5)
