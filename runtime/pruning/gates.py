"""Gates on a model's attention and MLP blocks, and the per-step decision that opens or closes them.

``Pruner(model, head)`` wraps the attention and MLP modules of every layer after the head's ``read_layer`` and
hooks the output of that layer. What the gates do depends on the mode:

- ``off`` (prefill, safe mode, threshold 0): every gate calls its block unchanged, so the output is the dense model's.
- ``decode``: on a one-token forward the hook runs the head once and turns its probabilities into a Python list of
  keep flags (the step's only host sync); a closed MLP gate returns the head's substitute vector for that block
  (zeros for a format-1 head, so the residual passes through). A closed attention gate still computes the token's
  K and V and writes them to the cache, skipping only the query, the attention over the cache and the output
  projection, and returns its substitute. Later tokens therefore find a full cache, just as if the block had run:
  the choice costs two small projections and keeps every cache (full, tiered, SnapKV) consistent.
- ``mask`` (calibration and benchmarks): on a teacher-forced forward the head decides for every position at once
  and each gate mixes its block's output and its substitute by that position's keep flag. Each position's residual
  stream, and so the K/V it writes, is what step-by-step pruned decoding would give it: one forward measures a
  whole window.
- ``tune`` (``runtime.pruning.tune``): ``mask`` with gradients. The keep flags are the hard decisions in the forward
  pass and the head's probabilities in the backward pass (straight-through), so the head learns from what its own
  joint decisions cost the output, not from one block skipped at a time.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from docfuse.runtime.llama_block import rope
from docfuse.runtime.pruning.head import DecisionHead

Mode = Literal["off", "decode", "mask", "tune"]


def store_kv(attn: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
             cache: Any) -> None:
    """Write the K/V that ``attn`` would write for ``hidden``, without attending (a skipped attention block)."""
    b, t, _ = hidden.shape
    k = attn.k_proj(hidden).view(b, t, -1, attn.head_dim)
    if hasattr(attn, "k_norm"):
        k = attn.k_norm(k)
    k = k.transpose(1, 2)
    v = attn.v_proj(hidden).view(b, t, -1, attn.head_dim).transpose(1, 2)
    cos, sin = (x.unsqueeze(1) for x in position_embeddings)
    k = rope(k, cos, sin)
    if hasattr(cache, "store"):  # TieredCache: append without expanding the association tier for a read
        cache.store(k, v, attn.layer_idx)
    else:
        cache.update(k, v, attn.layer_idx)


class _Gate(nn.Module):
    def __init__(self, inner: nn.Module, pruner: Pruner, index: int) -> None:
        super().__init__()
        self.inner = inner
        self.index = index
        self.__dict__["pruner"] = pruner  # not a submodule: the pruner owns the model, not the other way round


class AttentionGate(_Gate):
    """Runs, masks, or skips one attention block (a skipped one still writes its K/V)."""

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        keep = self.pruner.keep_flag(self.index)
        if keep is None or keep is True:
            return self.inner(*args, **kwargs)
        if isinstance(keep, torch.Tensor):
            out, weights = self.inner(*args, **kwargs)
            return self.pruner.mix(self.index, out, keep), weights
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            store_kv(self.inner, hidden, kwargs["position_embeddings"], cache)
        return self.pruner.substitute(self.index, hidden), None


class MLPGate(_Gate):
    """Runs, masks, or skips one MLP block."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        keep = self.pruner.keep_flag(self.index)
        if keep is None or keep is True:
            return self.inner(hidden)
        if isinstance(keep, torch.Tensor):
            return self.pruner.mix(self.index, self.inner(hidden), keep)
        return self.pruner.substitute(self.index, hidden)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(x, "self_attn") and hasattr(x, "mlp") for x in layers):
        raise ValueError(f"{type(model).__name__} is not a Llama-family decoder (model.layers[i].self_attn and .mlp); "
                         "runtime pruning supports those only: run it with pruning: null")
    return layers


def _same_head(a: DecisionHead, b: DecisionHead) -> bool:
    if not a.meta or a.meta != b.meta or a.read_layer != b.read_layer:
        return False
    other = b.state_dict()
    return all(torch.equal(v, other[k].to(v.device, v.dtype)) for k, v in a.state_dict().items())


