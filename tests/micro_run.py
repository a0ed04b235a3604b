"""Fresh-process runs for tests/test_micro_batch.py: `python micro_run.py budget PRECISION OUT` and
`python micro_run.py resume PRECISION CKPT OUT [--kill-after N]`.

budget: an MLP trained on batches 8x larger than fit `memory=` (micro_batch="auto"; how many fit is a 4th argument,
else asked of `python micro_run.py fits PRECISION`, a process of its own); writes the peak resident memory of a
steady step above the pre-model baseline, the budget, the chosen micro-batch and the weights, then the same steps
unsplit (no budget) for the weights to compare.
resume: a prepared loader's batches split into micro-batches (an out-of-memory error injected in the first batch
halves the size), a checkpoint after every step; `--kill-after N` SIGKILLs the process after the N-th.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit
from ampkit.tools.plan.resident import high_water, resident_now
from oom import plant_oom  # tests/oom.py: this script's folder is on sys.path

BUDGET = 300 * 2**20
STEPS = 2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))


def train(
    precision: str, micro: str | None, rows: int, memory: int | None, base: int
) -> tuple[ampkit.Accelerator, list, int]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    acc = ampkit.Accelerator(precision=precision, device="cpu", micro_batch=micro, memory=memory)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    peak = 0
    for _ in range(STEPS):
        x, y = torch.randn(rows, 64, generator=g), torch.randint(0, 10, (rows,), generator=g)
        high_water(reset=True)
        for mx, my in acc.split((x, y)):
            acc.backward(F.cross_entropy(model(mx), my))
        opt.step()
        opt.zero_grad()
        peak = high_water() - base  # the last step's: a steady one
        del x, y
    return acc, [p.detach().clone() for p in model.parameters()], peak


def fits(precision: str) -> int:
    """The largest micro-batch of `BUDGET` by the plan (in a process of its own: the planner's kept heap and modules
    would otherwise stand in the measured process's resident set, which a user's run never holds twice)."""
    from ampkit.tools.plan.fit import largest_micro_batch

    probe = ampkit.Accelerator(precision=precision, device="cpu")
    model = probe.prepare(mlp())
    probe.prepare(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    one = torch.randn(32768, 64), torch.randint(0, 10, (32768,))
    return largest_micro_batch(probe, one, BUDGET)[0]


def budget(precision: str, out: Path, fit: int | None = None) -> None:
    """`fit`: the plan's largest micro-batch, where the caller has it (else asked of `fits` in a new process)."""
    if fit is None:
        done = subprocess.run([sys.executable, __file__, "fits", precision], capture_output=True, text=True, check=True)
        fit = int(done.stdout)
    rows = 8 * fit
    base = resident_now()  # before any model: the baseline ampkit plan's figures are judged against
    acc, split, peak = train(precision, "auto", rows, BUDGET, base)
    _, whole, _ = train(precision, None, rows, None, base)
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(split, whole))
    report = {"peak": peak, "budget": BUDGET, "rows": rows, "size": acc.micro_batch_size, "relative_diff": diff}
    out.write_text(json.dumps(report))


def resume(precision: str, ckpt: Path, out: Path, kill_after: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x[:, :4].argmax(dim=1)), batch_size=16, shuffle=True, generator=g)
    acc = ampkit.Accelerator(precision=precision, device="cpu", micro_batch=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    if acc.resume(ckpt) is None:
        plant_oom(acc, model, 0, 1, "backward")  # batch 0 halves the micro-batch to 4: the state must keep it
    done = acc.state.applied_steps
    for _ in acc.epochs(2):
        for xb, yb in loader:
            for mx, my in acc.split((xb, yb)):
                acc.backward(F.cross_entropy(model(mx), my))
            opt.step()
            opt.zero_grad()
            done += 1
            acc.save_checkpoint(ckpt, keep=2)
            if kill_after is not None and done == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    weights = [p.detach().clone() for p in model.parameters()]
    torch.save({"weights": weights, "size": acc.micro_batch_size}, out)


if __name__ == "__main__":
    mode, precision = sys.argv[1], sys.argv[2]
    if mode == "budget":
        budget(precision, Path(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
    elif mode == "fits":
        print(fits(precision))
    else:
        kill = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[5] == "--kill-after" else None
        resume(precision, Path(sys.argv[3]), Path(sys.argv[4]), kill)
