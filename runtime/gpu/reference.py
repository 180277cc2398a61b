"""Float32 reference of decode attention over the tiers: what the Triton kernel must compute, on any device.

It dequantises the association tier (that is what the kernel avoids), so it is the oracle and the CPU path, not the
fast path.
"""

from __future__ import annotations

import torch

from docfuse.runtime.kv.association import AssociationStore


def tiered_decode_reference(q: torch.Tensor, core_k: torch.Tensor, core_v: torch.Tensor, n_core: int,
                            assoc: AssociationStore | None, scale: float) -> torch.Tensor:
    """Attention of one query token per head over ``[association, core[:n_core]]`` in float32.

    Args:
        q: ``[B, Hq, D]`` queries (post-RoPE); ``Hq`` a multiple of the KV heads (GQA).
        core_k, core_v: ``[B, Hkv, >=n_core, D]`` exact core tier.
        assoc: the packed association tier, or ``None``.
    Returns: ``[B, Hq, D]`` float32.
    """
    keys, values = core_k[:, :, :n_core].float(), core_v[:, :, :n_core].float()
    if assoc is not None and assoc.length:
        ak, av = assoc.dequantize(torch.float32)
        keys, values = torch.cat([ak, keys], dim=2), torch.cat([av, values], dim=2)
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), keys) * scale
    return torch.einsum("bht,bhtd->bhd", scores.softmax(dim=-1), values)
