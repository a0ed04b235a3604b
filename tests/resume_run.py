"""A small training run with the resumable loop shape, used by the checkpoint tests.

`main(argv)` (or the file run as a script) trains in a fresh process and writes its per-micro-step losses and
final weights to --out, so a test can compare a resumed run with an uninterrupted one bit for bit.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ampkit

EPOCHS = 3
LOADERS = (
    "generator",
    "plain",
    "iterable",
)  # shuffle=True with its own generator / without one (what most scripts write) / a stream


class Stream(IterableDataset):
    """Samples in a fixed order, with no length: what a streaming dataset looks like to a DataLoader."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


def make_loader(kind: str = "generator", workers: int = 0, drop_last: bool = False, n: int = 96) -> DataLoader:
    """`n` samples of 8 features in batches of 8 (12 batches per epoch for n=96)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :4].argmax(dim=1)
    extra = {"num_workers": workers, "drop_last": drop_last}
    if kind == "iterable":
        return DataLoader(Stream(x, y), batch_size=8, **extra)
    if kind == "plain":
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, **extra)
    assert kind == "generator", kind
    return DataLoader(
        TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2), **extra
    )


def build(
    precision: str, accum: int, loader: str = "generator", workers: int = 0, drop_last: bool = False, n: int = 96
):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    loader = make_loader(loader, workers, drop_last, n)
    acc = ampkit.Accelerator(precision=precision, device="cpu", grad_accum_steps=accum)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched


def train(
    precision: str,
    accum: int = 1,
    ckpt: str | None = None,
    stop_after: int | None = None,
    inject_at: int | None = None,
    every: int | None = None,
    log: str | None = None,
    sleep: float = 0.0,
    epochs: int = EPOCHS,
    loader: str = "generator",
    workers: int = 0,
    drop_last: bool = False,
    n: int = 96,
    stop_after_epoch: int | None = None,
):
    """Train `epochs` epochs; return (micro-step losses, final weights, accelerator).

    stop_after: save a checkpoint after that many micro-steps (of this process) and stop, as a crash would.
    stop_after_epoch: save a checkpoint after that epoch's loop has ended (outside it) and stop.
    every: save a checkpoint every that many micro-steps. inject_at: put an inf in the gradients at
    that global micro-step (counted across a resume). log: append each loss to this file as it happens
    ("<micro-step> <loss>"), and "save <n>" / "saved <n>" around each periodic save.
    loader, workers, drop_last, n: the DataLoader (see `make_loader`).
    """
    acc, model, opt, loader, sched = build(precision, accum, loader, workers, drop_last, n)
    if ckpt is not None:
        acc.resume(ckpt)
    micro = opt.attempted_steps * accum + acc.cycle.position % accum  # micro-steps already trained (resumed runs)
    losses: list[float] = []
    for epoch in acc.epochs(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            if inject_at is not None and micro == inject_at:
                with torch.no_grad():
                    model[0].weight.grad[0, 0] = float("inf")
            opt.step()
            sched.step()
            opt.zero_grad()
            micro += 1
            losses.append(loss.item())
            if log is not None:
                _note(log, f"{micro - 1} {loss.item()!r}")
            if every is not None and micro % every == 0:
                _note(log, f"save {micro}")
                acc.save_checkpoint(ckpt)
                _note(log, f"saved {micro}")
            if stop_after is not None and len(losses) == stop_after:
                acc.save_checkpoint(ckpt)
                return losses, [p.detach().clone() for p in model.parameters()], acc
            time.sleep(sleep)
        if stop_after_epoch is not None and epoch == stop_after_epoch:
            acc.save_checkpoint(ckpt)
            return losses, [p.detach().clone() for p in model.parameters()], acc
    return losses, [p.detach().clone() for p in model.parameters()], acc


def _note(log: str | None, line: str) -> None:
    if log is not None:
        with open(log, "a") as f:
            f.write(line + "\n")


def resume_in_fresh_process(tmp_path: Path, precision: str, accum: int, ckpt: Path, **extra) -> dict:
    """Resume from `ckpt` in a new process forked from a clean interpreter that has only imported torch and
    ampkit (`_fresh`): nothing of the test's process (its RNG, ampkit's state, the model) carries over, and the
    imports are not paid again; its losses, weights and counters.

    `extra` become command-line options (`drop_last=1` -> `--drop-last 1`)."""
    out = Path(tmp_path) / "resumed.pt"
    argv = ["--precision", precision, "--accum", str(accum), "--ckpt", str(ckpt), "--out", str(out)]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    proc = _fresh().Process(target=main, args=(argv,))  # not a daemon: its DataLoader may start workers
    proc.start()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        raise TimeoutError(f"the resumed run ({' '.join(argv)}) took more than 120 s")
    if proc.exitcode != 0:
        raise RuntimeError(f"the resumed run ({' '.join(argv)}) exited with code {proc.exitcode}: see its traceback")
    return torch.load(out, weights_only=True)


def _fresh() -> Any:
    """A forkserver context: each process forks from one clean interpreter that imported torch and ampkit."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch._dynamo", "resume_run"])  # torch._dynamo: imported by the first optimizer
    return ctx


def start_fresh(**kwargs) -> multiprocessing.Process:
    """Start `train(**kwargs)` in a new process forked from the clean interpreter of `_fresh`: as fresh as a
    subprocess, without paying for the imports each time. For the processes a test kills."""
    proc = _fresh().Process(target=train, kwargs=kwargs, daemon=True)
    proc.start()
    return proc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--precision", default="fp32")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out")
    p.add_argument("--every", type=int)
    p.add_argument("--log")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--inject-at", type=int)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--loader", choices=LOADERS, default="generator")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--drop-last", type=int, default=0)
    p.add_argument("--n", type=int, default=96)
    a = p.parse_args(argv)
    losses, weights, acc = train(
        a.precision,
        a.accum,
        a.ckpt,
        every=a.every,
        log=a.log,
        sleep=a.sleep,
        inject_at=a.inject_at,
        epochs=a.epochs,
        loader=a.loader,
        workers=a.workers,
        drop_last=bool(a.drop_last),
        n=a.n,
    )
    if a.out:
        torch.save(
            {
                "losses": losses,
                "weights": weights,
                "scale": acc.state.scale,
                "skipped": acc.state.skipped_steps,
                "applied": acc.state.applied_steps,
            },
            a.out,
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
