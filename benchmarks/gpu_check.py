"""The one prepared GPU check: every preset on a GPT-2-small-shaped model, one summary table.

The device command (nothing but the image: python3, torch; ampkit is not installed there, src/ is on the path):

    PYTHONPATH=$PWD/src python3 benchmarks/gpu_check.py --out "$OUT" --deadline-s 420
    PYTHONPATH=$PWD/src python3 benchmarks/gpu_check.py --smoke --out /tmp/gc   # tiny sizes, CPU (the suite)

Per preset (fp32, bf16-mixed, fp16-mixed, bf16-master, bf16-true; fp8-mixed compiled where the GPU's compute
capability is >= 8.9 and torchao is importable, with the layer rule set so GPT-2's block layers convert), at the
largest batch `ampkit.plan` says fp32 fits (capped by `--max-batch`), it measures:
- the step time (forward, backward, clip, step, zero_grad; median of `--steps` after warm-up) and the
  speed-up over fp32, and the ratio to the hand-written loop of the same arithmetic (autocast, and for
  fp16 torch's GradScaler);
- host syncs per step, counted as the warnings `torch.cuda.set_sync_debug_mode("warn")` raises;
- the peak `torch.cuda.max_memory_allocated` of a steady step against `ampkit.plan`'s prediction;
- the optimizer step alone (synchronized before and after) against the bytes it must move at the
  device's measured copy bandwidth.
Then `ampkit info --json` (info.json; `--bench` on CUDA) and `tests/test_cuda.py` (pytest.txt) in subprocesses.

It cannot lose what it measured: every phase checks the deadline first and is skipped with that reason once it
is spent; a phase that raises records its error and the run goes on; every subprocess has its own timeout; the
table and the JSON are rewritten (tmp + rename) and each row printed as it is done, so the files on disk are the
partial result at any moment. Between presets: gc.collect(), empty_cache(), reset_peak_memory_stats().

Files in `--out`: gpu_check.txt (the table), gpu_check.json (every figure and phase), info.json, pytest.txt.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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

ROOT = Path(__file__).resolve().parents[1]
try:
    import ampkit
except ImportError:  # run without PYTHONPATH=src: the check still starts, from this checkout
    sys.path.insert(0, str(ROOT / "src"))
    import ampkit
from ampkit.tools import timing  # noqa: E402 - after the path is known

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


sync = timing.sync_device  # timing boundaries, outside the step


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), the best of five."""
    return timing.copy_bandwidth(dev, seconds=10.0, repeats=5, mib=max(1, nbytes >> 20))


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
    return statistics.median(timing.interleaved({"fn": fn}, steps, warmup=warmup, sync=lambda: sync(dev))["fn"])


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
    # fp8: the default rule (in*out >= 2048^2) converts none of GPT-2 small's Linear layers (the largest is
    # 768 x 3072); d*d converts every block Linear (qkv, proj, both MLP layers), the tied head stays bf16
    fp8 = {"fp8_min_weight": s.d * s.d} if preset == "fp8-mixed" else {}
    acc = ampkit.Accelerator(precision=preset, device=dev, compile=preset == "fp8-mixed" or None, **fp8)
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
        try:
            import torchao  # noqa: F401
        except ImportError:
            return "torchao is not installed (pip install 'ampkit[fp8]', or carry its wheel: RESULTS.md)"
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
            return "needs a GPU of compute capability >= 8.9"
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


class Check:
    """The run's state on disk: rows and phases, rewritten whole (tmp + rename) after every change."""

    def __init__(self, out: Path, deadline_s: float) -> None:
        self.out, self.deadline, self.start = out, deadline_s, time.perf_counter()
        self.rows: list[Row] = []
        self.phases: list[dict[str, object]] = []
        self.header, self.facts = "gpu_check: starting", {}

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.start)

    def phase(self, name: str, fn: Callable[[], object]) -> object:
        """Run `fn` unless the deadline is spent; its error is recorded, never raised. The files are rewritten."""
        record: dict[str, object] = {"phase": name, "status": "ok", "error": ""}
        self.phases.append(record)
        if self.left() <= 0:
            record.update(status="skipped", error=f"the {self.deadline:.0f} s deadline was spent")
            self.write()
            return None
        t = time.perf_counter()
        try:
            return fn()
        except Exception as exc:  # one phase's failure is recorded; the run goes on
            record.update(
                status="failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            )
            return None
        finally:
            record["seconds"] = round(time.perf_counter() - t, 3)
            self.write()

    def subprocess(self, name: str, cmd: list[str], timeout_s: float, target: str) -> None:
        """`cmd` with its own timeout (at most what the deadline leaves), its output in `target`."""

        def run() -> None:
            limit = max(1.0, min(timeout_s, self.left()))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT, env=env)
            except subprocess.TimeoutExpired as exc:
                partial = (exc.stdout or b"")[-20000:]
                text = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
                self.atomic(target, text + f"\n[timed out after {limit:.0f} s]\n")
                raise TimeoutError(f"{' '.join(cmd[1:4])} timed out after {limit:.0f} s") from None
            self.atomic(target, done.stdout[-20000:] + done.stderr[-5000:])
            last = (done.stdout.strip().splitlines() or ["no output"])[-1] if name == "tests" else f"in {target}"
            self.facts[name] = last if done.returncode == 0 else f"exit {done.returncode}: {last}"
            if done.returncode:
                error = (done.stderr.strip().splitlines() or [last])[-1]
                raise RuntimeError(f"{' '.join(cmd[1:4])} exited {done.returncode}: {error[:300]}")

        self.phase(name, run)

    def atomic(self, name: str, text: str) -> None:
        path = self.out / name
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def write(self) -> None:
        base = next((r for r in self.rows if r.preset == "fp32" and r.step_ms), None)
        for r in self.rows:
            r.speedup_vs_fp32 = base.step_ms / r.step_ms if base is not None and r.step_ms else None
        text = table(self.rows, self.header)
        text += "".join(f"{k}: {v}\n" for k, v in self.facts.items())
        text += "".join(f"phase {p['phase']}: {p['status']} {p['error']}\n" for p in self.phases if p["status"] != "ok")
        self.atomic("gpu_check.txt", text)
        data = {"header": self.header, **self.facts, "phases": self.phases, "rows": [asdict(r) for r in self.rows]}
        self.atomic("gpu_check.json", json.dumps(data, indent=1, default=str))


