"""Training scripts run under torchrun by test_distributed.py: `torchrun ... ddp_run.py MODE OUT`.

Each rank writes what the test checks to OUT/rank<r>.pt (several comma-separated modes: OUT/MODE/rank<r>.pt).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit
from ampkit.util import files as ampkit_files
from oom import plant_oom  # tests/oom.py: this script's folder is on sys.path

B = 8  # per-rank batch


def data(n: int = 160) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x[:, :4].argmax(dim=1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def make_optimizer(m: nn.Module, sgd: bool) -> torch.optim.Optimizer:
    # SGD for the equivalence check: Adam's normalised update turns rounding-level gradient
    # differences into lr-sized steps where a gradient is ~0, hiding what the test measures.
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if sgd else torch.optim.AdamW(m.parameters(), lr=1e-2)


def setup(precision: str, accum: int = 1, shuffle: bool = False, sgd: bool = False):
    acc = ampkit.Accelerator(precision=precision, device="cpu", grad_accum_steps=accum)
    m = model()
    opt = make_optimizer(m, sgd)
    loader = DataLoader(
        data(), batch_size=B, shuffle=shuffle, generator=torch.Generator().manual_seed(3) if shuffle else None
    )
    m, opt, loader = acc.prepare(m, opt, loader)
    return acc, m, opt, loader


def equivalence(out: Path, precision: str) -> dict:
    acc, m, opt, loader = setup(precision, sgd=True)
    for _, (x, y) in zip(range(10), loader):
        acc.backward(F.cross_entropy(m(x), y))
        opt.step()
        opt.zero_grad()
    return {"weights": [p.detach() for p in acc.unwrap(m).parameters()]}


def overflow(out: Path) -> dict:
    acc, m, opt, loader = setup("fp16-mixed")
    scales = []
    for step, (x, y) in zip(range(12), loader):
        acc.backward(F.cross_entropy(m(x), y))
        if acc.rank == 1 and step in (3, 7):
            with torch.no_grad():
                acc.unwrap(m)[0].weight.grad[0, 0] = float("inf")  # after the all-reduce: rank 1 only
        opt.step()
        opt.zero_grad()
        scales.append(acc.state.scale)
    return {
        "scales": scales,
        "skipped": acc.state.skipped_steps,
        "weights": [p.detach() for p in acc.unwrap(m).parameters()],
    }


def accumulation(out: Path) -> dict:
    acc, m, opt, loader = setup("fp32", accum=4)
    calls = []

    def counting_allreduce(state, bucket):
        calls.append(1)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)

    m.register_comm_hook(None, counting_allreduce)
    for x, y in loader:  # 10 batches per rank: 2 full cycles of 4 and a partial one
        acc.backward(F.cross_entropy(m(x), y))
        opt.step()
        opt.zero_grad()
    metrics_seen = []
    acc.track("rank", torch.tensor(float(acc.rank)))
    metrics_seen.append(acc.metrics())
    return {"allreduces": len(calls), "steps": acc.state.applied_steps, "metrics": metrics_seen}


def script_ddp(out: Path) -> dict:
    """A script converted from its own DDP code: a leftover DDP, and its own no-sync micro-steps."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel as DDP

    errors = {}
    _, leftover, _, loader = setup("fp32")  # a model of its own: the two DDPs' hooks stay on its parameters
    x, y = next(iter(loader))
    try:
        DDP(leftover)(x)  # the script's own `model = DDP(model)` after prepare
    except ampkit.StepOrderError as exc:
        errors["nested"] = str(exc)
    try:
        ampkit.Accelerator(precision="fp32", device="cpu").prepare(DDP(model()))
    except ampkit.StepOrderError as exc:
        errors["prewrapped"] = str(exc)
    acc, m, opt, loader = setup("fp32", sgd=True)
    calls = []

    def counting_allreduce(state, bucket):
        calls.append(1)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)

    m.register_comm_hook(None, counting_allreduce)
    batches = iter(loader)
    for step in range(4):  # its own accumulation of 2 micro-steps, grad_accum_steps=1
        for micro in range(2):
            x, y = next(batches)
            if step % 2:  # nanoGPT sets the flag itself
                m.require_backward_grad_sync = micro == 1
                context = nullcontext()
            else:
                context = m.no_sync() if micro == 0 else nullcontext()
            with context:
                acc.backward(F.cross_entropy(m(x), y) / 2)
        opt.step()
        opt.zero_grad()
    return {"errors": errors, "allreduces": len(calls)}


def files(out: Path) -> dict:
    writes = []
    real = ampkit_files.atomic_write

    def logged(path, write):
        writes.append(str(path))
        return real(path, write)

    ampkit_files.atomic_write = logged
    try:
        acc, m, opt, loader = setup("fp32")
        for step, (x, y) in enumerate(loader):
            acc.backward(F.cross_entropy(m(x), y))
            opt.step()
            opt.zero_grad()
            if step % 4 == 3:
                acc.save_checkpoint(out / "ckpts")
                acc.print(f"saved at step {acc.state.applied_steps} by rank {acc.rank}")
    finally:
        ampkit_files.atomic_write = real
    return {"writes": writes}


