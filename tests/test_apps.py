"""What the apps share: the --device argument."""

import pytest
import torch

from selective_scan.apps import device_from


def test_device_defaults_to_what_is_present():
    assert device_from(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert device_from("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_cuda_without_a_gpu_exits_with_one_line():
    with pytest.raises(SystemExit) as exit_:
        device_from("cuda")
    message = str(exit_.value.code)
    assert message.startswith("--device cuda: no CUDA GPU is available") and "\n" not in message
