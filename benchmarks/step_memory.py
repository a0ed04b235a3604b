"""Peak memory of one training step, per precision preset, one process per preset.

    PYTHONPATH=src python benchmarks/step_memory.py                 # print the table
    PYTHONPATH=src python benchmarks/step_memory.py --write         # and put it in RESULTS.md (3 runs each)

The model is a 50M-parameter stack (embedding 4096 x 2048, 8 x [LayerNorm, Linear 2048 x 2048,
GELU], head 2048 -> 4096), trained with AdamW on batches of 512 tokens. Each preset runs in a fresh
process: its resident memory is read before the model is built, three steps run (the optimizer's
state exists from the first), the kernel's high-water mark is reset (/proc/self/clear_refs), and
one more step (backward, optimizer step, zero_grad) runs. The figure is that step's peak resident
memory minus the memory before the model. Before that reading, three steps of the same stack at
width 64 (0.04M parameters) run with the same preset and are deleted: the code and thread pools
that torch's CPU kernels load at their first use (40-115 MiB here, once per process, whatever the
model) are then in the baseline, not in the step's figure. The "cold" column measures without that
warm-up. Beside them, the bytes per parameter held at rest: weights, optimizer state and ampkit's
own buffers (fp32 masters, Kahan buffers) after zero_grad, and the same with the gradients a
backward leaves.

    PYTHONPATH=src python benchmarks/step_memory.py --traffic       # bytes the update moves, per parameter
    PYTHONPATH=src python benchmarks/step_memory.py --live          # live tensor bytes at the peak, per preset

`--live` counts live tensor bytes instead of resident memory (ampkit plan's tracker, on fake tensors:
seconds on any CPU, no allocator or library pages in the figure): the peak of the 4th step alone (a
steady-state step) and of the first two steps (where the optimizer makes its state), with what held
the bytes at the steady-state peak.

`--traffic` counts, for one steady-state `optimizer.step()` per preset (AdamW as torch picks it on
the CPU, a 4 x Linear(1024, 1024) model: several chunks of ampkit's update), the bytes each aten op
reads and writes (its tensor inputs and outputs; views move nothing; `copy_` does not read what it
overwrites), per model parameter, split into memory that lives between steps (weights, gradients,
optimizer state, Kahan buffers: what the step must stream from and to RAM) and the rest (ampkit's
chunk-sized workspace, the optimizer's temporaries). Op counts are per step. The figures follow
from the code path alone, so they hold on any CPU (the CPU kernels' own casting temporaries inside
an op with mixed dtypes are not seen).
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
from ampkit.tools.compare.memory import proc_status, reset_peak_rss  # noqa: E402  # the /proc readings ampkit compare uses

PRESETS = ("fp32", "bf16-mixed", "bf16-master", "bf16-true")
VOCAB, WIDTH, LAYERS, BATCH = 4096, 2048, 8, 512


def model(vocab: int = VOCAB, width: int = WIDTH) -> nn.Module:
    layers: list[nn.Module] = [nn.Embedding(vocab, width)]
    for _ in range(LAYERS):
        layers += [nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, vocab))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def child(preset: str, warm: bool = True, small: bool = False) -> dict[str, float]:
    """One preset's figures in this process; `small`: the stack at vocabulary 1024 and width 512 (3M parameters),
    for `python -m benchmarks --quick`, whose bf16 steps would otherwise take minutes on a CPU without bf16."""
    import gc

    import ampkit

    vocab, width = (1024, 512) if small else (VOCAB, WIDTH)
    torch.manual_seed(0)
    x, y = torch.randint(0, vocab, (BATCH,)), torch.randint(0, vocab, (BATCH,))
    if warm:  # the kernels' first-use memory goes into the baseline (see the docstring)
        tiny, tiny_acc = model(vocab=64, width=64), ampkit.Accelerator(preset, device="cpu")
        tiny, tiny_opt = tiny_acc.prepare(tiny, torch.optim.AdamW(tiny.parameters(), lr=1e-4))
        for _ in range(3):
            tiny_acc.backward(nn.functional.cross_entropy(tiny(x % 64), y % 64))
            tiny_opt.step()
            tiny_opt.zero_grad()
        del tiny, tiny_acc, tiny_opt
        gc.collect()
    before = proc_status("VmRSS") or 0
    net = model(vocab, width)
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
    return {
        "params": n,
        "peak_mib": (peak - before) / 2**20,
        "rest_bpp": (weights + state + store) / n,
        "rest_grads_bpp": (weights + state + store + grads) / n,
    }


def traffic(preset: str, layers: int = 4, width: int = 1024) -> dict[str, float]:
    """Bytes read + written per parameter by one steady-state optimizer step (see the module docstring)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import ampkit

    def nbytes(value: object) -> int:
        items = value if isinstance(value, (list, tuple)) else [value]
        return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))

    class Count(TorchDispatchMode):
        def __init__(self, persistent: set[int]) -> None:
            super().__init__()
            self.persistent = persistent  # storages that live between steps
            self.by_dtype: dict[str, int] = {}
            self.by_op: dict[str, int] = {}
            self.ops = 0

        def add(self, value: object, op: str) -> None:
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor):
                    key = "persistent" if t.untyped_storage().data_ptr() in self.persistent else "workspace"
                    self.by_dtype[key] = self.by_dtype.get(key, 0) + nbytes(t)
                    self.by_op[op] = self.by_op.get(op, 0) + nbytes(t)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            schema = func._schema
            if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
                return out  # a view: no data moves
            self.ops += 1
            name = func.overloadpacket.__name__
            given = dict(zip((a.name for a in schema.arguments), args)) | kwargs
            for arg in schema.arguments:
                value = given.get(arg.name)
                written = arg.alias_info is not None and arg.alias_info.is_write
                if not (written and name in ("copy_", "_foreach_copy_", "copy")):
                    self.add(value, name)  # read
                if written:
                    self.add(value, name)  # written in place
            if all(r.alias_info is None for r in schema.returns):
                self.add(out, name)  # a new output
            return out

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    acc = ampkit.Accelerator(preset, device="cpu")
    net, opt = acc.prepare(net, opt)
    x = torch.randn(8, width)
    for step in range(3):
        acc.backward(net(x).square().mean())
        if step < 2:
            opt.step()
        else:
            held = [
                *net.parameters(),
                *(p.grad for p in net.parameters()),
                *(v for st in opt.state.values() for v in st.values()),
                *(opt.weights.exact_state() if opt.weights is not None else []),
            ]
            with Count({t.untyped_storage().data_ptr() for t in held if isinstance(t, torch.Tensor)}) as count:
                opt.step()
        opt.zero_grad()
    n = sum(p.numel() for p in net.parameters())
    return {
        "params": n,
        "ops": count.ops,
        "bpp": sum(count.by_dtype.values()) / n,
        **{f"bpp_{k}": v / n for k, v in sorted(count.by_dtype.items())},
        "top": ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(count.by_op.items(), key=lambda kv: -kv[1])[:6]),
    }


