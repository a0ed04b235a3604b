"""tiny-lm: a byte-level transformer language model trained on Python's own stdlib source.

Most of its time is in matrix multiplies (QKV, attention, MLP, the vocab head), which is
where mixed precision pays on hardware that has fast half-precision units.
The text is CPython's standard library, present on every machine that runs ampkit,
and the vocabulary is the 256 byte values, so it never depends on the text.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from ampkit.hardware.capability import capability

from .task import Task, TaskData, check_batch_size, seeded, seeded_generator

NAME = "tiny-lm"
VOCAB = 256
BLOCK = 64
"""Context length in bytes, also the size of the learned positional table."""
EVAL_FRACTION = 0.1
EVAL_BATCH_SIZE = 64

STDLIB_FILES = (
    "argparse.py",
    "collections/__init__.py",
    "dataclasses.py",
    "enum.py",
    "functools.py",
    "inspect.py",
    "textwrap.py",
    "typing.py",
)
"""Modules that are plain files on every CPython >= 3.10, in a fixed order. Their text
changes between Python versions, so perplexities compare only on one interpreter."""


def load_corpus() -> tuple[bytes, list[str]]:
    """Concatenate the listed stdlib files that exist; return the bytes and their names."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [name for name in STDLIB_FILES if (root / name).is_file()]
    if not found:
        raise FileNotFoundError(
            f"task {NAME!r} trains on Python's standard-library source, but none of "
            f"{', '.join(STDLIB_FILES)} exists under {str(root)!r} "
            f"(sysconfig stdlib path of {sys.executable})"
        )
    text = b"\n\n".join((root / name).read_bytes() for name in found)
    return text, found


def windows(data: Tensor, step: int) -> tuple[Tensor, Tensor]:
    """The `BLOCK`-byte windows of `data` that start `step` bytes apart, as (inputs, targets): each target
    is the next byte. Views of `data`: with step 1 a copy would hold every byte `BLOCK` times."""
    w = data.unfold(0, BLOCK + 1, step)
    return w[:, :-1], w[:, 1:]


