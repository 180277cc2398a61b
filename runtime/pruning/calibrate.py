"""Calibrate a decision head for a model: ablation labels, training, threshold sweep (``docfuse calibrate-pruning``).

1. ``collect``: windows of the calibration text; per token, the KL and top-1 flip of skipping each block alone at
   that decode step (``ablation.window_labels``), plus the head's input features. Each window is saved on its own
   in a work folder, so an interrupted run resumes.
2. ``train_head``: a block "matters" at a token when skipping it alone costs more than ``label_kl`` nats or flips
   the top-1 token; the head learns that probability (binary cross-entropy, windows held out for validation).
3. ``tune`` (optional, ``tune_steps > 0``): the chosen head is tuned end to end for each skip target
   (``runtime.pruning.tune``: straight-through masks on its own joint decisions) and each tuned head is scored on the
   validation windows by real hard skipping, beside the label-trained candidates.
4. ``sweep``: for each threshold, the pruned model is run teacher-forced over held-out windows with every
   position deciding its own skips (``gates.Pruner`` mask mode, equivalent to decoding step by step with a dense
   prefix), against the dense model: top-1 agreement, KL and the skip rate.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from docfuse.runtime.pruning.ablation import kl_and_flip, window_labels
from docfuse.runtime.pruning.gates import Pruner
from docfuse.runtime.pruning.head import DecisionHead, model_fingerprint

#: Tokens per calibration window, and the first positions of each window left out of the labels (too little history
#: to stand for a decode step).
WINDOW_TOKENS = 512
MIN_HISTORY = 64
#: Layers whose output is saved with the labels: the read layers a head may be trained on.
FEATURE_LAYERS = (1, 2, 3, 4, 5, 6)


def text_windows(tokenizer: Any, text: str, windows: int, tokens: int = WINDOW_TOKENS) -> list[torch.Tensor]:
    """``windows`` token windows spread evenly over ``text``; ValueError when the text is too short for one."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if len(ids) < tokens:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than one {tokens}-token window; "
                         "give a longer --corpus (e.g. python -m docfuse.runtime.pruning.calibration_text > calib.txt)")
    count = min(windows, len(ids) // tokens)
    stride = (len(ids) - tokens) // max(count - 1, 1)
    return [ids[i * stride: i * stride + tokens] for i in range(count)]


def collect(model: Any, windows: Sequence[torch.Tensor], work_dir: Path,
            read_layers: Sequence[int] = FEATURE_LAYERS, log: Callable[[str], None] = print) -> list[Path]:
    """Label every window (skipping those already in ``work_dir`` for the same tokens); returns the files."""
    work_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for n, ids in enumerate(windows):
        digest = hashlib.sha1(ids.numpy().tobytes() + repr(sorted(read_layers)).encode()).hexdigest()[:12]
        path = work_dir / f"window-{n:03d}-{digest}.pt"
        files.append(path)
        if path.exists():
            continue
        started = time.perf_counter()
        labels = window_labels(model, ids.to(next(model.parameters()).device), list(read_layers))
        labels = {k: v[MIN_HISTORY:] for k, v in labels.items()}
        labels["ids"] = ids
        torch.save(labels, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        log(f"window {n + 1}/{len(windows)}: labelled in {time.perf_counter() - started:.0f} s")
    return files


def load_windows(files: Sequence[Path]) -> list[dict[str, torch.Tensor]]:
    return [torch.load(f) for f in files]


def summary(files: Sequence[Path]) -> dict[str, Any]:
    """Share of (token, block) pairs under a few KL levels: how much a perfect single-block oracle could skip."""
    kl = torch.cat([torch.load(f)["kl"] for f in files])
    return {f"share_below_{x}": float((kl < x).float().mean()) for x in (0.001, 0.005, 0.01, 0.02, 0.05, 0.1)}


def labels_of(window: dict[str, torch.Tensor], label_kl: float) -> torch.Tensor:
    """1 where skipping the block alone at that token costs more than ``label_kl`` nats or flips the top-1."""
    return ((window["kl"] > label_kl) | window["flip"]).float()


def train_head(train: Sequence[dict[str, torch.Tensor]], read_layer: int, label_kl: float, *, width: int = 256,
               epochs: int = 40, seed: int = 0) -> DecisionHead:
    """Fit a head on labelled windows (binary cross-entropy on the blocks it may skip), deterministically."""
    torch.manual_seed(seed)
    x = torch.cat([w[f"features_{read_layer}"] for w in train])
    y = torch.cat([labels_of(w, label_kl) for w in train])
    first = 2 * (read_layer + 1)  # blocks before this always run
    head = DecisionHead(x.shape[1], y.shape[1] // 2, read_layer, width)
    head.mean.copy_(x.mean(0))
    head.scale.copy_(1 / (x.std(0) + 1e-3))
    optimiser = torch.optim.AdamW(head.parameters(), lr=2e-3, weight_decay=0.05)
    steps = epochs * ((len(x) + 255) // 256)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=2e-3, total_steps=steps)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    head.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(x)).split(256):
            loss = loss_fn(head.logits(x[batch])[:, first:], y[batch, first:])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
    return head.eval()


@torch.no_grad()
def fidelity(model: Any, pruner: Pruner, windows: Sequence[torch.Tensor], threshold: float,
             dense_prefix: int = MIN_HISTORY) -> dict[str, Any]:
    """Teacher-forced pruned vs dense over ``windows``: top-1 agreement, mean KL, skip rate (overall, per block).

    Positions before ``dense_prefix`` run dense (they stand for the prefilled document); every later position
    decides its own skips from the head, as in step-by-step decoding.
    """
    agree = kl_sum = count = 0.0
    skipped = torch.zeros(pruner.num_blocks)
    device = next(model.parameters()).device
    for ids in windows:
        ids = ids.to(device).unsqueeze(0)
        pruner.mode = "off"
        dense = torch.log_softmax(model(input_ids=ids).logits[0, dense_prefix:].float(), -1)
        pruner.mode, pruner.threshold, pruner.dense_prefix = "mask", threshold, dense_prefix
        try:
            pruned = torch.log_softmax(model(input_ids=ids).logits[0, dense_prefix:].float(), -1)
            keep = pruner.mask_keep[0, dense_prefix:].cpu()
        finally:
            pruner.mode = "off"
        kl, flip = kl_and_flip(dense, pruned)
        agree += float((~flip).sum())
        kl_sum += float(kl.sum())
        count += len(dense)
        skipped += (~keep).float().sum(0)
    return {"threshold": threshold, "top1_agreement": agree / count, "kl": kl_sum / count,
            "skipped_fraction": float(skipped.sum() / (count * pruner.num_blocks)),
            "skipped_per_block": (skipped / count).tolist(), "positions": int(count)}


def calibrate(model: Any, tokenizer: Any, text: str, work_dir: Path, *, windows: int = 32, label: int | None = None,
              read_layers: Sequence[int] = (1, 2, 3), label_kls: Sequence[float] = (0.005, 0.01, 0.02, 0.05),
              thresholds: Sequence[float] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5), default_threshold: float = 0.15,
              target_top1: float = 0.95, tune_steps: int = 0, skip_targets: Sequence[float] = (0.15, 0.2, 0.25),
              tune_batch: int = 8, init_head: DecisionHead | None = None,
              log: Callable[[str], None] = print) -> tuple[DecisionHead, dict[str, Any]]:
    """Label, train one head per (read layer, label level), keep the best at the default threshold, sweep it.

    With ``tune_steps``, the best label-trained head is also tuned end to end once per ``skip_targets`` entry on the
    training windows (``runtime.pruning.tune``); the tuned heads compete with the label-trained ones by the same rule.
    ``init_head``: skip labelling and training; tune this head (made earlier for the model) instead.

    The best head skips the most blocks at ``default_threshold`` while keeping ``target_top1`` teacher-forced top-1
    agreement on the validation windows (a quarter of the windows, never trained on); when none keeps it, the one
    that agrees most. Returns the head and a report (every candidate, the sweep, the label statistics).
    ``label``: use only the first ``label`` of the ``windows`` spread over the text (a time budget).
    """
    token_windows = text_windows(tokenizer, text, windows)[:label]
    if len(token_windows) < 4:
        raise ValueError(f"calibration needs at least 4 windows of {WINDOW_TOKENS} tokens, the text gives "
                         f"{len(token_windows)}; give a longer --corpus")
    if not set(read_layers) <= set(FEATURE_LAYERS):
        raise ValueError(f"read layers must be among {FEATURE_LAYERS}, got {tuple(read_layers)}")
    n_val = max(1, len(token_windows) // 4)
    val_ids = token_windows[-n_val:]
    candidates = []
    best: tuple[DecisionHead, dict[str, Any]] | None = None
    files: list[Path] = []
    if init_head is not None:  # tune a head made earlier: no labels needed
        train_ids = token_windows[:-n_val]
        pruner = Pruner.for_model(model, init_head, default_threshold)
        row = {"read_layer": init_head.read_layer, "label_kl": init_head.meta.get("chosen", {}).get("label_kl"),
               "initial_head": True, **{k: v for k, v in fidelity(model, pruner, val_ids, default_threshold, MIN_HISTORY).items()
                                        if k != "skipped_per_block"}}
        candidates.append(row)
        log(f"initial head: top-1 {row['top1_agreement']:.3f}, KL {row['kl']:.4f}, "
            f"skipped {row['skipped_fraction']:.1%}")
        best = init_head, row
    else:
        files = collect(model, token_windows, work_dir, log=log)
        labelled = load_windows(files)
        train = labelled[:-n_val]
        train_ids = [w["ids"] for w in train]
        for read_layer in read_layers:
            for label_kl in label_kls:
                head = train_head(train, read_layer, label_kl)
                pruner = Pruner.for_model(model, head, default_threshold)
                row = {"read_layer": read_layer, "label_kl": label_kl,
                       **{k: v for k, v in fidelity(model, pruner, val_ids, default_threshold, MIN_HISTORY).items()
                          if k != "skipped_per_block"}}
                candidates.append(row)
                log(f"read layer {read_layer}, label KL {label_kl}: top-1 {row['top1_agreement']:.3f}, "
                    f"KL {row['kl']:.4f}, skipped {row['skipped_fraction']:.1%}")
                if best is None or _better(row, best[1], target_top1):
                    best = head, row
    tuned_log: dict[str, Any] = {}
    if tune_steps > 0:
        import copy

        from docfuse.runtime.pruning.tune import tune_head

        base, base_row = best
        for target in skip_targets:
            head = copy.deepcopy(base)
            tuned_log[str(target)] = tune_head(model, head, train_ids, threshold=default_threshold,
                                               target_skip=target, steps=tune_steps, batch=tune_batch,
                                               dense_prefix=MIN_HISTORY, log=log)
            pruner = Pruner.for_model(model, head, default_threshold)
            row = {"read_layer": base_row["read_layer"], "label_kl": base_row["label_kl"], "tuned_for_skip": target,
                   **{k: v for k, v in fidelity(model, pruner, val_ids, default_threshold, MIN_HISTORY).items()
                      if k != "skipped_per_block"}}
            candidates.append(row)
            log(f"tuned for {target:.0%} skipped: top-1 {row['top1_agreement']:.3f}, KL {row['kl']:.4f}, "
                f"skipped {row['skipped_fraction']:.1%}")
            if _better(row, best[1], target_top1):
                best = head, row
    head, chosen = best
    pruner = Pruner.for_model(model, head, default_threshold)
    sweep = [fidelity(model, pruner, val_ids, t, MIN_HISTORY) for t in thresholds]
    report = {"fingerprint": model_fingerprint(model.config), "windows": len(token_windows), "spread_over": windows,
              "train_windows": len(train_ids), "validation_windows": len(val_ids), "window_tokens": WINDOW_TOKENS,
              "min_history": MIN_HISTORY, "label_statistics": summary(files) if files else None,
              "initial_head": init_head.meta.get("command") if init_head is not None else None,
              "candidates": candidates,
              "chosen": {"read_layer": chosen["read_layer"], "label_kl": chosen["label_kl"],
                         "tuned_for_skip": chosen.get("tuned_for_skip")},
              "tuning": {"steps": tune_steps, "batch": tune_batch, "log": tuned_log} if tune_steps else None,
              "default_threshold": default_threshold, "sweep": sweep,
              "head_parameters": head.parameter_count(),
              "model_parameters": sum(p.numel() for p in model.parameters())}
    return head, report


#: Top-1 agreements closer than this are a tie (about one standard error over 12 validation windows).
AGREEMENT_TIE = 0.005


def _better(row: dict[str, Any], best: dict[str, Any], target: float) -> bool:
    """Meeting the agreement target first; then more skipped. Below the target, more agreement, except that
    within ``AGREEMENT_TIE`` of the best agreement the head that skips more wins."""
    ok, best_ok = row["top1_agreement"] >= target, best["top1_agreement"] >= target
    if ok != best_ok:
        return ok
    if ok:
        return row["skipped_fraction"] > best["skipped_fraction"]
    if abs(row["top1_agreement"] - best["top1_agreement"]) <= AGREEMENT_TIE:
        return row["skipped_fraction"] > best["skipped_fraction"]
    return row["top1_agreement"] > best["top1_agreement"]


if __name__ == "__main__":  # label collection alone: python -m docfuse.runtime.pruning.calibrate TEXT WORK_DIR WINDOWS
    import sys

    from docfuse.runtime.loading import load_model

    model, tokenizer = load_model("default")
    text = Path(sys.argv[1]).read_text()
    files = collect(model, text_windows(tokenizer, text, int(sys.argv[3])), Path(sys.argv[2]))
    print(json.dumps(summary(files), indent=1))
