"""ampkit on a real GPU, in one unattended call under a hard time limit (issue 8, "GPU").

    python benchmarks/gpu_check.py                  # on a CUDA machine; about 4-7 minutes, never more than --budget
    python benchmarks/gpu_check.py --dry-run        # every code path on the CPU, tiny sizes, fp32/bf16 only (seconds)
    python benchmarks/gpu_check.py --tiny           # tiny sizes on CUDA: a quick smoke run of the GPU paths
    OUT=/some/dir python benchmarks/gpu_check.py    # also writes gpu_check.json and gpu_check.md there

Parts (each catches its own errors, so one failing part never loses the others' figures; the
figures are written to $OUT after every part, so a run killed from outside still leaves them):

  syncs      Zero blocking syncs per step: the ampkit fp16-mixed step with AdamW(fused=True) runs
             under torch.cuda.set_sync_debug_mode("error") (it must not raise); every config's syncs
             per step are counted under mode "warn" - the hand-written GradScaler loop for contrast,
             with fused and with foreach AdamW. The mode is set back to "default" afterwards.
  precision  A transformer encoder that fills the GPU a good deal: the hand-written fp32 loop, the
             same loop with TF32 matmuls, the hand-written autocast bf16 and fp16+GradScaler loops,
             and ampkit bf16-mixed, fp16-mixed, bf16-master, bf16-true. Interleaved rounds
             (A B C ... A B C), warm-up dropped, step time from CUDA events, median; samples/s, an
             estimate of the TFLOP/s reached, peak memory (max_memory_allocated after
             reset_peak_memory_stats, above what was allocated before the variant was built),
             speed-up over fp32.
  compiled   The best eager ampkit mode (and bf16-mixed) again with compile=True, measured against
             their eager selves; the compile time (acc.compile_stats) is reported apart from the step.
             Each compile starts only if the time left allows it.
  launch     A launch-bound MLP (3 layers of width 256, batch 32): the hand-written loop vs ampkit
             eager, compile=True and cuda_graphs=True, ms per step.

Time: a global budget (--budget, default 420 s) with a share per part; a part that runs out of its
share stops measuring and keeps what it has, a part that overruns it is interrupted (SIGALRM), and a
part that cannot start in the time left is skipped with a note. Progress lines carry the elapsed time.
Without CUDA (and without --dry-run) it prints "no CUDA device: nothing to check" and exits 0.
"""

from __future__ import annotations

import os

# Before torch is imported: the variants of a part share one process, so let freed blocks be reused
# across sizes rather than fragment the cache.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

T0 = time.monotonic()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's ampkit, installed or not
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ampkit  # noqa: E402
from _timing import machine, medians, paired_ratio, spread  # noqa: E402

SCHEMA = "ampkit.gpu_check/1"
PARTS = ("syncs", "precision", "compiled", "launch")
GIB = 2**30

#: Nominal dense peaks (TFLOP/s) of the GPUs this is meant for, to put the estimate in context.
PEAKS = {"H200": {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0},
         "H100": {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}}


# --- time ------------------------------------------------------------------------------------------
def elapsed() -> float:
    return time.monotonic() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s {datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


class PartTimeout(BaseException):
    """Raised by SIGALRM when a part overruns its share. A BaseException, so that no library's
    `except Exception` (ampkit's compile fallback, for one) mistakes it for a failure of its own."""


class Terminated(BaseException):
    """SIGTERM (an outer time limit): stop, keep what was measured, print the table."""


_ARMED = False  # whether SIGALRM may interrupt now (only while a part's own code runs)


def _alarm(signum: int, frame: Any) -> None:
    if _ARMED:
        raise PartTimeout("the part overran its time share and was interrupted")


def _term(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


def _arm(seconds: float | None) -> None:
    global _ARMED
    _ARMED = seconds is not None
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.5) if seconds is not None else 0)


@dataclasses.dataclass
class Clock:
    """The soft deadline a part's loops respect (they stop and keep what they measured)."""

    start: float  # seconds since T0
    end: float

    def left(self) -> float:
        return self.end - elapsed()

    def share(self) -> float:
        return self.end - self.start


# --- configuration ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Sizes:
    d_model: int = 1024
    layers: int = 8
    seq: int = 512
    batch: int = 64
    sync_d_model: int = 512  # the syncs part's small transformer
    sync_layers: int = 2
    sync_seq: int = 128
    sync_batch: int = 16
    mlp_width: int = 256
    mlp_layers: int = 3
    mlp_batch: int = 32
    rounds: int = 10  # precision: measured rounds
    steps: int = 3  # precision: steps per variant per round
    warmup_rounds: int = 1
    warmup_steps: int = 3  # steps run right after building a variant (caches, optimizer state, compile)
    launch_rounds: int = 15
    launch_steps: int = 50
    sync_steps: int = 5
    sync_warmup: int = 3  # steps before counting: optimizer state, cuBLAS handles and caches are created there
    launch_warmup: int = 5  # steps after building (cuda_graphs: reduce-overhead records after a few calls)
    compiled_variants: int = 2  # the best eager ampkit mode, then bf16-mixed

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(d_model=32, layers=1, seq=8, batch=4, sync_d_model=32, sync_layers=1, sync_seq=8, sync_batch=4,
                   mlp_width=32, mlp_batch=8, rounds=2, steps=1, warmup_steps=2, launch_rounds=2, launch_steps=2, sync_steps=1,
                   sync_warmup=1, launch_warmup=2, compiled_variants=1)


@dataclasses.dataclass
class Budget:
    """Seconds per part (shares of the global budget); `compiled` gets what is left over."""

    syncs: float = 45.0
    precision: float = 150.0
    launch: float = 100.0
    launch_compile_min: float = 25.0  # start a compile of the small MLP only with this much of the share left
    compile_min: float = 75.0  # start a transformer compile only with this much time for it
    grace: float = 20.0  # a part is interrupted this long after its share ran out
    slack: float = 10.0  # kept free at the end for writing the outputs

    @classmethod
    def tiny(cls) -> Budget:
        return cls(syncs=30.0, precision=30.0, launch=30.0, compile_min=2.0, launch_compile_min=2.0, grace=10.0, slack=2.0)


