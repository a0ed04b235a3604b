"""ampkit's per-step overhead against the hand-written loop it replaces, side by side in one process.

    python benchmarks/overhead.py                       # full sizes (transformer d_model 512, seq 128, batch 16)
    python benchmarks/overhead.py --transformer 64,2,32,4 --write   # small transformer; update RESULTS.md

Variants per model: the hand-written fp32 loop, ampkit "fp32", the hand-written `torch.autocast`
bf16 loop and ampkit "bf16-mixed". Rounds are interleaved (A B C D A B C D ...), each round runs a
few steps of every variant, the first rounds are dropped as warm-up, and the median round time per
step is compared. Ratios > 1 mean ampkit is slower than the hand-written loop.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from _timing import interleaved, machine, medians, write_section

RESULTS = Path(__file__).with_name("RESULTS.md")
START, END = "<!-- overhead:start -->", "<!-- overhead:end -->"


def iris_mlp() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    return model, lambda g: (torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g))


def transformer(d_model: int, layers: int, seq: int, batch: int):
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(d_model, nhead=max(1, d_model // 64), dim_feedforward=4 * d_model, batch_first=True, dropout=0.0)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x).mean(dim=1))

    return Encoder(), lambda g: (torch.randn(batch, seq, d_model, generator=g), torch.randint(0, 8, (batch,), generator=g))


class Variant:
    """One training loop with its own model copy, optimizer and data stream."""

    def __init__(self, name: str, make, device: torch.device, precision: str | None, autocast: torch.dtype | None) -> None:
        torch.manual_seed(0)
        model, self.batch = make()
        self.name, self.device, self.autocast = name, device, autocast
        self.model = model.to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(0)
        self.acc = None
        if precision is not None:
            self.acc = ampkit.Accelerator(precision=precision, device=device)
            self.model, self.opt = self.acc.prepare(self.model, self.opt)
        self.data = [tuple(t.to(device) for t in self.batch(self.gen)) for _ in range(4)]
        self.i = 0

    def step(self) -> None:
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        if self.acc is not None:
            loss = F.cross_entropy(self.model(x), y)
            self.acc.backward(loss)
        elif self.autocast is not None:
            with torch.autocast(self.device.type, dtype=self.autocast):
                loss = F.cross_entropy(self.model(x), y)
            loss.backward()
        else:
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()


def measure(variants: list[Variant], rounds: int, steps: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each variant over interleaved rounds, warm-up rounds dropped."""
    sync = torch.cuda.synchronize if variants[0].device.type == "cuda" else (lambda: None)
    return medians(interleaved({v.name: v.step for v in variants}, rounds, steps, warmup, sync))


def run_model(title: str, make, device: torch.device, rounds: int, steps: int, warmup: int) -> list[str]:
    variants = [
        Variant("hand-written fp32", make, device, None, None),
        Variant("ampkit fp32", make, device, "fp32", None),
        Variant("hand-written autocast bf16", make, device, None, torch.bfloat16),
        Variant("ampkit bf16-mixed", make, device, "bf16-mixed", None),
    ]
    med = measure(variants, rounds, steps, warmup)
    base = {"ampkit fp32": "hand-written fp32", "ampkit bf16-mixed": "hand-written autocast bf16"}
    rows = [f"#### {title}", "", "| variant | median step (ms) | vs hand-written | vs hand-written fp32 |", "|---|---:|---:|---:|"]
    for v in variants:
        ms = med[v.name] * 1e3
        ratio = f"{med[v.name] / med[base[v.name]]:.3f}×" if v.name in base else "—"
        rows.append(f"| {v.name} | {ms:.3f} | {ratio} | {med[v.name] / med['hand-written fp32']:.3f}× |")
    rows.append("")
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--transformer", default="512,4,128,16", help="d_model,layers,seq,batch (default: 512,4,128,16)")
    parser.add_argument("--mlp-rounds", type=int, default=40)
    parser.add_argument("--transformer-rounds", type=int, default=8)
    parser.add_argument("--write", action="store_true", help=f"replace the overhead section of {RESULTS.name}")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=r".*runs far slower than fp32.*")
    device = ampkit.hardware.resolve_device(args.device)
    d_model, layers, seq, batch = (int(v) for v in args.transformer.split(","))

    lines = [
        "## Overhead: ampkit vs the hand-written loop (`benchmarks/overhead.py`)",
        "",
        f"- date: {datetime.date.today()}; device: {device}; machine: {machine()}",
        f"- command: `python {' '.join(sys.argv)}`",
        "- interleaved rounds, warm-up rounds dropped, median time per step; AdamW, cross-entropy.",
        "",
    ]
    lines += run_model("iris-size MLP (4→32→3, batch 16): overhead-bound", iris_mlp, device, args.mlp_rounds, 50, 5)
    lines += run_model(
        f"transformer encoder ({layers} layers, d_model {d_model}, seq {seq}, batch {batch})",
        lambda: transformer(d_model, layers, seq, batch), device, args.transformer_rounds, 2, 2,
    )
    if args.write:
        write_section(RESULTS, START, END, lines)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
