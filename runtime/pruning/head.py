"""The decision head: from one early hidden state, the probability that each attention and MLP block matters.

It reads the residual stream after layer ``read_layer`` at the current token (standardised with statistics of the
calibration data, because a few residual dimensions are orders of magnitude larger than the rest) and returns one
probability per block, in ``ablation.blocks_of`` order. Blocks of layers up to ``read_layer`` always run: they
produce the head's input. A block is skipped when its probability is under the threshold, so the threshold is the
risk a user accepts that a skipped block mattered.

A skipped block's output is not zero but the head's ``substitute`` vector for that block (one per block, measured
as the block's mean output and then tuned with the head): many blocks add a large, nearly constant component to the
residual stream, and leaving it out costs more than the token-dependent rest. A head of format 1 has none (zeros).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Bumped when the file layout changes; a head of another format is not loaded.
HEAD_FORMAT = 2
#: Older formats still read: format 1 has no substitutes (a skipped block adds zero).
READABLE_FORMATS = (1, 2)


def model_fingerprint(config: Any) -> dict[str, Any]:
    """What a head must agree with to be used on a model (architecture and sizes)."""
    config = getattr(config, "get_text_config", lambda: config)()
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
            "intermediate_size": config.intermediate_size}


class DecisionHead(nn.Module):
    """Standardise -> Linear -> GELU -> Linear -> sigmoid: one probability per block (2 per layer), plus what each
    block adds to the residual stream when it is skipped (``substitute`` [2L, hidden])."""

    def __init__(self, hidden_size: int, num_layers: int, read_layer: int, width: int = 256) -> None:
        super().__init__()
        if not 0 <= read_layer < num_layers - 1:
            raise ValueError(f"read_layer must be in [0, {num_layers - 2}], got {read_layer}")
        self.read_layer = read_layer
        self.num_layers = num_layers
        self.register_buffer("mean", torch.zeros(hidden_size))
        self.register_buffer("scale", torch.ones(hidden_size))
        self.hidden = nn.Linear(hidden_size, width)
        self.out = nn.Linear(width, 2 * num_layers)
        self.substitute = nn.Parameter(torch.zeros(2 * num_layers, hidden_size))
        self.meta: dict[str, Any] = {}

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = (h.to(self.mean.dtype) - self.mean) * self.scale
        return self.out(nn.functional.gelu(self.hidden(x)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` [..., hidden] -> P(block matters) [..., 2L]; blocks the head cannot skip read 1."""
        p = torch.sigmoid(self.logits(h))
        always = torch.arange(p.shape[-1], device=p.device) < 2 * (self.read_layer + 1)
        return torch.where(always, torch.ones_like(p), p)  # not in place: tuning backpropagates through it

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- files -----------------------------------------------------------------------------------------------
    def save(self, path: Path, fingerprint: dict[str, Any], meta: dict[str, Any]) -> None:
        """One safetensors file; its metadata holds the fingerprint, the sizes and how the head was made."""
        from safetensors.torch import save_file

        header = {"format": HEAD_FORMAT, "read_layer": self.read_layer, "num_layers": self.num_layers,
                  "width": self.hidden.out_features, "fingerprint": fingerprint, **meta}
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(torch.float16 if v.dtype.is_floating_point else v.dtype).contiguous()
                   for k, v in self.state_dict().items()}
        tensors["mean"] = self.mean.float().contiguous()  # the standardisation keeps full precision
        tensors["scale"] = self.scale.float().contiguous()
        tensors["substitute"] = self.substitute.detach().float().contiguous()  # residual outliers reach 1e3
        save_file(tensors, str(path), metadata={"docfuse": json.dumps(header)})

    @classmethod
    def load(cls, path: Path) -> DecisionHead:
        """Read a head written by ``save``; ValueError naming the problem when the file is not one."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("docfuse", "{}"))
            if header.get("format") not in READABLE_FORMATS:
                raise ValueError(f"{path} is not a docfuse pruning head of format {READABLE_FORMATS} "
                                 f"(found {header.get('format')!r}); re-run docfuse calibrate-pruning")
            state = {k: f.get_tensor(k).float() for k in f.keys()}
        head = cls(state["mean"].numel(), header["num_layers"], header["read_layer"], header["width"])
        state.setdefault("substitute", torch.zeros_like(head.substitute))
        head.load_state_dict(state)
        head.meta = header
        return head.eval()