# --- models and data -------------------------------------------------------------------------------
class Encoder(nn.Module):
    """nn.TransformerEncoder, mean-pooled, with an 8-class head (the benchmarks' transformer)."""

    def __init__(self, d_model: int, layers: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=max(1, d_model // 64), dim_feedforward=4 * d_model,
                                           batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def mlp(width: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, 8))


def encoder_flops(d: int, layers: int, seq: int, batch: int) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3x forward)."""
    tokens = batch * seq
    linear = 2 * tokens * (4 * d * d + 2 * d * 4 * d)  # q,k,v,out projections; the two FFN matmuls
    attention = 4 * batch * seq * seq * d  # QK^T and AV
    return 3.0 * layers * (linear + attention)


def make_batches(shape: tuple[int, ...], batch: int, device: torch.device, n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, *shape, generator=g).to(device), torch.randint(0, 8, (batch,), generator=g).to(device))
            for _ in range(n)]


# --- one training loop -----------------------------------------------------------------------------
@dataclasses.dataclass
class Spec:
    """What a loop is: hand-written (precision None) or ampkit (a preset name), and its options."""

    name: str
    precision: str | None = None  # an ampkit preset; None: the hand-written loop
    autocast: torch.dtype | None = None  # hand-written: torch.autocast dtype
    grad_scaler: bool = False  # hand-written: torch.amp.GradScaler
    tf32: bool = False  # hand-written: set_float32_matmul_precision("high") around the step
    compile: bool | dict[str, Any] = False  # ampkit: Accelerator(compile=...)
    cuda_graphs: bool = False  # ampkit: Accelerator(cuda_graphs=True)
    fused: bool = True  # AdamW(fused=True); False: the default (foreach) implementation
    extras: bool = False  # ampkit: clip_grad_norm_ and an LR scheduler in the step as well
    group: str = ""  # a label for tables (the dtype family)


class Loop:
    """One training loop with its own model, optimizer and (shared, device-resident) batches."""

    def __init__(self, spec: Spec, make_model: Callable[[], nn.Module], data: list, device: torch.device) -> None:
        self.spec, self.device, self.data, self.i = spec, device, data, 0
        torch.manual_seed(0)
        model = make_model()
        self.acc: ampkit.Accelerator | None = None
        self.scaler = None
        self.sched = None
        if spec.precision is None:
            self.model = model.to(device)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=spec.fused or None)
            if spec.grad_scaler:
                self.scaler = torch.amp.GradScaler(device.type)
        else:
            self.acc = ampkit.Accelerator(precision=spec.precision, device=device, compile=spec.compile,
                                          cuda_graphs=spec.cuda_graphs)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=spec.fused or None)
            if spec.extras:
                sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=1000)
                self.model, self.opt, self.sched = self.acc.prepare(model, opt, sched)
            else:
                self.model, self.opt = self.acc.prepare(model, opt)

    def step(self) -> None:
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        spec = self.spec
        if self.acc is not None:
            loss = F.cross_entropy(self.model(x), y)
            self.acc.backward(loss)
            if spec.extras:
                self.acc.clip_grad_norm_(1.0)
            self.opt.step()
            if self.sched is not None:
                self.sched.step()
            self.opt.zero_grad()
            if spec.extras:
                self.acc.track("loss", loss)
            return
        if spec.tf32:
            torch.set_float32_matmul_precision("high")
        try:
            with torch.autocast(self.device.type, dtype=spec.autocast or torch.bfloat16, enabled=spec.autocast is not None):
                loss = F.cross_entropy(self.model(x), y)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                loss.backward()
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        finally:
            if spec.tf32:
                torch.set_float32_matmul_precision("highest")


# --- measuring -------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds for `steps` calls of `fn`: CUDA events on a GPU (the device's own clock, from the
    first kernel enqueued to the last one done), perf_counter on a CPU."""
    if device.type == "cuda":
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return time.perf_counter() - t


def interleaved_events(
    steps_of: dict[str, Callable[[], None]], rounds: int, steps: int, warmup: int, device: torch.device,
    clock: Clock, on_error: Callable[[str, BaseException], None],
) -> tuple[dict[str, list[float]], int]:
    """Seconds per step of each loop in every measured round, as `_timing.interleaved` (A B C A B C,
    warm-up rounds dropped, a failing loop reported and left out) but timed by `timed` and stopping
    early - keeping what it has - when the next round would not end before `clock`'s deadline.
    Returns the times and the number of measured rounds."""
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    live = dict(steps_of)
    measured = 0
    for r in range(rounds + warmup):
        t_round = elapsed()
        for name, fn in list(live.items()):
            try:
                t = timed(fn, steps, device)
            except Exception as exc:  # noqa: BLE001 - one broken loop must not end the others' run
                on_error(name, exc)
                del live[name]
                continue
            if r >= warmup:
                times[name].append(t / steps)
        measured += r >= warmup
        if not live:
            break
        last = elapsed() - t_round
        if r + 1 < rounds + warmup and clock.left() < 1.2 * last:
            log(f"  time share nearly spent: stopping after {measured} measured round(s) of {rounds}")
            break
    return times, measured


