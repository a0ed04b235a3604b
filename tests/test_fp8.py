"""fp8-mixed: torchao float8 training for the large nn.Linear layers, emulated on this CPU.

The emulation rounds every fp8 operand exactly as the fp8 kernels do (then multiplies in high
precision), so the whole path (layer choice, training, checkpoints) is tested here; the speed
claims are the GPU tests at the end, skipped without a CUDA device of compute capability >= 8.9.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

import ampkit  # noqa: E402
from ampkit.errors import PrecisionError  # noqa: E402
from ampkit.precision.fp8 import MIN_WEIGHT, choose_layers  # noqa: E402
from ampkit.tools.tasks import tiny_lm  # noqa: E402
from conftest import assert_bitwise_equal, params_of  # noqa: E402

T, B = 16, 16  # context and batch of the CPU runs: bf16 has no instructions on this CPU, so keep it tiny
EMULATED = dict(device="cpu", fp8_emulate=True, fp8_min_weight=0)  # every layer the rest of the rule allows


def lm(seed: int = 0, d_model: int = 32, block: int = T, n_layers: int = 2, n_heads: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return tiny_lm.TinyLM(vocab=256, block=block, d_model=d_model, n_heads=n_heads, n_layers=n_layers)


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` batches of tiny-lm's own data (Python stdlib source, bytes), cut to the context T."""
    loader = tiny_lm.make_data(seed, B).train_loader
    return [(x[:, :T], y[:, :T]) for _, (x, y) in zip(range(n), loader)]


def run(acc: ampkit.Accelerator, model: nn.Module, opt, data, clip: float | None = None) -> list[float]:
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        acc.backward(loss)
        if clip is not None:
            acc.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return [float(v) for v in losses]  # sync: once, after the run


def prepared(precision: str, seed: int = 0, **kw):
    kw = {**(EMULATED if precision == "fp8-mixed" else {"device": "cpu"}), **kw}
    acc = ampkit.Accelerator(precision, **kw)
    model = lm(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


# --- which layers run in fp8 ----------------------------------------------------------------------
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 64)  # first Linear: bf16
        self.odd = nn.Linear(64, 72 + 2)  # 74 is no multiple of 16
        self.back = nn.Linear(74, 64)  # in_features 74 either
        self.big = nn.Linear(64, 128)  # 8192 weight elements
        self.small = nn.Linear(64, 32)  # 2048: under the threshold the test passes
        self.kept = nn.Sequential(nn.Linear(32, 64))  # keep_fp32
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)  # its in-proj is no Linear; out_proj a subclass
        self.big2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)  # last Linear: bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.back(self.odd(self.stem(x)))
        x = self.kept(self.small(self.big(x)[..., :64]))
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(self.big2(x))


def test_the_rule_converts_exactly_the_layers_it_names():
    model = Mixed()
    acc = ampkit.Accelerator("fp8-mixed", keep_fp32=["kept"], **{**EMULATED, "fp8_min_weight": 4096})
    params = {n: p for n, p in model.named_parameters()}
    model = acc.prepare(model)
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert fp8 == {"big", "big2"}
    assert {n: p for n, p in model.named_parameters()} == params  # the same parameter objects, same names
    reason = acc.policy.reason
    assert reason.startswith("requested; fp8 (torchao tensorwise, emulated): 2 of 9 Linear layers run in fp8"), reason
    for expected in (
        "2 the model's first or last Linear (stem, head)",
        "2 in/out features not multiples of 16 (odd, back)",
        "1 in·out features under 4,096 (small)",
        "1 kept in fp32 (keep_fp32) (kept.0)",
        "1 a NonDynamicallyQuantizableLinear, not nn.Linear itself (attn.out_proj)",
    ):
        assert expected in reason, reason
    x = torch.randn(4, 5, 64)
    model(x).float().sum().backward()  # the kept and the fp8 layers run and get gradients
    assert model.big.weight.grad is not None and model.kept[0].weight.grad is not None


def test_the_default_threshold_is_a_2048_square_weight():
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(16, 2048),
            nn.Linear(2048, 1024),
            nn.Linear(1024, 2048),
            nn.Linear(2048, 2048),
            nn.Linear(2048, 16),
        )
    assert MIN_WEIGHT == 2048 * 2048
    assert choose_layers(model) == {
        "0": "the model's first or last Linear",
        "1": f"in·out features under {MIN_WEIGHT:,}",
        "2": f"in·out features under {MIN_WEIGHT:,}",
        "3": None,
        "4": "the model's first or last Linear",
    }


