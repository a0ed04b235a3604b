"""A nanoGPT-shaped training script, converted to ampkit.

    python examples/nanogpt_shaped.py --precision bf16-mixed --iters 40

The shape of karpathy/nanoGPT's `train.py` on a tiny model and random tokens: a model that returns
`(logits, loss)`, AdamW with weight-decay groups, a learning rate set by hand each iteration, its
own micro-step loop for gradient accumulation, clipping, an `estimate_loss()` evaluation with
`.item()` every `eval_interval` iterations and `torch.save` of the model. Lines marked `# was:`
show what the conversion changed; everything else is the original's. `tests/test_example_nanogpt.py`
checks it against the unconverted loop (`torch.autocast` + its own division and clip) bit for bit.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ampkit


@dataclass
class Config:
    vocab_size: int = 96
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    batch_size: int = 4
    gradient_accumulation_steps: int = 4
    learning_rate: float = 3e-3
    warmup_iters: int = 5
    max_iters: int = 40
    grad_clip: float = 1.0
    eval_interval: int = 10
    eval_iters: int = 4
    seed: int = 1337


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.c_attn, self.c_proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def make_data(c: Config) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(c.seed)
    return {
        "train": torch.randint(0, c.vocab_size, (4096,), generator=g),
        "val": torch.randint(0, c.vocab_size, (1024,), generator=g),
    }


def get_batch(data: torch.Tensor, c: Config, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - c.block_size - 1, (c.batch_size,), generator=g)
    x = torch.stack([data[i : i + c.block_size] for i in ix])
    return x, torch.stack([data[i + 1 : i + 1 + c.block_size] for i in ix])


@torch.no_grad()
def estimate_loss(model: nn.Module, data: dict[str, torch.Tensor], c: Config) -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        g = torch.Generator().manual_seed(c.seed + 1)
        losses = torch.zeros(c.eval_iters)  # on the CPU: its .item() reads cost nothing on a GPU run either
        for k in range(c.eval_iters):
            _, loss = model(*get_batch(data[split], c, g))
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it: int, c: Config) -> float:
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    ratio = (it - c.warmup_iters) / max(1, c.max_iters - c.warmup_iters)
    return 0.1 * c.learning_rate + 0.5 * (1 + math.cos(math.pi * ratio)) * 0.9 * c.learning_rate


def train(
    precision: str, c: Config | None = None, out_dir: Path | None = None, log: bool = False
) -> dict[str, list[float]]:
    """The converted loop; returns the per-iteration losses and the evaluations (the test reads them)."""
    if c is None:
        c = Config()
    torch.manual_seed(c.seed)
    data = make_data(c)
    model = GPT(c)
    optimizer = model.configure_optimizers(0.1, c.learning_rate)
    # was: ctx = torch.autocast(...); scaler = torch.amp.GradScaler(enabled=(dtype == 'float16'))
    # The model returns its loss: the fp32 copy of its logits would never be used (cast_outputs=False).
    acc = ampkit.Accelerator(
        precision=precision,
        device="cpu",
        grad_accum_steps=c.gradient_accumulation_steps,
        divide_loss=True,
        cast_outputs=False,
    )
    model, optimizer = acc.prepare(model, optimizer)  # was: model.to(device); model = DDP(model) under torchrun
    g = torch.Generator().manual_seed(c.seed)
    X, Y = get_batch(data["train"], c, g)
    record: dict[str, list[float]] = {"loss": [], "val": []}
    for it in range(c.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, c)
        if it % c.eval_interval == 0:
            losses = estimate_loss(model, data, c)
            record["val"].append(losses["val"])
            if log:
                acc.print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        for _micro_step in range(c.gradient_accumulation_steps):
            _, loss = model(X, Y)  # was: with ctx: logits, loss = model(X, Y)
            # was: loss = loss / gradient_accumulation_steps  (acc.backward divides: divide_loss=True)
            X, Y = get_batch(data["train"], c, g)
            acc.backward(loss)  # was: scaler.scale(loss).backward()
        acc.clip_grad_norm_(c.grad_clip)  # was: scaler.unscale_(optimizer); clip_grad_norm_(model.parameters(), ...)
        optimizer.step()  # was: scaler.step(optimizer); scaler.update()
        optimizer.zero_grad(set_to_none=True)
        record["loss"].append(loss.detach())  # was: lossf = loss.item() * gradient_accumulation_steps
        if log and it % c.eval_interval == 0:
            acc.print(f"iter {it}: loss {loss.item():.4f}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        # A whole-model save loads like the plain module's, without ampkit (torch.load(weights_only=False)).
        torch.save(acc.unwrap(model), out_dir / "model.pt")
        acc.save_checkpoint(out_dir / "checkpoints")  # was: torch.save({'model': ..., 'optimizer': ...}, ckpt.pt)
    record["loss"] = [float(loss) for loss in record["loss"]]
    return record


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="auto", help="an ampkit preset, or auto")
    parser.add_argument("--iters", type=int, default=Config.max_iters, help="optimizer steps")
    parser.add_argument("--out", type=Path, default=None, help="folder for model.pt and checkpoints/")
    args = parser.parse_args()
    train(args.precision, Config(max_iters=args.iters), out_dir=args.out, log=True)
