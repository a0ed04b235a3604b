"""The `Finding` record every performance rule returns: what was seen, what to do, and the saving per step.

It sits on its own so that the rule modules (`findings`, `sync_findings`) share one record without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Finding:
    """One thing to change, with what was measured and what it should save per step."""

    id: str
    title: str
    evidence: str
    fix: str
    saved_s: float  # per step on this device (0: costs nothing here)
    saved_on_gpu_s: float | None = None  # per step on the reference GPU, where it differs

    def as_dict(self, step_s: float) -> dict[str, Any]:
        saved = min(self.saved_s, step_s)  # an estimate never saves more than the whole step
        return {
            "id": self.id,
            "title": self.title,
            "evidence": self.evidence,
            "fix": self.fix,
            "saved_s": saved,
            "saved_share": saved / step_s if step_s > 0 else 0.0,
            "saved_on_gpu_s": self.saved_on_gpu_s,
        }
