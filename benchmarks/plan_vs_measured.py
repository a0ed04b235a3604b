"""`ampkit plan`'s peak against what a user measures (issue 35 item 4), per preset. Prints a markdown table.

    PYTHONPATH=src python benchmarks/plan_vs_measured.py [MODEL ...]  # mlp-lm tiny-lm tiny-lm-small digits-cnn iris-mlp
    PYTHONPATH=src python benchmarks/plan_vs_measured.py --fixed [MODEL ...]   # glibc's thresholds fixed
    PYTHONPATH=src python benchmarks/plan_vs_measured.py --runtime       # re-measure plan/runtime.py's constants

Predicted: `ampkit.plan` (fake tensors, no search) -- the live tensors at their peak, the runtime part (torch's
libraries, threads, compiler) and the allocator part (freed heap glibc keeps). Measured: in a fresh process per
preset, `ampkit.tools.plan.resident.steady_peak` -- the resident high-water mark of the 4th step above the process's
pre-model baseline. Models: mlp-lm, an MLP-stack LM of 34 M parameters (Embedding(4096, 1024), 3 x [Linear
1024->4096, GELU, Linear 4096->1024], Linear(1024, 4096)) at batch 512 with AdamW; tiny-lm at the size `ampkit
compare` runs on this CPU, its batch and optimizer; tiny-lm-small. `--runtime` measures the same figure for a
one-layer tiny-lm of a few thousand parameters (width 8): the runtime constants, the tensors being negligible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PRESETS = ("fp32", "bf16-mixed", "bf16-master", "bf16-true")
_MIB = 2**20


class MlpLM(nn.Module):
    def __init__(self, vocab: int = 4096, d: int = 1024, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(layers)]
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)))


def setup(name: str) -> tuple:
    """(model_fn, batch, optimizer_fn, loss_fn) of model `name`."""
    if name == "mlp-lm":
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 4096, (512,), generator=g) for _ in range(2))
        return MlpLM, (x, y), lambda p: torch.optim.AdamW(p, lr=1e-3), lambda out, t: F.cross_entropy(out.float(), t)
    from ampkit.tools.tasks import default_size, get_task, tiny_lm

    if name == "tiny":  # a transformer's kernels (attention, LayerNorm, GELU, AdamW) on a few thousand parameters
        x = torch.randint(0, tiny_lm.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        return (
            lambda: tiny_lm.TinyLM(vocab=tiny_lm.VOCAB, block=16, d_model=8, n_heads=2, n_layers=1),
            (x, x),
            lambda p: torch.optim.AdamW(p, lr=1e-3),
            tiny_lm.loss_fn,
        )

    if name in ("digits-cnn", "iris-mlp"):  # small models, where the runtime part is most of the peak
        task = get_task(name)
    else:
        size = "small" if name == "tiny-lm-small" else default_size("tiny-lm", torch.device("cpu"))
        task = get_task("tiny-lm", size)
    batch = next(iter(task.make_data(0, task.default_batch_size).train_loader))
    return (lambda: task.make_model(0), batch, lambda p: task.make_optimizer(p, task.default_lr), task.loss_fn)


def predicted(name: str, preset: str):
    """ampkit.plan's row for `preset` on model `name` (a PlanRow)."""
    import ampkit

    model_fn, batch, optimizer_fn, loss_fn = setup(name)
    result = ampkit.plan(model_fn, lambda: batch, optimizer_fn, [preset], "cpu", loss_fn=loss_fn, search=False)
    return result.rows[0]


def measured(name: str, preset: str) -> int:
    """The steady step's resident peak above the pre-model baseline, in a fresh process."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, __file__, "--measure", name, preset], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"measuring {name} {preset} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["measured"]


def _child(name: str, preset: str) -> None:
    import warnings

    from ampkit.tools.plan.resident import steady_peak

    model_fn, batch, optimizer_fn, loss_fn = setup(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        print(json.dumps({"measured": steady_peak(model_fn, batch, optimizer_fn, preset, loss_fn=loss_fn)}))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--fixed"]:  # glibc's thresholds fixed: freed blocks go back (the plan's allocator part is 0)
        os.environ["MALLOC_TRIM_THRESHOLD_"] = "131072"
        argv = argv[1:]
    if argv[:1] == ["--measure"]:
        return _child(argv[1], argv[2])
    if argv[:1] == ["--runtime"]:
        print("| preset | tiny model's steady step, RSS above the pre-model baseline | plan's runtime part |")
        print("|---|---:|---:|")
        for preset in PRESETS:
            row = predicted("tiny", preset)
            print(f"| {preset} | {measured('tiny', preset) / _MIB:.0f} MiB | {row.runtime / _MIB:.0f} MiB |")
        return None
    print("| model | preset | tensors | runtime | alloc | predicted | measured | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in argv or ["mlp-lm", "tiny-lm", "tiny-lm-small"]:
        for preset in PRESETS:
            row, real = predicted(name, preset), measured(name, preset)
            parts = (row.peak_bytes, row.runtime, row.allocator, row.resident_bytes, real)
            cells = " | ".join(f"{v / _MIB:.0f} MiB" for v in parts)
            print(f"| {name} | {preset} | {cells} | {(row.resident_bytes - real) / real:+.1%} |", flush=True)
    return None


if __name__ == "__main__":
    main(sys.argv[1:])