def resumable(out: Path, epochs: int = 3) -> dict:
    acc, m, opt, loader = setup("fp16-mixed", shuffle=True)
    acc.resume(out / "ckpts")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for _ in acc.epochs(epochs):
        for x, y in loader:
            acc.backward(F.cross_entropy(m(x), y))
            opt.step()
            opt.zero_grad()
            if acc.state.applied_steps % 5 == 0:
                acc.save_checkpoint(out / "ckpts")
            if attempt == 0 and acc.rank == 1 and acc.state.applied_steps == 17 and os.environ.get("AMPKIT_TEST_KILL"):
                os.kill(os.getpid(), signal.SIGKILL)  # a worker dies mid-run
    return {
        "weights": [p.detach() for p in acc.unwrap(m).parameters()],
        "attempt": attempt,
        "steps": acc.state.applied_steps,
        "scale": acc.state.scale,
    }


def full(m: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in m.parameters()]


def sharded(out: Path, stop_after: int | None, precision: str = "fp16-mixed") -> dict:
    """FSDP2 training with the resumable loop shape; stop (as a crash would) after `stop_after` steps."""
    acc = ampkit.Accelerator(precision=precision, device="cpu", strategy="fsdp")
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    loader = DataLoader(data(), batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(3))
    m, opt, loader = acc.prepare(m, opt, loader)
    resumed = acc.resume(out / "ckpts")
    for _ in acc.epochs(3):
        for x, y in loader:
            acc.backward(F.cross_entropy(m(x), y))
            acc.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if stop_after is not None and acc.state.applied_steps == stop_after:
                acc.save_checkpoint(out / "ckpts")
                return {"weights": full(m), "steps": acc.state.applied_steps, "resumed": str(resumed)}
    return {"weights": full(m), "steps": acc.state.applied_steps, "resumed": str(resumed), "scale": acc.state.scale}


def items(out: Path) -> dict:
    """Variable-length accumulation across ranks: rank r takes its share of each cycle's micro-batches."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "amp_page"))
    import variable_length as vl

    acc = ampkit.Accelerator(precision="fp32", device="cpu", grad_accum_steps=vl.ACCUMULATE, divide_loss=True)
    m = vl.TinyLM()
    m, opt = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.5))
    world, rank = acc.world_size, acc.rank
    batches = vl.micro_batches(vl.ACCUMULATE * world * vl.CYCLES)
    for c in range(vl.CYCLES):
        first = (c * world + rank) * vl.ACCUMULATE
        for tokens, labels in batches[first : first + vl.ACCUMULATE]:
            loss = F.cross_entropy(m(tokens).flatten(0, 1), labels.flatten(), ignore_index=vl.IGNORE, reduction="sum")
            acc.backward(loss, num_items=(labels != vl.IGNORE).sum())
            opt.step()
            opt.zero_grad()
    return {"weights": [p.detach() for p in acc.unwrap(m).parameters()]}


def micro(out: Path, inject: bool) -> dict:
    """acc.split under DDP: batches of 16 rows per rank in micro-batches of 8. `inject`: rank 0 runs out of memory
    in batch 0's first backward and rank 1 in batch 2's first forward: every rank
    reruns with the smaller size. Without it the sizes are set by hand where the injected run changes them."""
    acc = ampkit.Accelerator(precision="fp32", device="cpu", micro_batch=8)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m, opt, loader = acc.prepare(m, opt, DataLoader(data(), batch_size=16))
    if inject and acc.rank == 0:
        plant_oom(acc, m, 0, 0, "backward")
    if inject and acc.rank == 1:
        plant_oom(acc, m, 2, 0, "forward")  # batch 2: the first of its 2 micro-batches of 4
    sizes, seen = [], []
    torch.manual_seed(1 + acc.rank)
    for b, (x, y) in zip(range(4), loader):
        if not inject:
            acc.micro.size = 4 if b < 2 else 2
        for mx, my in acc.split((x, y)):
            acc.backward(F.cross_entropy(m(mx), my))
        seen.append(acc.micro_batch_size)
        opt.step()
        opt.zero_grad()
        sizes.append(acc.micro_batch_size)
    return {"weights": [p.detach() for p in acc.unwrap(m).parameters()], "sizes": sizes, "seen": seen}


def main() -> None:
    """`ddp_run.py MODE OUT`, or `MODE,MODE,... OUT`: several modes in one launch (one torchrun start-up for
    them all), each writing OUT/MODE/rank{r}.pt; a mode that fails there records its error for its test."""
    modes, out = sys.argv[1].split(","), Path(sys.argv[2])
    runs = {
        "equiv-fp32": lambda out: equivalence(out, "fp32"),
        "equiv-bf16": lambda out: equivalence(out, "bf16-mixed"),
        "overflow": overflow,
        "accum": accumulation,
        "items": items,
        "micro-oom": lambda out: micro(out, inject=True),
        "micro-small": lambda out: micro(out, inject=False),
        "script-ddp": script_ddp,
        "files": files,
        "resumable": resumable,
        "fsdp-clean": lambda out: sharded(out, None),
        "fsdp-crash": lambda out: sharded(out, 13),
        "fsdp-resume": lambda out: sharded(out, None),
    }
    rank = int(os.environ.get("RANK", "0"))
    if len(modes) == 1:
        torch.save(runs[modes[0]](out), out / f"rank{rank}.pt")
        return
    for mode in modes:
        (out / mode).mkdir(parents=True, exist_ok=True)
        try:
            result = runs[mode](out / mode)
        except Exception:  # noqa: BLE001 - the mode's own test reports it; the other modes still run
            result = {"error": traceback.format_exc()}
        torch.save(result, out / mode / f"rank{rank}.pt")
    torch.save({"modes": modes}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
