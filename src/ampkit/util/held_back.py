"""`held_back()`: other libraries' warnings and log records kept out of a command's output during a block.

An export imports torchao, onnx and onnxruntime, which announce themselves on stderr (a `.so` that did not
load, a deprecation, advice on pre-processing): twenty lines that say nothing about the user's model. Inside
the block they are counted instead, and `Held.summary()` says in one line how many came from where; `-v`
(`show=True`) lets them through as before. ampkit's own warnings and records are never held: they are
passed on when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_AMPKIT_DIR = str(Path(__file__).resolve().parents[1])


@dataclass
class Held:
    """What a `held_back()` block kept out: log records and warnings by source."""

    sources: Counter[str] = field(default_factory=Counter)

    def summary(self, flag: str = "-v") -> str | None:
        """ "held back 9 messages from other libraries (torch.onnx 8, FutureWarning 1); -v shows them"; None
        where there were none."""
        total = sum(self.sources.values())
        if not total:
            return None
        parts = ", ".join(f"{name} {n}" for name, n in self.sources.most_common())
        return f"held back {total} message{'s' if total != 1 else ''} from other libraries ({parts}); {flag} shows them"


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not self.records or self.records[-1] is not record:  # one record, seen again as it propagates
            self.records.append(record)


def _ours(name: str) -> bool:
    return name == "ampkit" or name.startswith("ampkit.")


def _source(logger_name: str) -> str:
    """The library a logger belongs to, to two levels ("torch.onnx", "torchao", "root")."""
    return ".".join(logger_name.split(".")[:2]) if logger_name.startswith("torch.") else logger_name.split(".")[0]


@contextlib.contextmanager
def held_back(show: bool = False) -> Iterator[Held]:
    """Hold back other libraries' warnings and log records (WARNING and up) while the block runs; `show`:
    hold nothing back. The loggers' handlers are as they were afterwards."""
    held = Held()
    if show:
        yield held
        return
    capture = _Capture()
    loggers = [logging.root] + [
        lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger) and lg.handlers
    ]
    saved = [(lg, lg.handlers) for lg in loggers]
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught_here:
            warnings.simplefilter("default")
            for lg in loggers:
                lg.handlers = [capture]  # a library's own handler (torch's) and the root's alike
            try:
                yield held
            finally:
                for lg, handlers in saved:
                    lg.handlers = handlers
                caught = list(caught_here)
    finally:  # ampkit's own warnings and records pass on, also when the block raised
        _pass_on(caught, capture.records, held)


def _pass_on(caught: list[warnings.WarningMessage], records: list[logging.LogRecord], held: Held) -> None:
    """Re-emit ampkit's own warnings and records; count the others' into `held`."""
    for w in caught:
        if w.filename.startswith(_AMPKIT_DIR) or type(w.message).__module__.startswith("ampkit"):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            held.sources[w.category.__name__] += 1
    for record in records:
        if _ours(record.name):
            logging.getLogger(record.name).handle(record)
        else:
            held.sources[_source(record.name)] += 1
