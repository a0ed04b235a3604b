"""Loops shaped like real training scripts convert without silent traps.

Each test is a small loop with the shape of a program people convert (word_language_model's manual
update, nanoGPT's accumulation, grouped optimizer and clipping, a whole-model `torch.save`), and
checks that the conversion either equals the hand-written loop bit for bit or fails loudly.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from conftest import assert_bitwise_equal, params_of

VOCAB, WIDTH, SEQ = 64, 32, 8


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks with LayerNorm, a head: many small tensors of mixed rank."""

    def __init__(self, seed: int = 0, loss_inside: bool = False, log_probs: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.loss_inside, self.log_probs = loss_inside, log_probs

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        h = self.embed(idx)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h))
        if self.log_probs:
            return F.log_softmax(logits, dim=-1)
        if self.loss_inside:  # nanoGPT / Hugging Face: the model returns (logits, loss)
            return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits


def batches(n: int, seed: int = 1, batch: int = 4):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        yield x, torch.roll(x, -1, dims=1)


def grouped_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: weight decay on matrices only, so the groups reorder the parameters."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3
    )


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


# --- 1. a loop with no optimizer (word_language_model's manual update) -----------------------------
def manual_loop(model, backward, clip, steps: int = 6, lr: float = 0.5, autocast: bool = False) -> list[float]:
    losses = []
    for x, y in batches(steps):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(x), y)
        backward(loss)
        clip(model)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_manual_update_without_an_optimizer_equals_the_hand_written_loop(precision):
    ref = TinyLM()
    expected = manual_loop(
        ref,
        lambda loss: loss.backward(),
        lambda m: nn.utils.clip_grad_norm_(m.parameters(), 0.25),
        autocast=precision == "bf16-mixed",
    )
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model = acc.prepare(TinyLM())
    got = manual_loop(model, acc.backward, lambda m: acc.clip_grad_norm_(0.25))
    assert got == expected
    assert_bitwise_equal(params_of(model), params_of(ref))


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp16-master", "bf16-master", "bf16-true"])
def test_a_manual_update_that_cannot_be_right_is_refused_at_the_first_backward(precision):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU: "runs far slower"
        acc = ampkit.Accelerator(precision=precision, device="cpu")
    model = acc.prepare(TinyLM())
    x, y = next(batches(1))
    with pytest.raises(
        ampkit.StepOrderError,
        match=rf"precision '{precision}' .*and no optimizer was prepared\. "
        r"Prepare one: model, optimizer = acc\.prepare\(model, optimizer\)",
    ):
        acc.backward(lm_loss(model(x), y))
    assert all(p.grad is None for p in model.parameters())  # refused before the backward ran