def test_a_tiny_lm_at_the_default_threshold_runs_no_layer_in_fp8():
    acc = ampkit.Accelerator("fp8-mixed", device="cpu", fp8_emulate=True)
    model = acc.prepare(lm())
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert "0 of 9 Linear layers run in fp8" in acc.policy.reason


# --- training -------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [60, pytest.param(300, marks=pytest.mark.slow)])
def test_fp8_mixed_trains_tiny_lm_like_bf16_mixed(one_thread, steps):
    data = batches(steps)
    runs = {}
    for precision in ("bf16-mixed", "fp8-mixed"):
        acc, model, opt = prepared(precision)
        runs[precision] = run(acc, model, opt, data)
    fp8 = sum(runs["fp8-mixed"][-10:]) / 10
    bf16 = sum(runs["bf16-mixed"][-10:]) / 10
    assert bf16 < 0.6 * runs["bf16-mixed"][0]  # it learned (5.5 nats at first)
    print(f"after {steps} steps: bf16-mixed {bf16:.4f}, fp8-mixed {fp8:.4f} ({fp8 / bf16 - 1:+.2%})")
    assert abs(fp8 - bf16) <= 0.02 * bf16, (fp8, bf16)
    assert runs["fp8-mixed"] != runs["bf16-mixed"]  # the fp8 rounding did happen


