"""When an answer is finished, besides its end-of-sequence token: stop strings and a repetition stop.

The embedded model often answers, then writes a new ``Question:`` turn of its own, or repeats a phrase until the token
limit. Both are caught after each token, on the host, the same way for ``Session`` and the batched engine:

* **stop strings** (a new ``Question:``/``User:`` turn, the chat template's start tag): the answer ends where one
  begins;
* **repetition**: when the last ``repeat_tokens`` tokens already appeared, in the same order, earlier in the answer,
  the answer ends before the repeat.

Neither changes a token before the stop (greedy decoding stays what it was), so an answer is a prefix of the one
decoded without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: A new turn the model writes for itself after its answer.
DEFAULT_STOP_STRINGS = ("\nQuestion:", "\nUser:", "\nQ:", "<|im_start|>", "\nuser\n")
#: Tokens of the window a stop string is looked for in (the longest stop string takes fewer).
WINDOW_TOKENS = 16


class StopConfig(BaseModel):
    """The decode stage's ``stop:`` block."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strings: list[str] = Field(default_factory=lambda: list(DEFAULT_STOP_STRINGS),
                               description="the answer ends where one of these begins")
    repeat_tokens: int | None = Field(12, ge=2, description="end the answer when its last N tokens already "
                                                            "appeared in order earlier in it; null: never")


@dataclass
class Stopper:
    """Checks an answer's tokens as they come, for one tokenizer."""

    config: StopConfig
    tokenizer: Any

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def should_stop(self, tokens: Sequence[int]) -> bool:
        """Whether the answer is finished after its newest token."""
        return self._repeat_start(tokens) is not None or self._has_stop_string(tokens[-WINDOW_TOKENS:])

    def _has_stop_string(self, tokens: Sequence[int]) -> bool:
        if not self.config.strings or not tokens:
            return False
        text = self._decode(tokens)
        return any(s in text for s in self.config.strings)

    def _repeat_start(self, tokens: Sequence[int]) -> int | None:
        """Where the repeated tail starts, when the last ``repeat_tokens`` tokens occurred earlier."""
        n = self.config.repeat_tokens
        if n is None or len(tokens) < n + 1:
            return None
        tail = list(tokens[-n:])
        first = tail[0]
        for i in range(len(tokens) - n):
            if tokens[i] == first and list(tokens[i: i + n]) == tail:
                return len(tokens) - n
        return None

    def text(self, tokens: Sequence[int]) -> str:
        """The user-facing answer: without a repeated tail, cut where the first stop string begins, special tokens
        dropped."""
        kept = list(tokens)
        cut = self._repeat_start(kept)
        if cut is not None:
            kept = kept[:cut]
        raw = self._decode(kept)
        at = min((raw.find(s) for s in self.config.strings if s in raw), default=len(raw))
        raw = raw[:at]
        for special in getattr(self.tokenizer, "all_special_tokens", ()):
            raw = raw.replace(special, "")
        return raw.strip()
