"""The one prepared GPU check: every preset on a GPT-2-small-shaped model, one summary table.

    python benchmarks/gpu_check.py --out "$OUT"            # on a CUDA machine: <= 8 minutes, <= 8 files
    python benchmarks/gpu_check.py --smoke --out /tmp/gc   # the same code on a CPU at tiny sizes (tests)

Per preset (fp32, bf16-mixed, fp16-mixed, bf16-master, bf16-true; fp8-mixed with compile=True where the
GPU's compute capability is >= 8.9), at the largest batch `ampkit.plan` says every preset fits (capped by
`--max-batch`), it measures:
- the step time (forward, backward, clip, step, zero_grad; median of `--steps` after warm-up) and the
  speed-up over fp32, and the ratio to the hand-written loop of the same arithmetic (autocast, and for
  fp16 torch's GradScaler);
- host syncs per step, counted as the warnings `torch.cuda.set_sync_debug_mode("warn")` raises;
- the peak `torch.cuda.max_memory_allocated` of a steady step against `ampkit.plan`'s prediction;
- the optimizer step alone (synchronized before and after) against the bytes it must move at the
  device's measured copy bandwidth.
Then `ampkit info --bench --json` (info.json) and `tests/test_cuda.py` (the GPU-only tests: no blocking
sync per step, parity with the hand-written loop, compile and CUDA graphs) run in subprocesses.

Files in `--out`: gpu_check.txt (the table), gpu_check.json (every figure), info.json, pytest.txt.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ampkit

PRESETS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-true", "fp8-mixed")
# Bytes an AdamW update must read and write per parameter, per preset (weights, gradients, two moments, plus
# what the preset adds: fp32 gradient copies and masters' write-back, a Kahan buffer, loss-scale unscaling).
UPDATE_BYTES = {"fp32": 28, "bf16-mixed": 28, "fp16-mixed": 36, "bf16-master": 40, "bf16-true": 18, "fp8-mixed": 28}
HAND_WRITTEN = {
    "fp32": "fp32",
    "bf16-mixed": "bf16",
    "bf16-master": "bf16",
    "bf16-true": "bf16",
    "fp16-mixed": "fp16",
    "fp8-mixed": "bf16",
}


@dataclass
class Size:
    layers: int
    d: int
    heads: int
    seq: int
    vocab: int


GPT2_SMALL = Size(layers=12, d=768, heads=12, seq=1024, vocab=50304)
TINY = Size(layers=2, d=64, heads=2, seq=32, vocab=256)


class Block(nn.Module):
    def __init__(self, s: Size) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(s.d), nn.LayerNorm(s.d)
        self.qkv, self.proj, self.heads = nn.Linear(s.d, 3 * s.d), nn.Linear(s.d, s.d), s.heads
        self.mlp = nn.Sequential(nn.Linear(s.d, 4 * s.d), nn.GELU(approximate="tanh"), nn.Linear(4 * s.d, s.d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, pre-norm blocks, a head tied to the embedding."""

    def __init__(self, s: Size) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.d), nn.Embedding(s.seq, s.d)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln, self.head = nn.LayerNorm(s.d), nn.Linear(s.d, s.vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@dataclass
class Row:
    preset: str
    status: str = "ok"
    reason: str = ""
    step_ms: float | None = None
    speedup_vs_fp32: float | None = None
    vs_hand_written: float | None = None
    hand_written_ms: float | None = None
    syncs_per_step: float | None = None
    peak_mib: float | None = None
    planned_mib: float | None = None
    update_ms: float | None = None
    update_bytes_per_param: int | None = None
    update_floor_ms: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # sync: timing boundaries, outside the step


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), the best of five."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    best = math.inf
    for _ in range(5):
        sync(dev)
        t = time.perf_counter()
        b.copy_(a)
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


def count_syncs(fn: Callable[[], None], dev: torch.device, steps: int) -> float | None:
    """Host syncs per call of `fn`, as set_sync_debug_mode('warn') reports them (None off CUDA)."""
    if dev.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in seen) / steps


