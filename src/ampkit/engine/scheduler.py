"""The wrapped LR scheduler: it advances once per *applied* optimizer step, without a sync. Where a step's
outcome has not reached the host yet it advances optimistically and, if the step was skipped, skips its
next advance: on a GPU it can run one step ahead between an overflow and the host learning of it.
"""

from __future__ import annotations

from typing import Any

from ampkit.engine.optim import AmpOptimizer


class AmpScheduler:
    """The scheduler `Accelerator.prepare` returns; attribute access goes to the wrapped scheduler."""

    def __init__(self, scheduler: Any, optimizer: AmpOptimizer, per_step: bool) -> None:
        self.scheduler, self._optimizer, self._per_step = scheduler, optimizer, per_step
        self._seen_attempts = 0
        self._optimistic: set[int] = set()  # step indices advanced for before their outcome landed
        self._owed = 0  # advances taken for steps that turned out skipped
        optimizer.watch_outcomes(self._on_outcome)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance if an optimizer step was applied since the last call (always, if not per-step)."""
        if not self._per_step:
            self.scheduler.step(*args, **kwargs)
            return
        opt = self._optimizer
        if opt.attempted_steps == self._seen_attempts:
            return  # no optimizer step since the last call: a non-boundary micro-step
        self._seen_attempts = opt.attempted_steps
        opt.reconcile()
        applied = opt.latest_outcome()
        if applied is False:
            return
        if self._owed:
            self._owed -= 1
            return
        if applied is None:
            self._optimistic.add(opt.attempted_steps)
        self.scheduler.step(*args, **kwargs)

    def _on_outcome(self, index: int, skipped: bool) -> None:
        """Called by the optimizer when the outcome of step `index` lands on the host."""
        if index in self._optimistic:
            self._optimistic.discard(index)
            if skipped:
                self._owed += 1

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state_dict plus ampkit's bookkeeping under "ampkit"."""
        state = dict(self.scheduler.state_dict())
        state["ampkit"] = {"scheduler": type(self.scheduler).__name__, "seen": self._seen_attempts, "owed": self._owed}
        return state

    def check_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Every reason `state` cannot be loaded here (empty: it fits). Changes nothing."""
        if not isinstance(state, dict):
            return ["it is not a scheduler state_dict"]
        amp = state.get("ampkit")
        if amp is not None and amp.get("scheduler") != type(self.scheduler).__name__:
            return [
                f"it was saved from a {amp.get('scheduler')} scheduler, this one is a {type(self.scheduler).__name__}"
            ]
        return []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict from `state_dict()` (or a plain torch scheduler's)."""
        amp = state_dict.get("ampkit")
        self.scheduler.load_state_dict({k: v for k, v in state_dict.items() if k != "ampkit"})
        if amp is not None:
            self._seen_attempts, self._owed = int(amp["seen"]), int(amp["owed"])
            self._optimistic.clear()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AmpScheduler({self.scheduler.__class__.__name__})"