def fresh(dev: torch.device) -> None:
    """Nothing of the last preset left in the next one's peak: its objects collected, the cache emptied."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu-check", help="folder for the files (at most 8)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on this machine's device (CPU in tests)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10; smoke 2)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--deadline-s", type=float, default=420.0, help="phases not begun by then are skipped")
    parser.add_argument("--tests", default="tests/test_cuda.py", help="the pytest target of the tests phase")
    parser.add_argument("--tests-timeout-s", type=float, default=240.0, help="the tests phase's own timeout")
    parser.add_argument("--no-tests", action="store_true", help="leave out the tests phase")
    args = parser.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        parser.error("no CUDA device: run with --smoke for the CPU version at tiny sizes")
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown {unknown}; choose from {', '.join(PRESETS)}")
    s = TINY if args.smoke else GPT2_SMALL
    steps, warmup = args.steps or (2 if args.smoke else 10), 1 if args.smoke else 3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.deadline_s)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    check.header = f"gpu_check: {name}, torch {torch.__version__}, ampkit {ampkit.__version__}; starting"
    check.write()
    batch = check.phase("batch", lambda: 2 if args.smoke else largest_batch(s, dev, args.max_batch)) or 1
    runs = [p for p in presets if runnable(p, dev) is None]
    plans = check.phase("plan", lambda: planned([p for p in runs if p != "fp8-mixed"], s, batch, dev)) or {}
    bandwidth = check.phase("bandwidth", lambda: copy_bandwidth(dev, 1 << (30 if dev.type == "cuda" else 24)))
    check.header = (
        f"gpu_check: {name}, torch {torch.__version__}, ampkit {ampkit.__version__}; GPT {s.layers} layers, "
        f"d {s.d}, seq {s.seq}, vocab {s.vocab}, batch {batch}; copy bandwidth "
        + (f"{bandwidth / 1e9:.0f} GB/s" if bandwidth else "unmeasured")
    )
    hand: dict[str, float] = {}
    for preset in presets:
        row = Row(preset)
        check.rows.append(row)
        if (why := runnable(preset, dev)) is not None:
            row.status, row.reason = "skipped", why
            check.write()
            print(f"{preset}: skipped ({why})", flush=True)
            continue

        def measure(preset: str = preset, row: Row = row) -> None:
            fresh(dev)
            ampkit_run(preset, s, batch, dev, warmup, steps, row)
            fresh(dev)
            kind = HAND_WRITTEN[preset]
            if kind not in hand:
                hand[kind] = 1e3 * hand_written(kind, s, batch, dev, warmup, steps)
            row.hand_written_ms = hand[kind]
            row.vs_hand_written = row.step_ms / hand[kind] if row.step_ms else None
            row.planned_mib = plans.get(preset)
            if bandwidth:
                row.update_floor_ms = 1e3 * row.update_bytes_per_param * row.extra["parameters"] / bandwidth

        check.phase(preset, measure)
        fresh(dev)
        record = check.phases[-1]
        if record["status"] != "ok":
            row.status, row.reason = str(record["status"]), str(record["error"])
            check.write()
        print(table([row], check.header).splitlines()[3], flush=True)
    info = [sys.executable, "-m", "ampkit.cli.main", "info", "--json"] + (["--bench"] if dev.type == "cuda" else [])
    check.subprocess("info", info, 120, "info.json")
    if not args.no_tests:
        check.subprocess(
            "tests",
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", args.tests],
            args.tests_timeout_s,
            "pytest.txt",
        )
    check.write()
    print((out / "gpu_check.txt").read_text(), end="", flush=True)
    return 0 if all(p["status"] != "failed" for p in check.phases) else 1


if __name__ == "__main__":
    sys.exit(main())
