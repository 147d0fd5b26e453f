"""Error feedback for quantized pushes: what a push's quantization left out is owed, and added
to the same unit's next push of that fragment.

    sent    = delta + owed            (what this push should carry)
    applied = dequantize(quantize(sent))   (what the syncer merges)
    owed    = sent - applied          (after the syncer accepted it)

Without it a lossy scheme drops its error every round; with it the error is only delayed by one
period, so over a run the syncer receives the learner's whole update. A push the syncer refuses
changes nothing owed: its whole delta is lost like any dropped push, and the global parameters
the learner installs next already disagree with it. The debt lives in the learner's memory, so a
restarted attempt starts with none (as it starts with fresh inner optimizer moments).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

Tensors = Mapping[str, np.ndarray]


class PushFeedback:
    """Per fragment, the error still owed by this unit's quantized pushes."""

    def __init__(self) -> None:
        self._owed: dict[int, dict[str, np.ndarray]] = {}

    def compensated(self, fragment: int, delta: Tensors) -> dict[str, np.ndarray]:
        """`delta` plus what earlier pushes of `fragment` owe: the values to quantize."""
        owed = self._owed.get(fragment, {})
        return {
            name: np.asarray(value, dtype=np.float32) + owed[name]
            if name in owed
            else np.asarray(value, dtype=np.float32)
            for name, value in delta.items()
        }

    def settle(self, fragment: int, sent: Tensors, applied: Tensors) -> None:
        """Record a push the syncer accepted: it owes what `applied` lacks of `sent`."""
        self._owed[fragment] = {
            name: np.asarray(sent[name], dtype=np.float32) - applied[name] for name in sent
        }

    def owed_norm(self, fragment: int) -> float:
        """L2 norm of what `fragment` still owes (0 before its first accepted push)."""
        owed = self._owed.get(fragment, {})
        return float(
            np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in owed.values()))
        )


def push_feedback(scheme: str, enabled: bool) -> PushFeedback | None:
    """A unit's error feedback, where it is asked for and the scheme loses something."""
    return PushFeedback() if enabled and scheme != "none" else None
