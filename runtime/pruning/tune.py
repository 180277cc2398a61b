"""Tune a decision head on what its joint decisions cost: straight-through masks, a KL loss and a skip budget.

Ablation labels (``ablation.window_labels``) price one block skipped alone, with everything else dense. In decode,
the head skips several blocks of a token together and their costs compound, so a head trained on single-block
labels either skips little or loses agreement. Tuning starts from such a head and runs the pruned model
teacher-forced (``Pruner`` in ``tune`` mode): every position takes the head's hard decisions in the forward pass,
and the gradient of KL(dense || pruned) reaches the head's probabilities through the keep flags (straight-through)
and the skipped blocks' substitute vectors directly. A Lagrange multiplier on the mean keep probability holds the
realised skip rate near ``target_skip`` at the head's threshold.

The gradient of a hard mask is an estimate, so nothing here is taken on trust: ``calibrate`` scores every tuned head
by real hard skipping on validation windows (``calibrate.fidelity``), the same check as for label-trained heads.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from docfuse.runtime.pruning.gates import AttentionGate, MLPGate, Pruner, decoder_layers
from docfuse.runtime.pruning.head import DecisionHead


@torch.no_grad()
def measure_substitutes(model: Any, pruner: Pruner, windows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each skippable block's mean output over ``windows`` (dense): [2L, hidden] float32, zeros for the blocks
    that always run (those feeding the head; an earlier pruner's gates may still wrap some of them)."""
    layers = decoder_layers(model)
    sums = torch.zeros(pruner.num_blocks, model.config.hidden_size)
    count = 0
    hooks = []
    for layer in layers:
        for gate in (layer.self_attn, layer.mlp):
            if isinstance(gate, (AttentionGate, MLPGate)) and gate.index >= pruner._always:
                def hook(_m, _i, out, index=gate.index):
                    sums[index] += (out[0] if isinstance(out, tuple) else out).float().sum((0, 1)).cpu()
                hooks.append(gate.inner.register_forward_hook(hook))
    mode, pruner.mode = pruner.mode, "off"
    try:
        device = next(model.parameters()).device
        for ids in windows:
            model(input_ids=ids.to(device).unsqueeze(0))
            count += len(ids)
    finally:
        pruner.mode = mode
        for h in hooks:
            h.remove()
    return sums / max(count, 1)


def tune_head(model: Any, head: DecisionHead, windows: Sequence[torch.Tensor], *, threshold: float = 0.15,
              target_skip: float = 0.25, steps: int = 200, batch: int = 4, lr: float = 1e-3,
              multiplier_lr: float = 0.3, dense_prefix: int = 64, seed: int = 0,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Tune ``head`` in place on ``windows`` (token windows of equal length); returns the per-step log.

    ``target_skip`` is the share of all blocks (the always-run ones included) to skip at ``threshold``.
    The substitutes start from the blocks' mean outputs (``measure_substitutes``) unless the head already has some.
    """
    if not 0.0 < target_skip < 1.0:
        raise ValueError(f"target_skip is a share of blocks in (0, 1), got {target_skip}")
    if len({len(w) for w in windows}) != 1 or len(windows[0]) <= dense_prefix:
        raise ValueError(f"tuning needs windows of one length, longer than dense_prefix={dense_prefix}")
    pruner = Pruner.for_model(model, head, threshold, exact=True)
    if not head.substitute.detach().any():
        head.substitute.data.copy_(measure_substitutes(model, pruner, windows).to(head.substitute.device))
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    device = next(model.parameters()).device
    optimiser = torch.optim.AdamW([p for p in head.parameters()], lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    multiplier, history = 0.0, []
    head.train()
    try:
        for step in range(1, steps + 1):
            ids = torch.stack(rng.sample(list(windows), min(batch, len(windows)))).to(device)
            with torch.no_grad():
                pruner.mode = "off"
                dense = F.log_softmax(model(input_ids=ids).logits[:, dense_prefix:].float(), -1)
            pruner.mode, pruner.threshold, pruner.dense_prefix = "tune", threshold, dense_prefix
            pruned = F.log_softmax(model(input_ids=ids).logits[:, dense_prefix:].float(), -1)
            kl = (dense.exp() * (dense - pruned)).sum(-1).mean()
            keep_p = pruner.tune_probs[:, dense_prefix:, pruner._always:]
            skipped = float((~pruner.mask_keep[:, dense_prefix:]).float().mean())
            loss = kl + multiplier * keep_p.mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            multiplier = max(0.0, multiplier + multiplier_lr * (target_skip - skipped))
            agree = float((dense.argmax(-1) == pruned.argmax(-1)).float().mean())
            history.append({"step": step, "kl": round(float(kl.detach()), 4), "top1": round(agree, 4),
                            "skipped": round(skipped, 4), "multiplier": round(multiplier, 4)})
            if step % max(steps // 10, 1) == 0 or step == 1:
                log(f"tune step {step}/{steps}: KL {float(kl.detach()):.4f}, top-1 {agree:.3f}, skipped {skipped:.1%}, "
                    f"multiplier {multiplier:.3f}")
    finally:
        pruner.mode = "off"
        pruner._clear()
        head.eval()
        for p in frozen:
            p.requires_grad_(True)
    return history
