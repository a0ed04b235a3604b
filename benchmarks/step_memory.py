"""Peak memory of one training step, per precision preset, one process per preset.

    PYTHONPATH=src python benchmarks/step_memory.py                 # print the table
    PYTHONPATH=src python benchmarks/step_memory.py --write         # and put it in RESULTS.md (3 runs each)

The model is a 50M-parameter stack (embedding 4096 x 2048, 8 x [LayerNorm, Linear 2048 x 2048,
GELU], head 2048 -> 4096), trained with AdamW on batches of 512 tokens. Each preset runs in a fresh
process: its resident memory is read before the model is built, three steps run (the optimizer's
state exists from the first), the kernel's high-water mark is reset (/proc/self/clear_refs), and
one more step (backward, optimizer step, zero_grad) runs. The figure is that step's peak resident
memory minus the memory before the model. Beside it, the bytes per parameter held at rest: weights,
optimizer state and ampkit's own buffers (fp32 masters, Kahan buffers) after zero_grad, and the
same with the gradients a backward leaves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _timing import machine, write_section  # noqa: E402

from ampkit.compare.memory import proc_status, reset_peak_rss  # noqa: E402  # the /proc readings ampkit compare uses

PRESETS = ("fp32", "bf16-mixed", "bf16-master", "bf16-true")
VOCAB, WIDTH, LAYERS, BATCH = 4096, 2048, 8, 512


def model() -> nn.Module:
    layers: list[nn.Module] = [nn.Embedding(VOCAB, WIDTH)]
    for _ in range(LAYERS):
        layers += [nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, VOCAB))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def child(preset: str) -> dict[str, float]:
    import ampkit

    torch.manual_seed(0)
    x, y = torch.randint(0, VOCAB, (BATCH,)), torch.randint(0, VOCAB, (BATCH,))
    before = proc_status("VmRSS") or 0
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    acc = ampkit.Accelerator(preset, device="cpu")
    net, opt = acc.prepare(net, opt)

    def step() -> None:
        acc.backward(nn.functional.cross_entropy(net(x), y))
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    reset_peak_rss()
    step()
    peak = proc_status("VmHWM") or 0
    n = sum(p.numel() for p in net.parameters())
    weights = tensor_bytes(net.parameters())
    state = tensor_bytes(v for s in opt.state.values() for k, v in s.items() if k != "step")
    store = tensor_bytes(opt.weights.state_dict()["values"]) if opt.weights is not None else 0
    acc.backward(nn.functional.cross_entropy(net(x), y))
    grads = tensor_bytes(p.grad for p in net.parameters())
    return {"params": n, "peak_mib": (peak - before) / 2**20, "rest_bpp": (weights + state + store) / n,
            "rest_grads_bpp": (weights + state + store + grads) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--repeat", type=int, default=3, help="processes per preset (the table shows the median and range)")
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    parser.add_argument("--note", default="", help="a line written under the table (e.g. the load average)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    rows, peaks = {}, {}
    for preset in args.presets.split(","):
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, __file__, "--child", preset], capture_output=True, text=True, check=True)
            rows[preset] = json.loads(out.stdout.strip().splitlines()[-1])
            peaks.setdefault(preset, []).append(rows[preset]["peak_mib"])
        rows[preset]["peak_mib"] = statistics.median(peaks[preset])
    fp32 = rows.get("fp32", {}).get("peak_mib")
    lines = ["## Peak memory of a training step, per preset (`benchmarks/step_memory.py`)", "",
             f"`python benchmarks/step_memory.py --repeat {args.repeat}` — {machine()}", "",
             f"{next(iter(rows.values()))['params'] / 1e6:.1f}M parameters, AdamW, batch {BATCH}; {args.repeat} processes "
             "per preset, median (range) of the peak: the allocator's reuse of freed memory moves it by tens of MiB.", "",
             "| preset | peak step memory (MiB) | vs fp32 | at rest (B/param) | with gradients (B/param) |",
             "|---|---:|---:|---:|---:|"]
    for preset, r in rows.items():
        ratio = f"{r['peak_mib'] / fp32:.2f}×" if fp32 else "–"
        span = f"{min(peaks[preset]):.0f}–{max(peaks[preset]):.0f}"
        lines.append(f"| {preset} | {r['peak_mib']:.0f} ({span}) | {ratio} | {r['rest_bpp']:.1f} | {r['rest_grads_bpp']:.1f} |")
    if args.note:
        lines += ["", args.note]
    print("\n".join(lines))
    if args.write:
        write_section(Path(__file__).parent / "RESULTS.md", "<!-- step_memory:start -->", "<!-- step_memory:end -->", lines)


if __name__ == "__main__":
    main()
