"""The training configurations and the training commands' defaults, in one torch-free place.

Why here: ``docfuse train-fusion`` / ``train-fusion-read`` (fusion/cli.py) and ``python -m docfuse.fusion.run`` (the same
training where only torch, timm, transformers and PyMuPDF are installed) both take their option defaults from these
dataclasses, so the two ways in cannot drift apart again. Nothing here imports torch: the CLI reads these defaults
when it starts, and listing commands must not pay for torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    """The page ViT and fusion trained against the frozen decoder (fusion.train)."""

    steps: int = 1000
    batch_pages: int = 16
    lr: float = 3e-4
    vit_lr: float = 1e-3
    gate_lr: float = 3e-3  # gates start at 0 and would take thousands of steps to open at the base rate
    warmup: int = 100
    mask_rate: float = 0.15
    visible_weight: float = 0.6   # loss weight of tokens that stay visible (keep good text as it was)
    caption_weight: float = 0.5
    aux_weight: float = 0.5       # the auxiliary read loss (see objective_loss)
    #: the gated MLP branch's width; 0 = none. 0, as the shipped checkpoint was trained: on held-out pages the
    #: branch cost recovery (bench/RESULTS.md, "which branch costs what")
    mlp_hidden: int = 0
    #: share of the budget spent in the reading phase first: the ViT and cross-attention learn to name the next
    #: token from the image alone (objective.reading_logits), no decoder, no gate; 0 = straight to the full loss
    read_share: float = 0.0
    read_batch_pages: int = 32
    read_rows: int = 8192         # rows scored per reading step (a random subset of the batch's)
    seed: int = 0
    #: stop after this many seconds of training (the schedule follows time, not steps); None: ``steps`` decide
    time_budget_s: float | None = None


@dataclass
class ReaderTrainConfig:
    """The word reader, trained with CTC on word crops (fusion.read_train.train_reader)."""

    steps: int = 3000
    batch_words: int = 256
    pages_per_step: int = 8
    lr: float = 1e-3
    warmup: int = 200
    jitter: float = 1.0     # grid units of random shift of each box edge (about a pixel)
    seed: int = 0
    time_budget_s: float | None = None


@dataclass
class SteerTrainConfig:
    """The read path's steering map and gate, trained through the frozen decoder (fusion.read_train.train_steer)."""

    steps: int = 1000
    batch_pages: int = 16
    lr: float = 1e-3
    gate_lr: float = 3e-2
    warmup: int = 50
    mask_rate: float = 0.15
    visible_weight: float = 0.2   # visible tokens' loss keeps the read path from disturbing the rest
    read_hidden: int = 2048       # width of the steering map a fresh read path gets (fusion.read_train.with_read_path)
    seed: int = 0
    time_budget_s: float | None = None


@dataclass(frozen=True)
class CorpusDefaults:
    """What the training commands draw or read when the command line names nothing else."""

    synthetic_docs: int = 200       # train: synthetic PDFs (4 pages each) the project draws itself
    read_synthetic_docs: int = 100  # read path: synthetic PDFs for the steering map (and the reader)
    sheets: int = 100               # read path: word sheets (2 pages each) for the word reader
    workers: int = 1                # processes that read and render PDFs
    reader_minutes: float = 10.0    # read path: word reader training time
    steer_minutes: float = 10.0     # read path: steering training time


CORPUS = CorpusDefaults()
TRAIN = TrainConfig()
READER = ReaderTrainConfig()
STEER = SteerTrainConfig()
