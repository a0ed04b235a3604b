"""What `free_step_buffers` costs and saves: the figure behind its default.

    OMP_NUM_THREADS=1 python benchmarks/step_buffers.py [--write]

The full-size fp32 step buffers (the `-master` presets' gradients, every step since their one-shot
update; bf16-true's clipped gradients) are freed between steps or kept. For each preset,
on the GEMM-bound MLP of the Peers section (1024 -> 4096 -> 1024, batch 64, AdamW), clipped with
`acc.clip_grad_norm_(1.0)` every step (fp16-master: loss-scaled, no clipping):

* time: both settings in one process, interleaved rounds, warm-up dropped; the median of the
  per-round ratios keep/free;
* memory: each setting in a fresh process; peak resident memory over 8 steps and resident memory
  between steps, minus the memory before the model was built.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampkit  # noqa: E402
from _timing import interleaved, machine, paired_ratio, write_section  # noqa: E402
from ampkit.tools.compare.memory import proc_status  # noqa: E402

PRESETS = ("bf16-true", "bf16-master", "fp16-master")
D, H, B = 1024, 4096, 64


def loop(preset: str, free: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    acc = ampkit.Accelerator(preset, device="cpu", free_step_buffers=free)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, D, generator=g), torch.randint(0, D, (B,), generator=g)
    clip = not acc.policy.loss_scaling

    def step() -> None:
        acc.backward(F.cross_entropy(model(x), y))
        if clip:
            acc.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    return step


def child(preset: str, free: bool) -> dict[str, float]:
    before = proc_status("VmRSS") or 0
    step = loop(preset, free)
    for _ in range(8):
        step()
    return {
        "peak_mib": ((proc_status("VmHWM") or 0) - before) / 2**20,
        "rest_mib": ((proc_status("VmRSS") or 0) - before) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="put the table into benchmarks/notes/step_buffers.md")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1] == "free")))
        return
    torch.set_num_threads(1)
    rows = []
    for preset in PRESETS:
        times = interleaved({"free": loop(preset, True), "keep": loop(preset, False)}, rounds=8, steps=3, warmup=2)
        mem = {
            s: json.loads(
                subprocess.run(
                    [sys.executable, __file__, "--child", preset, s], check=True, capture_output=True, text=True
                ).stdout
            )
            for s in ("free", "keep")
        }
        med = {s: sorted(ts)[len(ts) // 2] * 1e3 for s, ts in times.items()}
        rows.append(
            f"| {preset} | {med['free']:.1f} | {med['keep']:.1f} | {paired_ratio(times['keep'], times['free']):.3f}× "
            f"| {mem['free']['peak_mib']:.0f} | {mem['keep']['peak_mib']:.0f} "
            f"| {mem['free']['rest_mib']:.0f} | {mem['keep']['rest_mib']:.0f} | "
            f"{'free' if ampkit.Accelerator(preset, device='cpu').free_step_buffers else 'keep'} |"
        )
    lines = [
        "### `free_step_buffers`: freeing the full-size step buffers or keeping them (`benchmarks/step_buffers.py`)",
        "",
        f"`OMP_NUM_THREADS=1 python benchmarks/step_buffers.py --write` — {datetime.date.today()}; {machine()}",
        "",
        f"MLP {D}→{H}→{D}, batch {B}, AdamW; clipped every step (fp16-master: loss-scaled). Time: interleaved in one "
        "process, 8 rounds of 3 steps, 2 warm-up rounds dropped, medians; memory: one process per setting, 8 steps.",
        "",
        "| preset | ms/step, free | ms/step, keep | keep / free | peak MiB, free | peak MiB, keep "
        "| between steps MiB, free | between steps MiB, keep | default on a CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
    ]
    print("\n".join(lines))
    if args.write:
        write_section(
            Path(__file__).parent / "notes" / "step_buffers.md",
            "<!-- step-buffers:start -->",
            "<!-- step-buffers:end -->",
            lines,
        )


if __name__ == "__main__":
    main()