def make_data(seed: int, batch_size: int) -> TaskData:
    """Random windows of the first 90% of the text; the last 10% is held out. One epoch draws as many
    windows (with replacement, seeded) as fit in the train text end to end: one pass in expectation."""
    text, files = load_corpus()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    split = int(len(data) * (1 - EVAL_FRACTION))
    train, held_out = data[:split], data[split:]
    windows_per_epoch = len(train) // BLOCK
    check_batch_size(NAME, batch_size, windows_per_epoch)
    dataset = TensorDataset(*windows(train, 1))  # item i: the window starting at byte i
    sampler = RandomSampler(dataset, replacement=True, num_samples=windows_per_epoch, generator=seeded_generator(seed))
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    eval_x, eval_y = windows(held_out, BLOCK)  # fixed and non-overlapping
    info = {
        "source": "python stdlib " + sys.version.split()[0],
        "files": ", ".join(files),
        "train_bytes": len(train),
        "eval_bytes": len(held_out),
        "eval_windows": len(eval_x),
    }
    return TaskData(train_loader=loader, eval_inputs=eval_x, eval_targets=eval_y, info=info)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through `scaled_dot_product_attention`."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Byte-level GPT: token + learned position embeddings, blocks, final LayerNorm, head. No dropout:
    a training step draws nothing from the global RNG, so the loss curve is a function of the seed alone."""

    def __init__(self, *, vocab: int, block: int, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.block = block
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        """GPT-2 init: N(0, 0.02), zero biases, residual projections scaled by depth."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # each residual branch adds to the stream; keep its sum's variance depth-independent
        for block in self.blocks:
            assert isinstance(block, Block)  # a ModuleList yields plain Modules to the type checker
            for proj in (block.attn.proj, block.mlp[2]):
                assert isinstance(proj, nn.Linear)
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx: Tensor) -> Tensor:
        """(B, T) int64 byte ids -> (B, T, vocab) logits, T <= block."""
        t = idx.shape[1]
        if t > self.block:
            raise ValueError(f"sequence length {t} exceeds the model's block size {self.block}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


Size = collections.namedtuple("Size", "d_model n_heads n_layers batch_size steps lr")
"""One model size with the batch, steps and learning rate it trains well with."""

SIZES: dict[str, Size] = {
    "small": Size(96, 3, 3, 32, 500, 2e-3),  # 0.4 M parameters: overhead-bound, for CPUs without fast bf16
    "medium": Size(256, 4, 4, 32, 300, 1e-3),  # 3.3 M: ~40 GFLOP a step in 3-8 M-element matmuls
    "large": Size(768, 12, 8, 256, 500, 5e-4),  # 57 M: ~6 TFLOP a step, GEMM-bound on any GPU
}
"""`ampkit compare --size`: the same data and loop at three model sizes."""


def size_for(device: torch.device) -> str:
    """The size whose step is dominated by matmuls where `device` has fast low-precision math, and that
    a default comparison trains in minutes there: large on a GPU, medium on a CPU with fast bf16
    (avx512_bf16 or AMX), small on a CPU without it (fp32 wins there, and a bf16 probe stays cheap)."""
    if device.type != "cpu":
        return "large"
    return "medium" if capability(device).bf16_fast else "small"


def make_model(seed: int, size: str = "small") -> nn.Module:
    """A TinyLM of `size` (`SIZES`; small by default), initialised from `seed`."""
    s = SIZES[size]
    with seeded(seed):
        return TinyLM(vocab=VOCAB, block=BLOCK, d_model=s.d_model, n_heads=s.n_heads, n_layers=s.n_layers)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Mean next-byte cross-entropy, in fp32: half-precision logits lose too much in log-softmax."""
    return F.cross_entropy(output.float().flatten(0, 1), target.flatten())


def make_optimizer(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW with GPT betas (0.9, 0.95), steadier on short runs at a high constant learning rate."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


@torch.no_grad()
def evaluate(model: nn.Module, data: TaskData, device: torch.device | str) -> dict[str, float]:
    """Held-out mean loss per byte, its exponential (perplexity), and `perplexity_band`: the half-width
    of perplexity's ~95% band from the spread of the held-out windows' losses (two standard errors of
    their mean): how far another held-out sample of this size could move it."""
    was_training = model.training
    model.eval()
    try:
        per_window = torch.cat(
            [  # mean loss of each held-out window, kept on the device
                F.cross_entropy(model(x.to(device)).float().transpose(1, 2), y.to(device), reduction="none").mean(1)
                for x, y in zip(data.eval_inputs.split(EVAL_BATCH_SIZE), data.eval_targets.split(EVAL_BATCH_SIZE))
            ]
        )
        std, mean = torch.std_mean(per_window.double())
        eval_loss, sd = mean.item(), std.item()  # sync: the evaluation's reads, after training
        band = math.exp(eval_loss) * (math.exp(2 * sd / math.sqrt(len(per_window))) - 1)
        return {"perplexity": math.exp(eval_loss), "eval_loss": eval_loss, "perplexity_band": band}
    finally:
        model.train(was_training)


TASK = Task(
    name=NAME,
    description="byte-level transformer LM on Python stdlib source (small: 3 layers, d_model 96)",
    metric="perplexity",
    higher_is_better=False,
    default_steps=500,
    default_batch_size=32,
    default_lr=2e-3,
    make_model=make_model,
    make_data=make_data,
    make_optimizer=make_optimizer,
    loss_fn=loss_fn,
    evaluate=evaluate,
)


def sized(size: str) -> Task:
    """tiny-lm at `size` (a key of `SIZES`): the same data, loss and evaluation, a model of that size."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {', '.join(SIZES)}")
    s = SIZES[size]
    return dataclasses.replace(
        TASK,
        description=f"byte-level {s.n_layers}-layer transformer LM (d_model {s.d_model}) on Python stdlib source",
        default_steps=s.steps,
        default_batch_size=s.batch_size,
        default_lr=s.lr,
        make_model=functools.partial(make_model, size=size),
    )
