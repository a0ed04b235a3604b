"""`Accelerator(cast_outputs=...)`: what the fp32 copy of a model's outputs costs.

    PYTHONPATH=src python benchmarks/cast_outputs.py [--vocab 50304] [--rounds 12]

Two shapes of loop, each with cast_outputs True and False, bf16-mixed, rounds interleaved:
* "loss inside": the model returns (logits, loss) as nanoGPT and Hugging Face models do; the loop
  uses only the loss, so the fp32 copy of the logits is made and never read;
* "loss outside": the loop computes cross_entropy on the logits; with cast_outputs=False the loss
  runs on bf16 logits (no autocast around it) and differs from torch.autocast's.
Prints median seconds per step, the paired ratio True/False, the peak-RSS difference and the loss
difference from the native autocast loop.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampkit  # noqa: E402
import nanogpt_shaped as ex  # noqa: E402
from _timing import interleaved, machine, medians, paired_ratio  # noqa: E402


def make_step(c: ex.Config, cast: bool, inside: bool):
    torch.manual_seed(0)
    model = ex.GPT(c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu", cast_outputs=cast)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, c.vocab_size, (c.batch_size, c.block_size), generator=g)
    y = torch.randint(0, c.vocab_size, (c.batch_size, c.block_size), generator=g)

    def step() -> None:
        if inside:
            _, loss = model(x, y)
        else:
            logits, _ = model(x)
            loss = F.cross_entropy(logits.view(-1, c.vocab_size), y.view(-1))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

    return step


def loss_gap(c: ex.Config) -> float:
    """|loss(cast_outputs=False, loss outside, no autocast) - loss(native autocast)| on one batch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, c.vocab_size, (c.batch_size, c.block_size), generator=g)
    y = torch.randint(0, c.vocab_size, (c.batch_size, c.block_size), generator=g)
    torch.manual_seed(0)
    native = ex.GPT(c)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = native(x)
        ref = F.cross_entropy(logits.view(-1, c.vocab_size), y.view(-1))
    torch.manual_seed(0)
    model = ampkit.Accelerator(precision="bf16-mixed", device="cpu", cast_outputs=False).prepare(ex.GPT(c))
    with nullcontext():
        logits, _ = model(x)
        loss = F.cross_entropy(logits.view(-1, c.vocab_size), y.view(-1))
    return abs(loss.item() - ref.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    c = ex.Config(vocab_size=args.vocab, n_embd=128, n_head=4, n_layer=2, block_size=64, batch_size=8)
    print(machine())
    loops = {
        f"{'inside' if inside else 'outside'}/{'cast' if cast else 'nocast'}": make_step(c, cast, inside)
        for inside in (True, False)
        for cast in (True, False)
    }
    times = interleaved(loops, rounds=args.rounds, steps=args.steps, warmup=2)
    for name, t in medians(times).items():
        print(f"{name:16s} {t * 1e3:8.1f} ms/step")
    for shape in ("inside", "outside"):
        print(f"{shape}: cast/nocast = {paired_ratio(times[f'{shape}/cast'], times[f'{shape}/nocast']):.3f}x")
    logits_mib = c.batch_size * c.block_size * c.vocab_size * 4 / 2**20
    print(f"fp32 copy of the logits: {logits_mib:.0f} MiB per micro-step")
    print(f"loss outside, cast_outputs=False vs native autocast: |diff| = {loss_gap(c):.3g}")


if __name__ == "__main__":
    main()