# --- 2. the script's own accumulation division -----------------------------------------------------
def accumulation_loop(model, opt, backward, k: int, divide: bool, steps: int = 3) -> list[float]:
    losses = []
    data = batches(steps * k)
    for _ in range(steps):
        for _micro in range(k):
            x, y = next(data)
            loss = lm_loss(model(x), y)
            if divide:
                loss = loss / k  # nanoGPT: "scale the loss to account for gradient accumulation"
            backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_the_accumulation_division_is_announced_once():
    acc = ampkit.Accelerator(precision="fp32", device="cpu", grad_accum_steps=4)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(
        UserWarning, match=r"grad_accum_steps=4: acc.backward\(loss\) divides each micro-batch's loss by 4"
    ) as seen:
        for x, y in batches(8):
            acc.backward(lm_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    assert len([w for w in seen if "divides each micro-batch" in str(w.message)]) == 1


@pytest.mark.parametrize("divide_loss", [True, False])
def test_an_explicit_division_choice_is_silent_and_divide_loss_false_keeps_the_scripts_own(divide_loss):
    ref = TinyLM()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    accumulation_loop(ref, ref_opt, lambda loss: loss.backward(), k=4, divide=True)
    acc = ampkit.Accelerator(precision="fp32", device="cpu", grad_accum_steps=4, divide_loss=divide_loss)
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # divide_loss=True: ampkit divides, the loop must not; False: the loop's own division stays.
        accumulation_loop(model, opt, acc.backward, k=4, divide=not divide_loss)
    assert_bitwise_equal(params_of(model), params_of(ref))


# --- 4. outputs the loop never uses in fp32 ----------------------------------------------------------
def test_cast_outputs_false_returns_the_models_own_dtypes():
    x, y = next(batches(1))
    kept = ampkit.Accelerator(precision="bf16-mixed", device="cpu").prepare(TinyLM(loss_inside=True))
    logits, loss = kept(x, y)
    assert (logits.dtype, loss.dtype) == (torch.float32, torch.float32)  # default: every output in fp32
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu", cast_outputs=False)
    model = acc.prepare(TinyLM(loss_inside=True))
    logits, loss = model(x, y)
    assert (logits.dtype, loss.dtype) == (torch.bfloat16, torch.float32)  # no fp32 copy of the logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits, ref_loss = TinyLM(loss_inside=True)(x, y)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    with pytest.raises(TypeError, match=r"cast_outputs='no': expected True or False"):
        ampkit.Accelerator(precision="bf16-mixed", device="cpu", cast_outputs="no")


def test_a_loss_under_acc_autocast_on_uncast_outputs_is_torch_autocasts_loss():
    x, y = next(batches(1))
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu", cast_outputs=False)
    model = acc.prepare(TinyLM(log_probs=True))
    with acc.autocast():
        loss = F.nll_loss(model(x).reshape(-1, VOCAB), y.reshape(-1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.nll_loss(TinyLM(log_probs=True)(x).reshape(-1, VOCAB), y.reshape(-1))
    assert torch.equal(loss, ref)


# --- 5. torch.save(model) of a prepared model --------------------------------------------------------
_NET = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x))
"""

_LOAD = """
import sys, torch
for weights_only in (None, False):
    try:
        kwargs = {} if weights_only is None else {"weights_only": False}
        model = torch.load(sys.argv[1], **kwargs)
    except Exception as exc:
        print("default" if weights_only is None else "weights_only=False", "raises", type(exc).__name__)
        continue
    out = model(torch.ones(2, 8, dtype=next(model.parameters()).dtype))
    print("weights_only=False" if weights_only is False else "default", "loads", type(model).__name__,
          sorted(vars(model)["_modules"]), out.dtype, "ampkit" in sys.modules)
"""


def _reload(path, folder) -> str:
    env = {"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", _LOAD, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("precision", ["bf16-mixed", pytest.param("bf16-true", marks=pytest.mark.slow)])
def test_a_prepared_model_saved_whole_loads_like_the_plain_module_in_a_process_without_ampkit(
    tmp_path, precision, monkeypatch
):
    (tmp_path / "netdef.py").write_text(_NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    import netdef

    plain = netdef.Net()
    torch.save(plain, tmp_path / "plain.pt")
    # bf16-mixed with a kept-fp32 layer: the head holds a policy wrapper of its own
    acc = ampkit.Accelerator(precision=precision, device="cpu", keep_fp32=["head"] if precision == "bf16-mixed" else ())
    model = acc.prepare(netdef.Net())
    torch.save(model, tmp_path / "prepared.pt")
    expected = _reload(tmp_path / "plain.pt", tmp_path)
    got = _reload(tmp_path / "prepared.pt", tmp_path)
    if precision == "bf16-mixed":  # same weights, same dtypes: the two files behave the same
        assert got == expected
    assert "weights_only=False loads Net ['body', 'head']" in got and "False\n" in got  # ampkit never imported
    assert got.splitlines()[0] == expected.splitlines()[0]  # torch's default load: whatever it does to a plain Net
    # and in this process a deep copy (an EMA model, say) still runs under the policy
    ema = copy.deepcopy(model)
    x = torch.randn(2, 8)
    assert torch.equal(ema(x), model(x))


# --- 6. clipping in the order the loop's own clip sums --------------------------------------------
def clip_loop(model, opt, backward, clip, autocast: bool, steps: int = 8) -> list[float]:
    losses = []
    for x, y in batches(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(x), y)
        backward(loss)
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_clipping_a_grouped_optimizer_equals_the_hand_written_clip_bitwise(precision):
    ref = TinyLM()
    ref_opt = grouped_adamw(ref)
    norms: list[torch.Tensor] = []
    expected = clip_loop(
        ref,
        ref_opt,
        lambda loss: loss.backward(),
        lambda: norms.append(nn.utils.clip_grad_norm_(ref.parameters(), 0.05)),
        autocast=precision == "bf16-mixed",
    )
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model = TinyLM()
    model, opt = acc.prepare(model, grouped_adamw(model))
    got_norms: list[torch.Tensor] = []
    got = clip_loop(model, opt, acc.backward, lambda: got_norms.append(acc.clip_grad_norm_(0.05)), autocast=False)
    assert_bitwise_equal(got_norms, norms)
    assert got == expected
    assert_bitwise_equal(params_of(model), params_of(ref))


# --- 10. fp16 on a CPU ------------------------------------------------------------------------------
def test_fp16_on_a_cpu_warns_that_some_ops_may_not_run(monkeypatch):
    monkeypatch.setattr(
        "ampkit.hardware.capability.cpu_flags",
        lambda: {"avx512_bf16": True, "amx_bf16": False, "avx512_fp16": False, "amx_fp16": False},
    )
    with pytest.warns(
        UserWarning, match=r"far slower than fp32, and some ops may not run at all \(oneDNN's LSTM has no fp16 forward"
    ):
        ampkit.Accelerator(precision="fp16-mixed", device="cpu")


# --- 9. ampkit.compare on a script's own loop -----------------------------------------------------
def lm_train_fn(acc):
    """A train_fn as a converted script writes it: accumulation, its own val_loss (lower is better)."""
    model = TinyLM()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    for x, y in batches(8):
        acc.backward(lm_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        val = sum(lm_loss(model(x), y).item() for x, y in batches(2, seed=9)) / 2
    return {"val_loss": val, "accum": float(acc.config.grad_accum_steps), "cast": float(acc.config.cast_outputs)}


def test_compare_passes_accelerator_arguments_and_knows_the_metrics_direction(monkeypatch):
    from ampkit.tools.compare import compare, runner
    from ampkit.tools.compare.records import as_report
    from ampkit.tools.compare.summary import rows, verdicts

    totals = []
    monkeypatch.setattr(runner.RunProgress, "start", lambda self, label, total: totals.append(total))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compare(
            lm_train_fn,
            ["fp32", "bf16-mixed"],
            device="cpu",
            show=False,
            isolate=False,
            numerics=False,
            accelerator_kwargs={"grad_accum_steps": 2, "divide_loss": True, "bf16-mixed": {"cast_outputs": False}},
            metric_direction="lower",
        )
    fp32, bf16 = report["runs"]
    assert (fp32["eval"]["accum"], fp32["eval"]["cast"]) == (2.0, 1.0)
    assert (bf16["eval"]["accum"], bf16["eval"]["cast"]) == (2.0, 0.0)  # the preset's own override
    assert report["task"]["metric"] == "val_loss" and report["task"]["higher_is_better"] is False
    assert totals == [None, 4]  # 8 micro-batches, 2 per step: known after the first run
    cells = rows(as_report(report))
    decimals = {len(row[7].split(".")[1]) for row in cells}  # the final-loss column: one format
    assert len(decimals) == 1
    assert "val_loss" in verdicts(as_report(report))[1]
    with pytest.raises(
        ValueError, match=r"accelerator_kwargs=\{'precision': 'fp16-mixed'\}: expected Accelerator arguments"
    ):
        compare(lm_train_fn, ["fp32"], device="cpu", show=False, accelerator_kwargs={"precision": "fp16-mixed"})
    with pytest.raises(ValueError, match=r"metric_direction='down': expected 'higher' or 'lower'"):
        compare(lm_train_fn, ["fp32"], device="cpu", show=False, metric_direction="down")
