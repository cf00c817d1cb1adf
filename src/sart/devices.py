"""``check_device``: a torch device that this install can run on, checked before a model
loads onto it (torch's own error comes after the load, as a traceback)."""

from __future__ import annotations


def check_device(field: str, device: str) -> None:
    """Refuse ``device`` (the value of ``field``) unless torch can place a model there:
    a torch device string, and for CUDA a device this torch build sees."""
    import torch

    from sart.errors import ConfigError

    try:
        placed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{field}={device!r} is not a torch device ({exc})") from None
    if placed.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'}"
        raise ConfigError(
            f"{field}={device!r}: this torch sees no CUDA device ({build}); "
            "run on 'cpu', or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if placed.index is not None and placed.index >= count:
        raise ConfigError(f"{field}={device!r}: this machine has {count} CUDA device(s)")