class Pruner:
    """The gates of one model and the decision head that drives them; see the module docstring for the modes."""

    def __init__(self, model: nn.Module, head: DecisionHead, threshold: float = 0.15) -> None:
        layers = decoder_layers(model)
        if head.num_layers != len(layers):
            raise ValueError(f"the head was calibrated for {head.num_layers} layers, the model has {len(layers)}")
        param = next(model.parameters())
        self.head = head.to(param.device, torch.float32)  # a few hundred kFLOPs a step: full precision is free
        self.threshold = threshold
        self.mode: Mode = "off"
        self.num_blocks = 2 * len(layers)
        self._always = 2 * (head.read_layer + 1)  # blocks up to the read layer make the head's input: always run
        self._keep: list[bool] | None = None
        self._mask: torch.Tensor | None = None
        self.dense_prefix = 0
        self.reset_counts()
        for i, layer in enumerate(layers):
            if isinstance(layer.self_attn, AttentionGate):  # a later pruner on the same model takes the gates over
                layer.self_attn.__dict__["pruner"] = layer.mlp.__dict__["pruner"] = self
            elif i > head.read_layer:
                layer.self_attn = AttentionGate(layer.self_attn, self, 2 * i)
                layer.mlp = MLPGate(layer.mlp, self, 2 * i + 1)
        self._hooks = [layers[0].register_forward_pre_hook(self._clear),
                       layers[head.read_layer].register_forward_hook(self._decide)]

    @classmethod
    def for_model(cls, model: nn.Module, head: DecisionHead, threshold: float = 0.15, *,
                  exact: bool = False) -> Pruner:
        """The model's pruner for ``head``: reused when it already drives this head object, or an equal one (the same
        file loaded again: same metadata and weights), else a new one (the old one's hooks removed, its gates taken
        over). A tuned copy of a head keeps the metadata but not the weights, so it gets a pruner of its own.
        ``exact``: reuse only a pruner that drives this very object (tuning changes the object it is given)."""
        old = model.__dict__.get("_docfuse_pruner")
        if old is not None and (old.head is head or (not exact and _same_head(old.head, head))):
            old.threshold = threshold
            return old
        if old is not None:
            old.detach()
        model.__dict__["_docfuse_pruner"] = pruner = cls(model, head, threshold)
        return pruner

    def detach(self) -> None:
        """Remove this pruner's hooks (its gates stay, passing through, until another pruner takes them)."""
        self.mode = "off"
        self._clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def reset_counts(self) -> None:
        """Start counting decode steps and skipped blocks afresh (one question)."""
        self.steps = 0
        self.skipped = 0
        self.skipped_per_block = [0] * self.num_blocks

    @property
    def skipped_fraction(self) -> float:
        """Skipped blocks over all blocks of the decode steps counted since ``reset_counts``."""
        return self.skipped / (self.steps * self.num_blocks) if self.steps else 0.0

    def substitute(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """What skipped block ``index`` adds to the residual stream, shaped like ``like``."""
        return self.head.substitute[index].to(like.dtype).expand_as(like)

    def mix(self, index: int, out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``out`` where ``keep`` is 1, the block's substitute where it is 0 (mask and tune modes)."""
        return out * keep + self.head.substitute[index].to(out.dtype) * (1 - keep)

    def keep_flag(self, index: int) -> bool | torch.Tensor | None:
        if self._keep is not None:
            return self._keep[index]
        if self._mask is not None:
            return self._mask[..., index: index + 1]
        return None

    def _clear(self, *_: Any) -> None:
        self._keep = None
        self._mask = None

    def _decide(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        if self.mode == "off":
            return
        h = output[0] if isinstance(output, tuple) else output
        if self.mode == "tune":
            p = self.head(h)
            forced = torch.zeros_like(p, dtype=torch.bool)
            forced[..., : self._always] = True
            forced[:, : self.dense_prefix] = True
            hard = (p >= self.threshold) | forced
            straight_through = hard.float() + p - p.detach()  # forward: the hard flags; backward: d/dp
            self.tune_probs, self.mask_keep = p, hard
            self._mask = torch.where(forced, torch.ones_like(p), straight_through).to(h.dtype)
            return
        with torch.no_grad():
            if self.mode == "decode":
                if h.shape[1] != 1:
                    return  # prefill of a question's suffix stays dense
                keep = (self.head(h[:, -1]) >= self.threshold)[0].tolist()  # the step's one host sync
                keep[: self._always] = [True] * self._always
                self._keep = keep
                self.steps += 1
                for j, flag in enumerate(keep):
                    if not flag:
                        self.skipped += 1
                        self.skipped_per_block[j] += 1
            else:
                keep = self.head(h) >= self.threshold
                keep[..., : self._always] = True
                keep[:, : self.dense_prefix] = True
                self._mask = keep.to(h.dtype)
                self.mask_keep = keep