def build_and_warm(spec: Spec, make_model: Callable[[], nn.Module], data: list, device: torch.device,
                   warm_steps: int) -> tuple[Loop, dict[str, Any]]:
    """Build a loop and run its first steps, measuring its own peak memory on the way: the process's
    max_memory_allocated (reset first) above what was allocated before the build - its weights,
    gradients, optimizer state and activations, not the other loops' resident state."""
    info: dict[str, Any] = {}
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    loop = Loop(spec, make_model, data, device)
    first = time.perf_counter()
    loop.step()
    sync(device)
    info["first_step_s"] = time.perf_counter() - first
    for _ in range(warm_steps - 1):
        loop.step()
    sync(device)
    info["build_and_warmup_s"] = time.perf_counter() - t
    if device.type == "cuda":
        info["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        info["resident_bytes"] = torch.cuda.memory_allocated(device) - base
        info["peak_gib"] = info["peak_bytes"] / GIB
    if loop.acc is not None and (spec.compile or spec.cuda_graphs):
        st = loop.acc.compile_stats
        info["compile"] = {"first_forward_s": st.first_forward_s, "first_backward_s": st.first_backward_s,
                           "first_step_extra_s": st.first_step_extra_s, "fallback": st.fallback, "models": list(st.models)}
    return loop, info


def free_bytes(device: torch.device) -> int | None:
    """What a new variant can still get: free device memory plus the cache's unused blocks."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {str(exc).strip()}"
    return text if len(text) < 2000 else text[:2000] + " ..."


def frames(exc: BaseException, n: int = 6) -> list[str]:
    """The last `n` frames of the traceback, as file:line function (where a sync was made)."""
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(exc.__traceback__)[-n:]]


def fnum(x: Any) -> Any:
    """JSON-safe number (NaN/inf → None)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def finite(obj: Any) -> Any:
    """`obj` with every NaN/inf float replaced by None (strict JSON)."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return fnum(obj)


# --- the run ---------------------------------------------------------------------------------------
class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.sizes = Sizes.tiny() if args.tiny else Sizes()
        if args.size:
            d, l, s, b = (int(v) for v in args.size.split(","))
            self.sizes.d_model, self.sizes.layers, self.sizes.seq, self.sizes.batch = d, l, s, b
        self.budget = Budget.tiny() if args.tiny else Budget()
        self.deadline = args.budget
        self.out = Path(args.out) if args.out else (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
        self.fp16 = self.cuda  # the CPU runs (dry-run) stay with fp32 and bf16
        # compile=True on a GPU: inductor. On the CPU dry-run: dynamo with the eager backend, so the
        # compile code path (CompiledForward, compile_stats) runs in seconds without a C++ toolchain.
        self.compile_opt: bool | dict[str, Any] = True if self.cuda else {"backend": "eager"}
        self.loops: dict[str, Loop] = {}  # the precision part's loops, kept for the compiled part
        self.data: list | None = None  # the precision part's batches
        self.times: dict[str, list[float]] = {}
        self.results: dict[str, Any] = {
            "schema": SCHEMA,
            "meta": self.meta(),
            "budget": {"total_s": self.deadline, "parts": {}},
            "syncs": {"status": "pending"},
            "precision": {"status": "pending"},
            "compiled": {"status": "pending"},
            "launch_bound": {"status": "pending"},
            "summary": {},
        }

    def meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv),
            "dry_run": bool(self.args.dry_run),
            "tiny": bool(self.args.tiny),
            "device": str(self.device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "ampkit": getattr(ampkit, "__version__", None),
            "host": machine(),
            "sizes": dataclasses.asdict(self.sizes),
        }
        if self.cuda:
            p = torch.cuda.get_device_properties(self.device)
            m["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / GIB, 1),
                        "multiprocessors": p.multi_processor_count}
        return m

    def peaks(self) -> dict[str, float] | None:
        name = self.results["meta"].get("gpu", {}).get("name", "")
        return next((v for k, v in PEAKS.items() if k in name), None)

    # --- parts -------------------------------------------------------------------------------------
    def run_part(self, key: str, result_key: str, share: float | None, fn: Callable[[dict[str, Any], Clock], None],
                 min_s: float = 5.0) -> None:
        part = self.results[result_key]
        global_left = self.deadline - self.budget.slack - elapsed()
        share = global_left if share is None else min(share, global_left)
        self.results["budget"]["parts"][key] = {"share_s": round(max(share, 0.0), 1)}
        if key not in self.args.parts:
            part.update(status="skipped", note=f"not selected (--parts {','.join(self.args.parts)})")
            return
        if share < min_s:
            part.update(status="skipped", note=f"{max(global_left, 0):.0f} s of the {self.deadline:.0f} s budget left, "
                                               f"the part needs at least {min_s:.0f} s")
            log(f"part {key}: {part['note']}")
            self.write()
            return
        start = elapsed()
        clock = Clock(start, start + share)
        hard = min(share + self.budget.grace, self.deadline - elapsed() - 2.0)
        log(f"part {key}: start (share {share:.0f} s, interrupted after {hard:.0f} s)")
        part["status"] = "running"
        try:
            _arm(hard)
            fn(part, clock)
            _arm(None)
            part["status"] = "partial" if part.get("errors") else "ok"
        except PartTimeout as exc:
            _arm(None)
            part.update(status="timeout", error=f"{exc} after {elapsed() - start:.0f} s", where=frames(exc))
            log(f"part {key}: interrupted - it overran its time share")
        except Exception as exc:  # noqa: BLE001 - one failing part must not lose the others' figures
            _arm(None)
            part.update(status="error", error=error_text(exc), where=frames(exc, 10))
            log(f"part {key}: FAILED {error_text(exc)[:300]}")
        except Terminated:
            _arm(None)
            part.update(status="terminated", error="SIGTERM: the run was stopped from outside")
            raise
        finally:
            _arm(None)
            self.restore()
            self.results["budget"]["parts"][key]["used_s"] = round(elapsed() - start, 1)
            log(f"part {key}: {part['status']} in {elapsed() - start:.1f} s")
            self.write()

    def restore(self) -> None:
        """Global settings a part may have changed, back to what the next part expects."""
        with contextlib.suppress(Exception):
            torch.set_float32_matmul_precision("highest")
        if self.cuda:
            with contextlib.suppress(Exception):
                torch.cuda.set_sync_debug_mode("default")

    def free(self, keep_loops: bool = False) -> None:
        if not keep_loops:
            self.loops.clear()
            self.times.clear()
        gc.collect()
        if self.cuda:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()

    # 2. zero blocking syncs ------------------------------------------------------------------------
    def part_syncs(self, part: dict[str, Any], clock: Clock) -> None:
        s = self.sizes
        lp16 = torch.float16 if self.fp16 else torch.bfloat16
        mixed16 = "fp16-mixed" if self.fp16 else "bf16-mixed"
        master16 = "fp16-master" if self.fp16 else "bf16-master"
        n16 = "fp16" if self.fp16 else "bf16"
        headline = f"ampkit {mixed16}, fused AdamW"
        # (spec, model, run under mode "error" too). The headline runs on the MLP as well as on the
        # transformer: a sync inside torch's own attention code would fail the transformer's row
        # without being ampkit's, and the MLP's row tells the two apart.
        specs = [
            (Spec(headline), "mlp", True),
            (Spec(headline), "transformer", True),
            (Spec(f"{headline}, clip + scheduler + track", extras=True), "transformer", True),
            (Spec(f"ampkit {mixed16}, foreach AdamW", fused=False), "transformer", False),
            (Spec(f"hand-written {n16} autocast + GradScaler, fused AdamW", autocast=lp16, grad_scaler=True), "transformer", False),
            (Spec(f"hand-written {n16} autocast + GradScaler, foreach AdamW", autocast=lp16, grad_scaler=True, fused=False), "transformer", False),
            (Spec(f"ampkit {master16}, fused AdamW"), "transformer", True),
            (Spec("ampkit bf16-mixed, fused AdamW"), "transformer", True),
            (Spec("ampkit bf16-true, fused AdamW"), "transformer", True),
        ]
        for spec, _, _ in specs:
            if spec.name.startswith("ampkit "):
                spec.precision = spec.name.split(" ")[1].rstrip(",")
        models = {
            "mlp": (lambda: mlp(s.mlp_width, s.mlp_layers), make_batches((s.mlp_width,), s.mlp_batch, self.device)),
            "transformer": (lambda: Encoder(s.sync_d_model, s.sync_layers),
                            make_batches((s.sync_seq, s.sync_d_model), s.sync_batch, self.device)),
        }
        part["models"] = {"mlp": f"MLP {s.mlp_layers}×{s.mlp_width}, batch {s.mlp_batch}",
                          "transformer": f"transformer encoder ({s.sync_layers} layers, d_model {s.sync_d_model}, "
                                         f"seq {s.sync_seq}, batch {s.sync_batch})"}
        part["step"] = ("forward, cross_entropy, backward (ampkit: acc.backward), optimizer.step, zero_grad; "
                        "'clip + scheduler + track' adds acc.clip_grad_norm_(1.0), LinearLR.step() and acc.track('loss', loss)")
        part["steps_counted"] = s.sync_steps
        if not self.cuda:
            part["note"] = ("CPU run: the steps run, but torch.cuda.set_sync_debug_mode needs CUDA, so nothing is counted; "
                            "fp16 stands in as bf16")
        rows: dict[str, Any] = {}
        part["configs"] = rows
        seen: set[str] = set()
        for spec, model, error_mode in specs:
            name = f"{spec.name} [{model}]"
            if name in seen:  # on the CPU, fp16 stands in as bf16: the same config twice
                continue
            seen.add(name)
            if clock.left() < 3:
                rows[name] = {"status": "skipped", "note": "time share spent"}
                continue
            row: dict[str, Any] = {"headline": spec.name == headline, "model": model}
            rows[name] = row
            try:
                loop = Loop(spec, models[model][0], models[model][1], self.device)
                for _ in range(s.sync_warmup):  # optimizer state, cuBLAS handles and caches are created here
                    loop.step()
                sync(self.device)
                row.update(self.count_syncs(loop.step, s.sync_steps))
                if error_mode:
                    row.update(self.error_mode(loop.step, s.sync_steps))
                row["status"] = "ok"
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", error=error_text(exc), where=frames(exc))
                part.setdefault("errors", []).append(f"{name}: {error_text(exc)[:300]}")
            finally:
                self.restore()
            log(f"  syncs: {name}: {self._sync_cell(row)}")
            loop = None  # type: ignore[assignment]
            self.free()
        verdicts = [r.get("error_mode", "error") for r in rows.values() if r.get("headline")]
        if not verdicts:
            part["zero_sync_check"] = "n/a"
        elif any(v not in ("pass", "n/a (CPU)") for v in verdicts):
            part["zero_sync_check"] = "FAIL" if "FAIL" in verdicts else "incomplete"
        else:
            part["zero_sync_check"] = verdicts[0] if len(set(verdicts)) == 1 else "incomplete"

    def count_syncs(self, step: Callable[[], None], steps: int) -> dict[str, Any]:
        """Blocking syncs per step, counted as the warnings of set_sync_debug_mode("warn")."""
        if not self.cuda:
            for _ in range(steps):
                step()
            return {"syncs_per_step": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sync(self.device)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        return {"syncs_per_step": len(syncs) / steps, "sync_sites": dict(where.most_common(5))}

    def error_mode(self, step: Callable[[], None], steps: int) -> dict[str, Any]:
        """Run `steps` steps under set_sync_debug_mode("error"): "pass" if none raised."""
        if not self.cuda:
            return {"error_mode": "n/a (CPU)"}
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(steps):
                step()
        except RuntimeError as exc:
            return {"error_mode": "FAIL", "error_mode_error": error_text(exc), "error_mode_where": frames(exc, 8)}
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sync(self.device)
        return {"error_mode": "pass"}

    @staticmethod
    def _sync_cell(row: dict[str, Any]) -> str:
        if row.get("status") != "ok":
            return f"{row.get('status')}: {row.get('error', row.get('note', ''))[:200]}"
        n = row.get("syncs_per_step")
        text = "n/a (CPU)" if n is None else f"{n:g} sync(s)/step"
        if "error_mode" in row:
            text += f", mode 'error': {row['error_mode']}"
        return text

    # 1. precision on the transformer -----------------------------------------------------------------
    def precision_specs(self) -> list[Spec]:
        specs = [
            Spec("hand-written fp32", group="fp32"),
            Spec("hand-written fp32 + TF32 matmuls", tf32=True, group="tf32"),
            Spec("hand-written bf16 autocast", autocast=torch.bfloat16, group="bf16"),
            Spec("hand-written fp16 autocast + GradScaler", autocast=torch.float16, grad_scaler=True, group="fp16"),
            Spec("ampkit bf16-mixed", precision="bf16-mixed", group="bf16"),
            Spec("ampkit fp16-mixed", precision="fp16-mixed", group="fp16"),
            Spec("ampkit bf16-master", precision="bf16-master", group="bf16"),
            Spec("ampkit bf16-true", precision="bf16-true", group="bf16"),
        ]
        return [sp for sp in specs if self.fp16 or sp.group != "fp16"]

    def part_precision(self, part: dict[str, Any], clock: Clock) -> None:
        s = self.sizes
        part["model"] = {"kind": "nn.TransformerEncoder", "layers": s.layers, "d_model": s.d_model, "nhead": max(1, s.d_model // 64),
                         "ffn": 4 * s.d_model, "seq": s.seq, "batch": s.batch}
        part["optimizer"] = "AdamW(lr=1e-4, fused=True)"
        part["method"] = (f"interleaved rounds of {s.steps} step(s) per variant, {s.warmup_rounds} warm-up round(s) dropped, "
                          f"median per step; {'CUDA events' if self.cuda else 'perf_counter'}; each variant's peak memory measured "
                          f"over its first {s.warmup_steps} steps above what was allocated before it was built")
        if not self.fp16:
            part["note"] = "CPU run: fp16 variants left out"
        flops = encoder_flops(s.d_model, s.layers, s.seq, s.batch)
        part["flops_per_step"] = flops
        data = make_batches((s.seq, s.d_model), s.batch, self.device)
        self.data = data
        variants: dict[str, Any] = {}
        part["variants"] = variants
        biggest = 0
        for spec in self.precision_specs():
            if clock.left() < 0.4 * clock.share():  # keep most of the share for timing what is built
                variants[spec.name] = {"status": "skipped", "note": "time share too low to build it"}
                continue
            free = free_bytes(self.device)
            if free is not None and biggest and free < 1.3 * biggest + 4 * GIB:
                variants[spec.name] = {"status": "skipped", "note": f"memory: {free / GIB:.1f} GiB free, the largest variant so far "
                                                                    f"peaked at {biggest / GIB:.1f} GiB"}
                log(f"  {spec.name}: skipped ({variants[spec.name]['note']})")
                continue
            log(f"  building {spec.name}")
            try:
                loop, info = build_and_warm(spec, lambda: Encoder(s.d_model, s.layers), data, self.device, s.warmup_steps)
            except Exception as exc:  # noqa: BLE001
                variants[spec.name] = {"status": "error", "error": error_text(exc), "where": frames(exc)}
                part.setdefault("errors", []).append(f"{spec.name}: {error_text(exc)[:300]}")
                log(f"  {spec.name}: FAILED {error_text(exc)[:300]}")
                self.free(keep_loops=True)
                continue
            biggest = max(biggest, info.get("peak_bytes", 0))
            self.loops[spec.name] = loop
            variants[spec.name] = {"status": "ok", "group": spec.group, **info}
            log(f"  {spec.name}: first step {info['first_step_s']:.2f} s"
                + (f", peak {info['peak_gib']:.2f} GiB" if "peak_gib" in info else ""))
        if not self.loops:
            raise RuntimeError("no variant could be built")
        log(f"  timing {len(self.loops)} variants: up to {s.rounds} rounds of {s.steps} step(s) each")
        times, measured = self.measure(self.loops, s.rounds, s.steps, clock, variants, part)
        part["rounds_measured"] = measured
        self.times.update(times)
        self.summarise(part, variants, times, flops)

    def measure(self, loops: dict[str, Loop], rounds: int, steps: int, clock: Clock, variants: dict[str, Any],
                part: dict[str, Any]) -> tuple[dict[str, list[float]], int]:
        def failed(name: str, exc: BaseException) -> None:
            variants[name].update(status="error", error=error_text(exc), where=frames(exc))
            part.setdefault("errors", []).append(f"{name}: {error_text(exc)[:300]}")
            log(f"  {name}: FAILED while timing: {error_text(exc)[:300]}")

        return interleaved_events({n: l.step for n, l in loops.items()}, rounds, steps, self.sizes.warmup_rounds,
                                  self.device, clock, failed)

    def summarise(self, part: dict[str, Any], variants: dict[str, Any], times: dict[str, list[float]], flops: float,
                  fp32: list[float] | None = None) -> None:
        med = medians(times)
        same_rounds = fp32 is None  # fp32 timed in these rounds: a paired ratio; else a ratio of medians
        fp32 = fp32 if fp32 is not None else times.get("hand-written fp32")
        base = statistics.median(fp32) if fp32 else None
        bf16 = times.get("hand-written bf16 autocast")
        peaks = self.peaks()
        for name, ts in times.items():
            if not ts:
                continue
            v = variants[name]
            m = med[name]
            v.update(step_ms=m * 1e3, rounds_ms=[t * 1e3 for t in ts], spread=fnum(spread(ts)),
                     samples_per_s=self.sizes.batch / m, est_tflops=flops / m / 1e12)
            if fp32 and base:
                v["speedup_vs_fp32"] = paired_ratio(fp32, ts) if same_rounds and len(fp32) == len(ts) else base / m
            if bf16 and len(bf16) == len(ts):
                v["speedup_vs_hand_bf16"] = paired_ratio(bf16, ts)
            if peaks and v.get("group") in peaks:
                v["est_fraction_of_peak"] = v["est_tflops"] / peaks[v["group"]]

    # 1b. compile=True ------------------------------------------------------------------------------
    def part_compiled(self, part: dict[str, Any], clock: Clock) -> None:
        s = self.sizes
        prec = self.results["precision"].get("variants", {})
        eager = {n: v for n, v in prec.items() if n.startswith("ampkit") and v.get("step_ms")}
        order = sorted((n for n in eager if n in ("ampkit bf16-true", "ampkit bf16-master")), key=lambda n: eager[n]["step_ms"])
        order = ([*order[:1], "ampkit bf16-mixed"] if order else ["ampkit bf16-true", "ampkit bf16-mixed"])[: s.compiled_variants]
        part["compile"] = repr(self.compile_opt) if self.compile_opt is not True else "True (inductor, default mode)"
        part["method"] = ("each compiled variant is timed interleaved with its eager self (still built from the precision part); "
                          "compile time = acc.compile_stats (first forward + first backward), reported apart from the step")
        variants: dict[str, Any] = {}
        part["variants"] = variants
        built: dict[str, Loop] = {}
        if self.data is None:
            self.data = make_batches((s.seq, s.d_model), s.batch, self.device)
        for base_name in order:
            name = f"{base_name} + compile"
            if clock.left() < self.budget.compile_min:
                variants[name] = {"status": "skipped", "note": f"{clock.left():.0f} s left in the share, a compile needs "
                                                               f"~{self.budget.compile_min:.0f} s"}
                log(f"  {name}: skipped ({variants[name]['note']})")
                continue
            spec = Spec(name, precision=base_name.split(" ", 1)[1], compile=self.compile_opt, group="bf16")
            log(f"  building {name} (the first steps compile)")
            try:
                loop, info = build_and_warm(spec, lambda: Encoder(s.d_model, s.layers), self.data, self.device, s.warmup_steps)
            except Exception as exc:  # noqa: BLE001
                variants[name] = {"status": "error", "error": error_text(exc), "where": frames(exc)}
                part.setdefault("errors", []).append(f"{name}: {error_text(exc)[:300]}")
                log(f"  {name}: FAILED {error_text(exc)[:300]}")
                self.free(keep_loops=True)
                continue
            variants[name] = {"status": "ok", "group": "bf16", "eager": base_name, **info}
            c = info.get("compile", {})
            log(f"  {name}: compile {c.get('first_step_extra_s', 0):.1f} s (forward {c.get('first_forward_s')}, backward "
                f"{c.get('first_backward_s')}), fallback: {c.get('fallback')}")
            if c.get("fallback"):
                part.setdefault("errors", []).append(f"{name}: fell back to eager: {c['fallback']}")
            built[name] = loop
        if not built:
            return
        loops: dict[str, Loop] = {}
        if "hand-written bf16 autocast" in self.loops:  # in the same rounds: a paired ratio for the compiled modes
            loops["hand-written bf16 autocast"] = self.loops["hand-written bf16 autocast"]
        for name, loop in built.items():
            eager_name = variants[name]["eager"]
            if eager_name in self.loops:
                loops[eager_name] = self.loops[eager_name]
            loops[name] = loop
        for n in loops:
            variants.setdefault(n, {"status": "ok", "group": "bf16", "reference": True})
        log(f"  timing {len(loops)} variants: up to {s.rounds} rounds")
        times, measured = self.measure(loops, s.rounds, s.steps, clock, variants, part)
        part["rounds_measured"] = measured
        flops = self.results["precision"].get("flops_per_step") or encoder_flops(s.d_model, s.layers, s.seq, s.batch)
        self.summarise(part, variants, times, flops, fp32=self.times.get("hand-written fp32"))
        for name in built:
            eager_name = variants[name]["eager"]
            if times.get(eager_name) and times.get(name) and len(times[eager_name]) == len(times[name]):
                variants[name]["speedup_vs_eager"] = paired_ratio(times[eager_name], times[name])

    # 3. launch-bound ---------------------------------------------------------------------------------
    def part_launch(self, part: dict[str, Any], clock: Clock) -> None:
        s = self.sizes
        precision = "bf16-mixed"
        specs = [
            Spec("hand-written fp32", group="fp32"),
            Spec("hand-written bf16 autocast", autocast=torch.bfloat16, group="bf16"),
            Spec("ampkit bf16-mixed", precision=precision, group="bf16"),
            Spec("ampkit bf16-mixed + compile", precision=precision, compile=self.compile_opt, group="bf16"),
            Spec("ampkit bf16-mixed + cuda_graphs", precision=precision, cuda_graphs=True, group="bf16"),
        ]
        part["model"] = f"MLP {s.mlp_layers}×{s.mlp_width} (ReLU) → 8, batch {s.mlp_batch}; AdamW(fused=True)"
        part["method"] = (f"interleaved rounds of {s.launch_steps} steps, {s.warmup_rounds + 1} warm-up round(s) dropped, median "
                          f"per step ({'CUDA events: the device clock, idle gaps between launches included' if self.cuda else 'perf_counter'})")
        data = make_batches((s.mlp_width,), s.mlp_batch, self.device, n=4)
        variants: dict[str, Any] = {}
        part["variants"] = variants
        loops: dict[str, Loop] = {}
        skips = _cudagraph_skips()
        for spec in specs:
            need = self.budget.launch_compile_min if (spec.compile or spec.cuda_graphs) else 3.0
            if clock.left() < need:
                variants[spec.name] = {"status": "skipped", "note": f"{clock.left():.0f} s left in the share, it needs {need:.0f} s"}
                log(f"  {spec.name}: skipped ({variants[spec.name]['note']})")
                continue
            log(f"  building {spec.name}")
            try:
                loop, info = build_and_warm(spec, lambda: mlp(s.mlp_width, s.mlp_layers), data, self.device, s.launch_warmup)
            except Exception as exc:  # noqa: BLE001
                cpu_only = spec.cuda_graphs and not self.cuda
                variants[spec.name] = {"status": "skipped" if cpu_only else "error", "error": error_text(exc)}
                if not cpu_only:
                    variants[spec.name]["where"] = frames(exc)
                    part.setdefault("errors", []).append(f"{spec.name}: {error_text(exc)[:300]}")
                log(f"  {spec.name}: {'skipped (CUDA only)' if cpu_only else 'FAILED'}: {error_text(exc)[:200]}")
                continue
            variants[spec.name] = {"status": "ok", "group": spec.group, **info}
            loops[spec.name] = loop
        times, measured = interleaved_events({n: l.step for n, l in loops.items()}, s.launch_rounds, s.launch_steps,
                                             s.warmup_rounds + 1, self.device, clock, self._failed(variants, part))
        part["rounds_measured"] = measured
        med = medians(times)
        hand = times.get("hand-written bf16 autocast")
        for name, ts in times.items():
            if not ts:
                continue
            v = variants[name]
            v.update(step_ms=med[name] * 1e3, spread=fnum(spread(ts)))
            if hand and len(hand) == len(ts):
                v["speedup_vs_hand_bf16"] = paired_ratio(hand, ts)
            if times.get("hand-written fp32") and len(times["hand-written fp32"]) == len(ts):
                v["speedup_vs_hand_fp32"] = paired_ratio(times["hand-written fp32"], ts)
        if self.cuda and skips is not None:  # graphs inductor declined to record (why: its perf-hint log)
            part["cudagraph_skips"] = (_cudagraph_skips() or 0) - skips

    @staticmethod
    def _failed(variants: dict[str, Any], part: dict[str, Any]) -> Callable[[str, BaseException], None]:
        def failed(name: str, exc: BaseException) -> None:
            variants[name].update(status="error", error=error_text(exc), where=frames(exc))
            part.setdefault("errors", []).append(f"{name}: {error_text(exc)[:300]}")
            log(f"  {name}: FAILED while timing: {error_text(exc)[:300]}")
        return failed

    # --- the whole run --------------------------------------------------------------------------------
    def run(self) -> None:
        b = self.budget
        log(f"gpu_check on {self.device} ({self.results['meta'].get('gpu', {}).get('name', 'CPU')}), budget {self.deadline:.0f} s, "
            f"parts {','.join(self.args.parts)}")
        torch.set_float32_matmul_precision("highest")
        if self.cuda:
            torch.cuda.init()
        self.run_part("syncs", "syncs", b.syncs, self.part_syncs)
        try:
            self.run_part("precision", "precision", b.precision, self.part_precision, min_s=20.0 if self.cuda else 2.0)
            # compile gets what is left once the launch-bound part's share is put aside
            compiled_share = self.deadline - b.slack - elapsed() - (b.launch if "launch" in self.args.parts else 0.0)
            self.run_part("compiled", "compiled", compiled_share, self.part_compiled,
                          min_s=b.compile_min)
        finally:
            self.free()
            with contextlib.suppress(Exception):
                torch._dynamo.reset()
        self.run_part("launch", "launch_bound", b.launch, self.part_launch, min_s=15.0 if self.cuda else 2.0)
        self.finish()

    def finish(self) -> None:
        r = self.results
        r["budget"]["elapsed_s"] = round(elapsed(), 1)
        allv = {**r["precision"].get("variants", {}), **{k: v for k, v in r["compiled"].get("variants", {}).items()
                                                           if not v.get("reference")}}
        ampkit_v = {n: v for n, v in allv.items() if n.startswith("ampkit") and v.get("step_ms")}
        summary = r["summary"]
        if ampkit_v:
            best = min(ampkit_v, key=lambda n: ampkit_v[n]["step_ms"])
            summary["best_ampkit"] = {"variant": best, "step_ms": ampkit_v[best]["step_ms"],
                                      "speedup_vs_fp32": ampkit_v[best].get("speedup_vs_fp32"),
                                      "speedup_vs_hand_bf16": ampkit_v[best].get("speedup_vs_hand_bf16")}
        summary["zero_sync_check"] = r["syncs"].get("zero_sync_check", "n/a")
        summary["parts"] = {k: r[k].get("status") for k in ("syncs", "precision", "compiled", "launch_bound")}
        self.write()
        print()
        print("\n".join(self.table(markdown=False)), flush=True)
        if self.out:
            log(f"wrote {self.out / 'gpu_check.json'} and {self.out / 'gpu_check.md'}")

    # --- output ----------------------------------------------------------------------------------------
    def write(self) -> None:
        if not self.out:
            return
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self.results["budget"]["elapsed_s"] = round(elapsed(), 1)
            for name, text in (("gpu_check.json", json.dumps(finite(self.results), indent=1, default=str, allow_nan=False)),
                               ("gpu_check.md", "\n".join(self.table(markdown=True)) + "\n")):
                tmp = self.out / (name + ".tmp")
                tmp.write_text(text)
                tmp.replace(self.out / name)
        except Exception as exc:  # noqa: BLE001 - never lose the run over the output files
            log(f"could not write to {self.out}: {error_text(exc)}")

    def table(self, markdown: bool) -> list[str]:
        """The short tables: terminal text (printed last) or markdown (gpu_check.md)."""
        r, meta = self.results, self.results["meta"]

        def tab(head: list[str], rows: list[list[str]], notes: list[str]) -> list[str]:
            if not rows:
                return []
            if markdown:
                lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|",
                         *("| " + " | ".join(row) + " |" for row in rows)]
            else:
                widths = [max(len(x) for x in col) for col in zip(head, *rows)]
                fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
                lines = [fmt(head), *(fmt(row) for row in rows)]
            return lines + ([""] if markdown and notes else []) + [f"- {n}" for n in notes]

        def f(x: Any, spec: str, suffix: str = "") -> str:
            return "—" if x is None else f"{x:{spec}}{suffix}"

        def status(part: dict[str, Any]) -> str:
            st = part.get("status", "?")
            if part.get("error"):
                return f"{st}: {part['error'][:200]}"
            if st == "skipped":
                return f"{st}: {part.get('note', '')}"
            return st

        def unmeasured(name: str, v: dict[str, Any], notes: list[str]) -> str:
            why = v.get("error") or v.get("note")
            if why:
                notes.append(f"{name}: {v.get('status')}: {why[:300]}")
            return v.get("status", "?")

        h = "### " if markdown else "== "
        gpu = meta.get("gpu", {})
        out = [("# " if markdown else "") + f"ampkit gpu_check — {gpu.get('name', meta['device'])}, torch {meta['torch']}"
               + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "") + (" (dry run: CPU, tiny sizes)" if meta["dry_run"] else ""),
               f"{meta['date']}; `{meta['command']}`; {r['budget'].get('elapsed_s')} s of {r['budget']['total_s']:.0f} s", ""]

        p, c = r["precision"], r["compiled"]
        m = p.get("model", {})
        out.append(h + "1. " + (f"precision: transformer encoder, {m.get('layers')} layers, d_model {m.get('d_model')}, "
                                f"seq {m.get('seq')}, batch {m.get('batch')}" if m else "precision")
                   + f" — {status(p)}; compile=True: {status(c)}")
        rows, notes = [], []
        for name, v in [*p.get("variants", {}).items(), *((n, v) for n, v in c.get("variants", {}).items() if not v.get("reference"))]:
            comp = v.get("compile", {}).get("first_step_extra_s")
            if v.get("step_ms") is None:
                rows.append([name, unmeasured(name, v, notes), "", f(v.get("peak_gib"), ".2f"), "", "", f(comp, ".1f", " s")])
                continue
            rows.append([name, f(v["step_ms"], ".2f"), f(v.get("samples_per_s"), ".0f"), f(v.get("peak_gib"), ".2f"),
                         f(v.get("speedup_vs_fp32"), ".2f", "×"), f(v.get("est_tflops"), ".3g")
                         + (f" ({v['est_fraction_of_peak']:.0%})" if v.get("est_fraction_of_peak") is not None else ""),
                         f(comp, ".1f", " s")])
            if v.get("compile", {}).get("fallback"):
                notes.append(f"{name}: fell back to eager: {v['compile']['fallback'][:300]}")
        out += tab(["variant", "ms/step", "samples/s", "peak GiB", "vs fp32", "TFLOP/s", "compile"], rows, notes)
        best = r["summary"].get("best_ampkit")
        if best:
            out.append(f"best ampkit mode: {best['variant']} — {f(best.get('speedup_vs_fp32'), '.2f', '×')} fp32, "
                       f"{f(best.get('speedup_vs_hand_bf16'), '.2f', '×')} the hand-written bf16 autocast loop")
        out.append("")

        sy = r["syncs"]
        out.append(h + f"2. blocking syncs per step — {status(sy)}; zero-sync check (fp16-mixed, fused AdamW, mode 'error'): "
                   f"{sy.get('zero_sync_check', 'n/a')}")
        rows, notes = [], []
        for name, v in sy.get("configs", {}).items():
            if v.get("status") != "ok":
                rows.append([name, unmeasured(name, v, notes), ""])
                continue
            n = v.get("syncs_per_step")
            rows.append([name, "n/a (CPU)" if n is None else f"{n:g}", v.get("error_mode", "")])
            if v.get("error_mode") == "FAIL":
                notes.append(f"{name}: mode 'error' raised: {v.get('error_mode_error', '')[:200]} at {' < '.join(reversed(v.get('error_mode_where', [])[-3:]))}")
            if v.get("sync_sites"):
                notes.append(f"{name}: syncs at " + ", ".join(f"{k} ×{c}" for k, c in v["sync_sites"].items()))
        out += tab(["config", "syncs/step", "mode 'error'"], rows, notes)
        out.append("")

        lb = r["launch_bound"]
        out.append(h + f"3. launch-bound: {lb.get('model', 'MLP')} — {status(lb)}")
        rows, notes = [], []
        for name, v in lb.get("variants", {}).items():
            comp = v.get("compile", {}).get("first_step_extra_s")
            if v.get("step_ms") is None:
                rows.append([name, unmeasured(name, v, notes), "", "", ""])
                continue
            rows.append([name, f(v["step_ms"], ".3f"), f(v.get("speedup_vs_hand_bf16"), ".2f", "×"),
                         f(v.get("speedup_vs_hand_fp32"), ".2f", "×"), f(comp, ".1f", " s")])
            if v.get("compile", {}).get("fallback"):
                notes.append(f"{name}: fell back to eager: {v['compile']['fallback'][:300]}")
        if lb.get("cudagraph_skips"):
            notes.append(f"inductor declined to record {lb['cudagraph_skips']} graph(s) as CUDA graphs (see its perf hints)")
        out += tab(["variant", "ms/step", "vs hand bf16", "vs hand fp32", "compile"], rows, notes)
        out.append("")

        out.append(h + "time (s)")
        out += tab(["part", "share", "used"], [[k, f(v.get("share_s"), ".0f"), f(v.get("used_s"), ".1f")]
                                              for k, v in r["budget"]["parts"].items()], [])
        return out


def _cudagraph_skips() -> int | None:
    """Inductor's count of graphs it declined to record as CUDA graphs (a private counter; None if absent)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001
        return None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the whole script on the CPU with tiny sizes, fp32/bf16 only (= --device cpu --tiny)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and few rounds (a smoke run)")
    ap.add_argument("--size", default=None, help="the transformer as d_model,layers,seq,batch (default 1024,8,512,64)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 420; dry run 120)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--out", default=None, help="folder for gpu_check.json and gpu_check.md (default: $OUT, if set)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.tiny = "cpu", True
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    if args.budget is None:
        args.budget = 120.0 if args.tiny else 420.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to check (python benchmarks/gpu_check.py --dry-run runs it on the CPU)", flush=True)
            return 0
        args.device = "cuda"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", flush=True)
        return 0
    # A preset that runs slowly on this CPU warns once per Accelerator: said once here instead.
    warnings.filterwarnings("ignore", message=r".*runs far slower than fp32.*")
    signal.signal(signal.SIGALRM, _alarm)
    signal.signal(signal.SIGTERM, _term)
    if args.device == "cpu" and args.tiny:
        torch.set_num_threads(1)  # tiny ops gain nothing from threads, and a shared CPU makes them wait for each other
    check = Check(args)
    try:
        check.run()
    except Terminated:
        log("terminated from outside: the figures so far follow")
        check.finish()
        return 143
    except BaseException:
        check.finish()  # a bug of this script's own: still leave the others' figures
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
