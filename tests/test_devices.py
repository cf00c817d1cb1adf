"""``sart.devices.check_device``: a device torch cannot use is refused before a model loads."""

from __future__ import annotations

import pytest

from sart.devices import check_device
from sart.errors import ConfigError

torch = pytest.importorskip("torch")


def test_the_cpu_and_a_cpu_index_are_taken() -> None:
    check_device("device", "cpu")
    check_device("device", "cpu:0")


def test_a_name_that_is_no_torch_device_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^prm_device='gpu' is not a torch device \("):
        check_device("prm_device", "gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_torch_without_it_says_so_before_loading(device: str) -> None:
    # Before: a 17-frame traceback after the model had loaded ("Torch not compiled
    # with CUDA enabled").
    with pytest.raises(ConfigError) as info:
        check_device("device", device)
    message = str(info.value)
    assert message.startswith(f"device={device!r}: this torch sees no CUDA device (torch ")
    assert "run on 'cpu', or install a CUDA build of torch" in message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_past_the_last_device_is_refused() -> None:
    count = torch.cuda.device_count()
    check_device("device", f"cuda:{count - 1}")
    with pytest.raises(ConfigError, match=f"has {count} CUDA device"):
        check_device("device", f"cuda:{count}")