def timed(fn: Callable[[], None], dev: torch.device, warmup: int, steps: int) -> float:
    """Median seconds of `fn` after `warmup` calls, synchronized around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def batches(s: Size, batch: int, dev: torch.device, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, s.vocab, (n, batch, s.seq + 1), generator=g)
    return [(d[:, :-1].to(dev), d[:, 1:].to(dev)) for d in data]


def hand_written(kind: str, s: Size, batch: int, dev: torch.device, warmup: int, steps: int) -> float:
    """The loop without ampkit: fp32 weights, autocast (`kind`: fp32, bf16 or fp16 with GradScaler)."""
    torch.manual_seed(0)
    model = GPT(s).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = torch.amp.GradScaler(dev.type, enabled=kind == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind)
    data, i = batches(s, batch, dev), [0]

    def step() -> None:
        x, y = data[i[0] % len(data)]
        i[0] += 1
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = lm_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return timed(step, dev, warmup, steps)


def ampkit_run(preset: str, s: Size, batch: int, dev: torch.device, warmup: int, steps: int, row: Row) -> None:
    torch.manual_seed(0)
    model = GPT(s)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    acc = ampkit.Accelerator(precision=preset, device=dev, compile=preset == "fp8-mixed" or None)
    model, opt = acc.prepare(model, opt)
    data, i = batches(s, batch, dev), [0]
    params = sum(p.numel() for p in model.parameters())

    def forward_backward() -> None:
        x, y = data[i[0] % len(data)]
        i[0] += 1
        acc.backward(lm_loss(model(x), y))
        acc.clip_grad_norm_(1.0)

    def step() -> None:
        forward_backward()
        opt.step()
        opt.zero_grad()

    row.step_ms = 1e3 * timed(step, dev, warmup, steps)
    row.syncs_per_step = count_syncs(step, dev, 3)
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        sync(dev)
        row.peak_mib = torch.cuda.max_memory_allocated(dev) / 2**20
    updates = []
    for _ in range(max(3, steps // 2)):
        forward_backward()
        sync(dev)
        t = time.perf_counter()
        opt.step()
        sync(dev)
        updates.append(time.perf_counter() - t)
        opt.zero_grad()
    row.update_ms = 1e3 * statistics.median(updates)
    row.update_bytes_per_param = UPDATE_BYTES[preset]
    row.extra["parameters"] = params


def planned(presets: list[str], s: Size, batch: int, dev: torch.device) -> dict[str, float]:
    """`ampkit.plan`'s predicted peak (MiB) per preset at `batch`."""
    x, y = batches(s, batch, torch.device("cpu"), n=1)[0]
    result = ampkit.plan(
        lambda: GPT(s),
        lambda: (x, y),
        lambda p: torch.optim.AdamW(p, lr=3e-4),
        presets,
        dev,
        loss_fn=lm_loss,
        search=False,
    )
    return {r.precision: r.peak_bytes / 2**20 for r in result.rows}


def largest_batch(s: Size, dev: torch.device, cap: int) -> int:
    """The largest batch (<= cap) `ampkit.plan` says fits in fp32, the preset that holds the most."""
    x, y = batches(s, 1, torch.device("cpu"), n=1)[0]
    result = ampkit.plan(
        lambda: GPT(s),
        lambda: (x, y),
        lambda p: torch.optim.AdamW(p, lr=3e-4),
        ["fp32"],
        dev,
        memory=int(0.85 * torch.cuda.mem_get_info(dev)[0]) if dev.type == "cuda" else 2**31,
        loss_fn=lm_loss,
    )
    return max(1, min(cap, result.rows[0].max_batch_size or 1))


def runnable(preset: str, dev: torch.device) -> str | None:
    """Why `preset` is left out on `dev` (None: it runs)."""
    if preset == "fp8-mixed":
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
            return "needs a GPU of compute capability >= 8.9"
        try:
            import torchao  # noqa: F401
        except ImportError:
            return "needs torchao (pip install 'ampkit[fp8]')"
    return None