def test_rowwise_recipe_converts_with_rowwise_scales_and_trains(one_thread):
    acc, model, opt = prepared("fp8-mixed", fp8_recipe="rowwise")
    layer = model.blocks[0].mlp[0]
    assert (
        isinstance(layer, Float8Linear)
        and "axiswise" in str(layer.config.cast_config_weight.scaling_granularity).lower()
    )
    assert "torchao rowwise, emulated" in acc.policy.reason
    losses = run(acc, model, opt, batches(4))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def cuda_scaled_mm_rule(real):
    """torch._scaled_mm as CUDA takes it: mat1's columns and both of mat2's dimensions multiples of 16."""

    def scaled_mm(a, b, *args, **kwargs):
        if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
            raise RuntimeError(f"Expected trailing dimension of mat1 to be divisible by 16 ({a.shape} @ {b.shape})")
        return real(a, b, *args, **kwargs)

    return scaled_mm


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_odd_token_count_steps_in_fp8_under_cudas_multiple_of_16_rule(monkeypatch, one_thread, recipe):
    """A partial batch (3·7 = 21 tokens) through ampkit's fp8 conversion, not emulated: this CPU's
    torch._scaled_mm runs the real fp8 matmul, held to CUDA's shape rule. The weight-gradient matmul has the
    tokens as its inner dimension; with torchao's pad_inner_dim set the step runs, and its gradients equal
    those of the same step without the rule and without padding (zeros add nothing)."""
    from torchao.float8 import convert_to_float8_training

    from ampkit.precision.fp8 import Float8Training
    from ampkit.precision.policy import PRESETS

    def grads(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 32))

    x = torch.randn(3, 7, 32)
    fp8 = Float8Training(PRESETS["fp8-mixed"], recipe, emulate=False, min_weight=0)
    model = mlp()
    fp8.convert(model, (), torch.device("cpu"), compiled=False)
    assert isinstance(model[1], Float8Linear) and model[1].config.pad_inner_dim

    def unpadded():  # torchao's own config of the recipe, as main converted it: no padding
        plain = mlp()
        config = type(model[1].config).from_recipe_name(recipe)
        return convert_to_float8_training(plain, config=config, module_filter_fn=lambda _m, fqn: fqn == "1")

    expected = grads(unpadded(), x)
    monkeypatch.setattr(torch, "_scaled_mm", cuda_scaled_mm_rule(torch._scaled_mm))
    with pytest.raises(RuntimeError, match="divisible by 16"):
        grads(unpadded(), x)  # what main's conversion did on a GPU
    for got, want in zip(grads(model, x), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_resume_is_bitwise_with_accumulation_and_clipping(tmp_path, one_thread):
    data = batches(12)
    acc, model, opt = prepared("fp8-mixed", grad_accum_steps=2, divide_loss=True)
    full = run(acc, model, opt, data, clip=1.0)
    weights = params_of(model)

    acc, model, opt = prepared("fp8-mixed", grad_accum_steps=2, divide_loss=True)
    first = run(acc, model, opt, data[:5], clip=1.0)  # stops mid accumulation cycle
    acc.save(tmp_path / "ckpt.pt")
    acc, model, opt = prepared(
        "fp8-mixed", seed=1, grad_accum_steps=2, divide_loss=True
    )  # other initial weights: all must come from the file
    acc.load(tmp_path / "ckpt.pt")
    rest = run(acc, model, opt, data[5:], clip=1.0)
    assert first + rest == full
    assert_bitwise_equal(params_of(model), weights)


def test_checkpoint_round_trips_fp8_mixed_to_bf16_mixed_and_back(tmp_path, one_thread):
    data = batches(4)
    acc, model, opt = prepared("fp8-mixed")
    run(acc, model, opt, data[:2])
    acc.save(tmp_path / "fp8.pt")
    saved = params_of(model)

    acc, model, opt = prepared("bf16-mixed", seed=1)
    acc.load(tmp_path / "fp8.pt")
    assert_bitwise_equal(params_of(model), saved)
    run(acc, model, opt, data[2:])
    acc.save(tmp_path / "bf16.pt")
    saved, moments = params_of(model), [s["exp_avg"].clone() for s in opt.optimizer.state.values()]

    acc, model, opt = prepared("fp8-mixed", seed=2)
    acc.load(tmp_path / "bf16.pt")
    assert isinstance(model.blocks[1].attn.qkv, Float8Linear)
    assert_bitwise_equal(params_of(model), saved)
    assert_bitwise_equal([s["exp_avg"] for s in opt.optimizer.state.values()], moments)
    assert all(torch.isfinite(torch.tensor(run(acc, model, opt, data[:2]))))


DDP_SCRIPT = """
import sys, torch, torch.nn.functional as F, ampkit
sys.path.insert(0, sys.argv[2])
from test_fp8 import EMULATED, batches, lm
acc = ampkit.Accelerator("fp8-mixed", grad_accum_steps=2, divide_loss=True, strategy=sys.argv[3], **EMULATED)
model = lm()
model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
losses = []
for x, y in batches(16, seed=acc.rank):  # each rank its own data
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    acc.backward(loss)
    acc.clip_grad_norm_(1.0)
    opt.step(); opt.zero_grad(); losses.append(float(loss))  # sync: test script
full = [getattr(p, "full_tensor", p.detach)().detach() for p in acc.unwrap(model).parameters()]  # FSDP2: gathered
torch.save({"weights": full, "losses": losses, "reason": acc.policy.reason,
            "fp8": [type(m).__name__ for m in acc.unwrap(model).modules()].count("Float8Linear")},
           f"{sys.argv[1]}/rank{acc.rank}.pt")
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_cpu_ranks_train_fp8_replicas_in_step(tmp_path, strategy):
    """DDP, and FSDP2 with the Float8Linear weights sharded: the ranks end with the same full weights."""
    script = tmp_path / "fp8_ddp.py"
    script.write_text(DDP_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        str(tmp_path),
        str(Path(__file__).parent),
        strategy,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert_bitwise_equal(r0["weights"], r1["weights"])  # the all-reduced fp8 gradients keep the replicas identical
    assert r0["losses"] != r1["losses"] and sum(r0["losses"][-4:]) < sum(r0["losses"][:4]) - 0.2
    assert "7 of 9 Linear layers run in fp8" in r0["reason"] and r0["fp8"] == 7


# --- bad input ------------------------------------------------------------------------------------
def test_without_torchao_the_preset_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what `import torchao` meets where it is not installed
    with pytest.raises(PrecisionError, match=r"needs torchao.*pip install ampkit\[fp8\]"):
        ampkit.Accelerator("fp8-mixed", device="cpu", fp8_emulate=True)


def test_fp8_on_a_cpu_without_emulation_says_why_and_what_works():
    with pytest.raises(PrecisionError, match=r"no fp8 matmul for CPU.*compute capability 8\.9.*fp8_emulate=True"):
        ampkit.Accelerator("fp8-mixed", device="cpu")


@pytest.mark.parametrize(
    "cc,problem",
    [
        (
            (8, 0),
            "NVIDIA compute capability 8.0 (Ampere): no fp8 Tensor Cores (first in Ada Lovelace, 8.9); "
            "fp8 matmuls need",
        ),
        ((8, 7), "NVIDIA compute capability 8.7 (Ampere, Jetson Orin): no fp8 Tensor Cores"),
        ((8, 9), None),
        ((9, 0), None),
        ((12, 0), None),
        ((13, 0), None),  # a newer GPU than the table keeps fp8
    ],
)
def test_which_nvidia_gpus_run_fp8(monkeypatch, cc, problem):
    from ampkit.precision.policy import fp8_problem

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    found = fp8_problem(torch.device("cuda"))
    assert found == problem if problem is None else found.startswith(problem), found
    assert fp8_problem(torch.device("cuda"), emulate=True) is None


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            dict(precision="fp8-mixed", fp8_emulate=True, fp8_recipe="delayed"),
            PrecisionError,
            r"fp8_recipe='delayed': expected one of 'tensorwise', 'rowwise'",
        ),
        (
            dict(precision="bf16-mixed", fp8_recipe="rowwise"),
            PrecisionError,
            r"fp8_recipe='rowwise': only precision='fp8-mixed'.*'bf16-mixed'",
        ),
        (
            dict(precision="fp32", fp8_emulate=True, fp8_min_weight=0),
            PrecisionError,
            r"fp8_emulate=True, fp8_min_weight=0: only",
        ),
        (
            dict(precision="fp8-mixed", fp8_emulate=True, fp8_min_weight=-1),
            ValueError,
            r"fp8_min_weight=-1: expected an int >= 0",
        ),
        (
            dict(precision="fp8-mixed", fp8_emulate=1),
            TypeError,
            r"fp8_emulate=1: expected True or False",
        ),  # before the device
    ],
)
def test_bad_fp8_arguments_raise_one_clear_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        ampkit.Accelerator(device="cpu", **kwargs)


def test_auto_never_picks_fp8_and_compare_leaves_it_out_where_it_cannot_run(monkeypatch):
    from ampkit.tools.compare import default_precisions

    cpu = torch.device("cpu")
    assert not ampkit.resolve_precision("auto", cpu).fp8
    assert "fp8-mixed" not in default_precisions(cpu)[0]


# --- on a GPU with fp8 (compute capability >= 8.9) --------------------------------------------------
fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device of compute capability >= 8.9 (fp8 tensor cores)",
)


def _tokens_per_s(precision: str, d_model: int, n_layers: int, batch: int, block: int, steps: int = 20, **kw) -> float:
    acc = ampkit.Accelerator(precision, device="cuda", compile=True, **kw)
    model = lm(d_model=d_model, block=block, n_layers=n_layers, n_heads=d_model // 128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, 256, (batch, block), device="cuda")
    for i in range(steps + 5):
        if i == 5:  # after compiling
            torch.cuda.synchronize()
            start = time.perf_counter()
        acc.backward(F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return steps * batch * block / (time.perf_counter() - start)


@pytest.mark.gpu
@fp8_gpu
def test_fp8_beats_bf16_on_a_gemm_heavy_transformer_with_compile():
    bf16 = _tokens_per_s("bf16-mixed", 2048, 4, 8, 1024)
    fp8 = _tokens_per_s("fp8-mixed", 2048, 4, 8, 1024)
    print(
        f"d_model 2048, 4 layers, 8x1024 tokens, compile: bf16-mixed {bf16:,.0f} tok/s, fp8-mixed {fp8:,.0f} "
        f"tok/s ({fp8 / bf16:.2f}x)"
    )
    assert fp8 > 1.05 * bf16


@pytest.mark.gpu
@fp8_gpu
def test_small_gemms_are_left_in_bf16_because_fp8_is_slower_there():
    acc = ampkit.Accelerator("fp8-mixed", device="cuda", compile=True)
    acc.prepare(lm(d_model=256, block=256))
    assert "0 of 9 Linear layers run in fp8" in acc.policy.reason  # the rule keeps them all in bf16
    bf16 = _tokens_per_s("bf16-mixed", 256, 2, 32, 256)
    forced = _tokens_per_s("fp8-mixed", 256, 2, 32, 256, fp8_min_weight=0)  # every layer the rest of the rule allows
    print(
        f"d_model 256, 2 layers, 32x256 tokens, compile: bf16-mixed {bf16:,.0f} tok/s, fp8 forced on small "
        f"GEMMs {forced:,.0f} tok/s ({forced / bf16:.2f}x)"
    )


@pytest.mark.gpu
@fp8_gpu
def test_fp8_uncompiled_on_a_gpu_warns():
    acc = ampkit.Accelerator("fp8-mixed", device="cuda", fp8_min_weight=0)
    with pytest.warns(UserWarning, match="without compile=True"):
        acc.prepare(lm())
    with warnings.catch_warnings(record=True) as caught:  # emulation is for tests: no speed to lose
        warnings.simplefilter("always")
        ampkit.Accelerator("fp8-mixed", device="cuda", fp8_emulate=True, fp8_min_weight=0).prepare(lm())
    assert not [w for w in caught if "without compile=True" in str(w.message)]


# --- the numerics doctor's fp8 range census -------------------------------------------------------
def test_the_numerics_doctor_reports_each_fp8_layers_range_against_e4m3_and_e5m2():
    from ampkit.tools.doctor import validate_numerics
    from ampkit.tools.doctor.numerics.session import NumericsSession

    acc, model, opt = prepared("fp8-mixed")
    session = NumericsSession(acc, steps=2)
    run(acc, model, opt, batches(2))
    result = session.result
    validate_numerics(result)
    fp8 = [m for m in result["census"]["modules"] if m["type"] == "Float8Linear"]
    assert len(fp8) == sum(isinstance(m, Float8Linear) for m in model.modules()) > 0
    for m in fp8:  # scaling maps each tensor's amax to the format's largest: what falls below its subnormal is lost
        assert 0 <= m["input"]["flush_e4m3_share"] <= 1 and m["input"]["abs_max"] > 0
        assert m["grad"]["flush_e5m2_share"] <= m["grad"]["flush_e4m3_share"]  # e5m2 has the wider range
    finding = next(f for f in result["findings"] if f["id"] == "fp8-range")
    assert finding["title"].startswith(f"{len(fp8)} layer(s) in fp8") and "448" in finding["evidence"]


def test_the_census_counts_what_fp8_scaling_flushes():
    from ampkit.tools.doctor.numerics.census import COUNTS, measure

    x = torch.tensor([448.0, 1.0, 2.0**-10, 2.0**-25, 0.0])  # amax 448: e4m3 keeps down to 2**-9, e5m2 to 2**-23
    counts, amax = measure(x)
    got = dict(zip(COUNTS, counts.tolist()))
    assert amax.item() == 448.0 and got["flush_e4m3"] == 2 and got["flush_e5m2"] == 1


def test_the_flush_thresholds_are_what_torchs_fp8_casts_round_to_zero():
    """E4M3_FLUSH/E5M2_FLUSH against torch's own casts: scaled by its amax onto the format's largest value, an
    element becomes 0 exactly where the census and the trackers count it flushed (the tie at half the smallest
    subnormal included)."""
    from ampkit.engine.fp8_sample import flushed
    from ampkit.precision.fp8 import E4M3_FLUSH, E5M2_FLUSH

    g = torch.Generator().manual_seed(0)
    spread = 10.0 ** torch.randint(-9, 1, (4096,), generator=g)  # magnitudes over nine decades below the amax
    x = torch.cat([torch.randn(4096, generator=g).clamp(-0.99, 0.99) * spread, torch.tensor([1.0])])  # amax 1
    x = torch.cat([x, torch.tensor([E4M3_FLUSH, E5M2_FLUSH, 2 * E4M3_FLUSH])])  # the ties and one just above
    amax = x.abs().max()
    assert amax == 1.0
    for dtype, flush in ((torch.float8_e4m3fn, E4M3_FLUSH), (torch.float8_e5m2, E5M2_FLUSH)):
        cast = (x * (torch.finfo(dtype).max / amax)).to(dtype).float()
        zero = ((cast == 0) & (x != 0)).sum().item()
        assert zero == ((x.abs() <= amax * flush) & (x != 0)).sum().item() and zero > 0
    assert flushed(x, rowwise=False).tolist() == [((x.abs() <= amax * E4M3_FLUSH) & (x != 0)).sum().item(), 4100]
