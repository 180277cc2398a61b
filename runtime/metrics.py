"""Per-request measurements: clocks that wait for the device, KV-cache bytes, peak memory."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch


def sync(device: torch.device | str) -> None:
    """Wait for queued device work so a clock reading covers it (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | str) -> float:
    """``time.perf_counter`` after the device has finished its queued work."""
    sync(device)
    return time.perf_counter()


def kv_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors a cache holds (the logical size of each tensor, views included)."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def full_kv_bytes(config: Any, tokens: int, dtype: torch.dtype) -> int:
    """What a plain DynamicCache holds for ``tokens`` tokens: layers x 2 (K, V) x KV heads x head_dim x dtype size."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * heads * head_dim * itemsize * tokens


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak-memory window on CUDA; the CPU figure is a process-lifetime peak and cannot be reset."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device | str) -> int:
    """CUDA: ``torch.cuda.max_memory_allocated`` since the last reset (tensors only).

    CPU: the process's peak resident set size from ``getrusage`` (everything the process ever held, the model and
    the Python runtime included, since the process started).
    """
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux KiB