def table(rows: list[Row], header: str) -> str:
    def f(v: float | None, fmt: str) -> str:
        return "-".rjust(int(fmt.split(".")[0])) if v is None else format(v, fmt)

    lines = [
        header,
        "",
        f"{'preset':12} {'step ms':>9} {'vs fp32':>8} {'vs hand':>8} {'syncs':>6} {'peak MiB':>9} "
        f"{'plan MiB':>9} {'plan err':>8} {'update ms':>9} {'floor ms':>8} {'B/param':>7}",
    ]
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.preset:12} {r.status}: {r.reason}")
            continue
        err = None if not (r.peak_mib and r.planned_mib) else r.planned_mib / r.peak_mib - 1
        lines.append(
            f"{r.preset:12} {f(r.step_ms, '9.1f')} {f(r.speedup_vs_fp32, '7.2f')}x {f(r.vs_hand_written, '7.2f')}x "
            f"{f(r.syncs_per_step, '6.1f')} {f(r.peak_mib, '9.0f')} {f(r.planned_mib, '9.0f')} "
            f"{'-' if err is None else format(err, '+8.0%')} {f(r.update_ms, '9.2f')} "
            f"{f(r.update_floor_ms, '8.2f')} {r.update_bytes_per_param or '-':>7}"
        )
    lines += [
        "",
        "vs hand: ampkit's step / the hand-written autocast loop's (fp16: with GradScaler). syncs: host syncs "
        "per step (set_sync_debug_mode). floor: the update's bytes at the measured copy bandwidth.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu-check", help="folder for the files (at most 8)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on this machine's device (CPU in tests)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10; smoke 2)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--budget-s", type=float, default=420.0, help="runs left when this is spent are skipped")
    parser.add_argument("--no-tests", action="store_true", help="leave out tests/test_cuda.py")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        parser.error("no CUDA device: run with --smoke for the CPU version at tiny sizes")
    s = TINY if args.smoke else GPT2_SMALL
    steps, warmup = args.steps or (2 if args.smoke else 10), 1 if args.smoke else 3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown {unknown}; choose from {', '.join(PRESETS)}")
    batch = 2 if args.smoke else largest_batch(s, dev, args.max_batch)
    runs = [p for p in presets if runnable(p, dev) is None]
    try:
        plans = planned([p for p in runs if p != "fp8-mixed"], s, batch, dev)
    except Exception as exc:  # the timings stand without the prediction
        plans, plan_error = {}, f"{type(exc).__name__}: {exc}"
    else:
        plan_error = ""
    bandwidth = copy_bandwidth(dev, 1 << (30 if dev.type == "cuda" else 24))
    rows, hand = [], {}
    for preset in presets:
        row = Row(preset)
        rows.append(row)
        if (why := runnable(preset, dev)) is not None:
            row.status, row.reason = "skipped", why
            continue
        if time.perf_counter() - start > args.budget_s:
            row.status, row.reason = "skipped", f"the {args.budget_s:.0f} s budget was spent"
            continue
        try:
            ampkit_run(preset, s, batch, dev, warmup, steps, row)
            kind = HAND_WRITTEN[preset]
            if kind not in hand:
                hand[kind] = 1e3 * hand_written(kind, s, batch, dev, warmup, steps)
            row.hand_written_ms = hand[kind]
            row.vs_hand_written = row.step_ms / hand[kind] if row.step_ms else None
        except Exception as exc:  # one preset's failure is a row, not the end of the check
            row.status, row.reason = "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        row.planned_mib = plans.get(preset)
        row.update_floor_ms = 1e3 * row.update_bytes_per_param * row.extra["parameters"] / bandwidth
    base = next((r for r in rows if r.preset == "fp32" and r.step_ms), None)
    for r in rows:
        if base is not None and r.step_ms:
            r.speedup_vs_fp32 = base.step_ms / r.step_ms
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    header = (
        f"gpu_check: {name}, torch {torch.__version__}, ampkit {ampkit.__version__}; GPT {s.layers} layers, "
        f"d {s.d}, seq {s.seq}, vocab {s.vocab}, batch {batch}; copy bandwidth {bandwidth / 1e9:.0f} GB/s"
        + (f"; plan failed: {plan_error}" if plan_error else "")
    )
    text = table(rows, header)
    if dev.type == "cuda":  # the capability table against a measured matmul per dtype
        info = subprocess.run(
            [sys.executable, "-m", "ampkit.cli.main", "info", "--bench", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        (out / "info.json").write_text(info.stdout or info.stderr)
    if dev.type == "cuda" and not args.no_tests:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_cuda.py"],
            capture_output=True,
            text=True,
            timeout=max(60, args.budget_s + 150 - (time.perf_counter() - start)),
        )
        (out / "pytest.txt").write_text(done.stdout[-20000:] + done.stderr[-5000:])
        text += f"tests/test_cuda.py: {(done.stdout.strip().splitlines() or ['no output'])[-1]}\n"
    (out / "gpu_check.txt").write_text(text)
    (out / "gpu_check.json").write_text(
        json.dumps(
            {"header": header, "batch": batch, "bandwidth_Bps": bandwidth, "rows": [asdict(r) for r in rows]}, indent=1
        )
    )
    print(text, end="")
    return 0 if all(r.status != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