def live(preset: str) -> str:
    """Live tensor bytes at the peak of a steady-state step and of the first two steps (see the docstring)."""
    from ampkit.tools.plan.step import measure

    torch.manual_seed(0)
    batch = (torch.randint(0, VOCAB, (BATCH,)), torch.randint(0, VOCAB, (BATCH,)))
    args = (model, batch, lambda p: torch.optim.AdamW(p, lr=1e-4), preset, torch.device("cpu"))
    kw = {"fake": True, "batch_size": BATCH, "loss_fn": nn.functional.cross_entropy}
    steady, first = measure(*args, **kw, steps=4, last_only=True), measure(*args, **kw)
    held = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in steady.components.items() if v)
    return f"{steady.peak / 2**20:.0f} MiB in the {steady.phase} ({held}); first two steps {first.peak / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument(
        "--repeat", type=int, default=3, help="processes per preset (the table shows the median and range)"
    )
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    parser.add_argument("--note", default="", help="a line written under the table (e.g. the load average)")
    parser.add_argument("--traffic", action="store_true", help="print the bytes one optimizer step moves per parameter")
    parser.add_argument("--live", action="store_true", help="print live tensor bytes at the peak (fake tensors, fast)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # --child at 3M parameters
    args = parser.parse_args()
    if args.live:
        print(f"live tensor bytes at the peak, 50M stack, AdamW, batch {BATCH} ({machine()}):")
        for preset in args.presets.split(","):
            print(f"- {preset}: {live(preset)}")
        return
    if args.traffic:
        print(f"bytes read + written per parameter by one AdamW step ({machine()}):")
        for preset in args.presets.split(","):
            r = traffic(preset)
            split = ", ".join(f"{k[4:]} {r.get(k, 0):.1f}" for k in ("bpp_persistent", "bpp_workspace"))
            print(f"- {preset}: {r['bpp']:.1f} B/param ({split}); {r['ops']} aten ops; largest: {r['top']}")
        return
    if args.child:
        preset, _, kind = args.child.partition(":")
        print(json.dumps(child(preset, warm=kind != "cold", small=args.small)))
        return
    rows, peaks, colds = {}, {}, {}
    for preset in args.presets.split(","):
        for _ in range(args.repeat):
            for kind, into in (("cold", colds), ("warm", peaks)):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", f"{preset}:{kind}"],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rows[preset] = json.loads(out.stdout.strip().splitlines()[-1])
                into.setdefault(preset, []).append(rows[preset]["peak_mib"])
        rows[preset]["peak_mib"], rows[preset]["cold_mib"] = (
            statistics.median(peaks[preset]),
            statistics.median(colds[preset]),
        )
    fp32, fp32_cold = rows.get("fp32", {}).get("peak_mib"), rows.get("fp32", {}).get("cold_mib")
    lines = [
        "### Peak memory of a training step, per preset (`benchmarks/step_memory.py`)",
        "",
        f"`python benchmarks/step_memory.py --repeat {args.repeat}` — {machine()}",
        "",
        f"{next(iter(rows.values()))['params'] / 1e6:.1f}M parameters, AdamW, batch {BATCH}; {args.repeat} processes "
        "per preset and column, median (range) of the peak: the allocator's reuse of freed memory moves it by tens "
        "of MiB. Cold: no warm-up, so the kernels' first-use memory (once per process) counts in the step.",
        "",
        "| preset | peak step memory (MiB) | vs fp32 | cold (MiB) | cold vs fp32 | at rest (B/param) "
        "| with gradients (B/param) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for preset, r in rows.items():
        ratio = f"{r['peak_mib'] / fp32:.2f}×" if fp32 else "–"
        cold = f"{r['cold_mib'] / fp32_cold:.2f}×" if fp32_cold else "–"
        span = f"{min(peaks[preset]):.0f}–{max(peaks[preset]):.0f}"
        cold_span = f"{min(colds[preset]):.0f}–{max(colds[preset]):.0f}"
        lines.append(
            f"| {preset} | {r['peak_mib']:.0f} ({span}) | {ratio} | {r['cold_mib']:.0f} ({cold_span}) | {cold} "
            f"| {r['rest_bpp']:.1f} | {r['rest_grads_bpp']:.1f} |"
        )
    if args.note:
        lines += ["", args.note]
    print("\n".join(lines))
    if args.write:
        write_section(
            Path(__file__).parent / "RESULTS.md", "<!-- step_memory:start -->", "<!-- step_memory:end -->", lines
        )


if __name__ == "__main__":
    main()
