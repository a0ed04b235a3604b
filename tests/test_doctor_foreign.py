"""The doctors on code shaped like real scripts (nanoGPT, word_language_model): a warm-up from a
learning rate of 0, long module names, evaluation loops with `.item()`, CPU tensors read in logging,
a script without a prepared optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.tools.doctor import NumericsSession, summarize, validate_numerics
from ampkit.tools.doctor.numerics.findings import lost_update_fix
from ampkit.tools.doctor.numerics.report import format_text

pytestmark = pytest.mark.usefixtures("one_thread")


class Deep(nn.Module):
    """Module names longer than any column: they must print whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer_block_attention_projection = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.classifier_head_for_the_four_classes = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier_head_for_the_four_classes(self.act(self.transformer_block_attention_projection(x)))


def data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_warm_up_from_a_learning_rate_of_zero_loses_no_updates(precision):
    acc = ampkit.Accelerator(precision, device="cpu")
    model = Deep()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    session = NumericsSession(acc, steps=4)
    for i, (x, y) in enumerate(data(4)):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * i / 3  # nanoGPT-style warm-up: the first step's learning rate is 0
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    lost = session.result["lost_updates"]
    assert lost["recommendation"] is None
    assert all(g["lost_share"] < 0.01 for g in lost["groups"])
    assert not any(f["id"] == "lost-updates" for f in session.result["findings"])
    assert summarize(session.result)["problem"] is None
    text = format_text(session.result)
    assert "transformer_block_attention_projection " in text and "classifier_head_for_the_four_classes " in text
    assert "e-0" not in text.split("lost updates")[-1]  # shares print as percentages


def test_the_lost_update_remedy_is_never_the_preset_in_use():
    assert lost_update_fix("bf16-true", "bfloat16", "compensated") == (
        "use bf16-master",
        "use precision='bf16-master' (fp32 master weights)",
    )
    assert lost_update_fix("bf16-plain", "bfloat16", "param")[0] == "use bf16-master or bf16-true"
    assert lost_update_fix("bf16-master", "bfloat16", "master")[0] == "a larger learning rate"
    assert lost_update_fix("fp16-master", "float16", "master")[0] == "a larger learning rate"
    assert lost_update_fix("fp32", "float32", "param")[0] == "a larger learning rate"


# --- the performance doctor ------------------------------------------------------------------------
from ampkit.tools.doctor import DoctorError, DoctorSession  # noqa: E402
from ampkit.tools.doctor.perf.report import subject_line  # noqa: E402


def nanogpt_like_loop(acc, model, opt, steps: int, eval_every: int = 4) -> None:
    train, held_out = data(steps), data(3, seed=1)
    for it, (x, y) in enumerate(train):
        if it % eval_every == 0:  # estimate_loss(): a few reads, every few steps
            model.eval()
            with torch.no_grad():
                losses = torch.zeros(len(held_out))  # on the host, in a GPU run too
                for k, (hx, hy) in enumerate(held_out):
                    losses[k] = F.cross_entropy(model(hx), hy).item()  # sync: eval
            model.train()
            print(f"val {losses.mean():.4f}", file=open("/dev/null", "w"))  # a host tensor: no sync anywhere
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        lossf = loss.item()  # sync: train
        del lossf


def test_evaluation_reads_are_reported_apart_from_the_training_steps_and_host_tensors_not_at_all():
    acc = ampkit.Accelerator("fp32", device="cpu")
    model = Deep()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    session = DoctorSession(acc, steps=20, warmup=1, bench=False)
    nanogpt_like_loop(acc, model, opt, steps=21)
    syncs = session.result["syncs"]
    by_code = {s["code"].split("#")[-1].strip(): s for s in syncs["sites"]}
    assert set(by_code) == {"sync: train", "sync: eval"}  # the host tensor `losses` is never counted
    assert by_code["sync: train"]["every_step"] and not by_code["sync: eval"]["every_step"]
    assert syncs["per_step"] == pytest.approx(1.0)  # the training step's own reads only
    titles = [f["title"] for f in session.result["findings"] if f["id"] == "sync"]
    assert any(t.startswith("1 sync per step at ") for t in titles)
    # every measured step is watched: the evaluation's 3 reads every 4th step, in 5 of the 20
    assert any(t.startswith("15 reads in 5 of 20 watched steps at ") for t in titles), titles


def test_a_script_without_a_prepared_optimizer_is_told_within_the_first_steps():
    acc = ampkit.Accelerator("fp32", device="cpu")
    model = acc.prepare(Deep())
    DoctorSession(acc, steps=5, warmup=0, stop=True, bench=False)
    seen = 0
    with pytest.raises(
        DoctorError,
        match=r"3 backward passes ran and no optimizer was prepared: .*"
        r"model, optimizer = acc.prepare\(model, optimizer\)",
    ):
        for x, y in data(50):
            acc.backward(F.cross_entropy(model(x), y))
            seen += 1
    assert seen == 2  # the third backward raised


def test_the_header_shows_a_long_argument_list_on_one_line_cut():
    argv = [
        "--batch_size=12",
        "--compile=False",
        "--eval_iters=20",
        "--log_interval=1",
        "--block_size=64",
        "--n_layer=4",
        "--note=two\nlines",
    ]
    line = subject_line({"kind": "script", "name": "train.py", "argv": argv})
    assert "\n" not in line and line.startswith("train.py --batch_size=12 --compile=False")
    assert line.endswith("…") and len(line) <= len("train.py ") + 60


class WithLoss(nn.Module):
    """nanoGPT / Hugging Face: the model returns (logits, loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Deep()

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        logits = self.net(x)
        return logits, F.cross_entropy(logits, y)


@pytest.mark.parametrize("divides", [True, False])
def test_the_numerics_doctor_names_a_loss_divided_twice_under_accumulation(divides):
    acc = ampkit.Accelerator("fp32", device="cpu", grad_accum_steps=2, divide_loss=True)
    model = WithLoss()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    session = NumericsSession(acc, steps=2)
    for x, y in data(4):
        _, loss = model(x, y)
        if divides:
            loss = loss / 2  # the script's own accumulation division, kept after the conversion
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    validate_numerics(session.result)
    found = [f for f in session.result["findings"] if f["id"] == "double-division"]
    if divides:
        assert found and found[0]["title"] == "the loss is divided by 2 twice: every gradient is 2x too small"
        assert summarize(session.result)["problem"] == found[0]["title"]
    else:
        assert not found and summarize(session.result)["problem"] is None


def test_a_read_every_kth_step_is_seen_wherever_it_falls_in_the_measured_steps():
    """Issue 46: `loss.item()` every 20th step, inside the measured steps, and the doctor said "syncs: none" (it
    watched only the profiled steps). Every measured step is watched now, so the one read is named."""
    from ampkit.tools.doctor.perf.report import format_text

    acc, model = ampkit.Accelerator("fp32", device="cpu"), Deep()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    session = DoctorSession(acc, steps=20, warmup=1, bench=False)
    for it, (x, y) in enumerate(data(21)):
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if it % 20 == 17:  # a log line every 20th step: in the timed steps, past the 5 profiled ones
            print(f"step {it} loss {loss.item():.4f}", file=open("/dev/null", "w"))  # sync: log
    syncs = session.result["syncs"]
    assert syncs["watched_steps"] == 20
    (site,) = syncs["sites"]
    assert site["code"].endswith("# sync: log") and (site["reads"], site["steps_seen"]) == (1, 1)
    assert not site["every_step"] and syncs["per_step"] == 0
    text = " ".join(format_text(session.result).split())
    assert "syncs: none" not in text
    assert "1 more in code that ran in only some of the 20 watched steps" in text


def test_the_phase_clock_leaves_out_what_watching_cost():
    """The sync watcher's calls cost host time in every watched step: the clock takes `charge()` off each phase."""
    from ampkit.tools.doctor.perf.session import PhaseClock

    spent = [0.0]
    clock = PhaseClock(charge=lambda: spent[0])
    clock.active = True
    clock.start("backward")
    spent[0] += 3600.0  # an hour of watching inside the phase, far more than the phase took
    clock.end("backward")
    clock.start("optimizer")
    clock.end("optimizer")
    seconds, _, _ = clock.take()
    assert seconds["backward"] == 0.0  # none of the hour
    assert 0.0 <= seconds["optimizer"] < 1.0


def test_the_advice_line_is_one_of_its_tables_figures_on_a_busy_machine(monkeypatch):
    """Issue 46: "an A100 would be no faster" sat above a table saying 6.64x for every GPU: the verdict judged
    the step without its threads' wait for cores, the table the step with it. Both use the unstalled step now."""
    from ampkit.tools.doctor.perf import findings
    from ampkit.tools.doctor.perf.report import format_text
    from ampkit.util.present import times

    monkeypatch.setattr(findings, "stall_time", lambda kernel_s, *args, **kwargs: 0.8 * kernel_s)  # a busy CPU
    acc, model = ampkit.Accelerator("fp32", device="cpu"), Deep()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    session = DoctorSession(acc, steps=8, warmup=1, bench=False)
    for x, y in data(9):
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    advice = session.result["advisor"]
    assert advice["here"]["steady_s"] < advice["here"]["step_s"]
    ref = [e for e in advice["estimates"] if e["gpu"] == advice["reference_gpu"]]
    best = min(ref, key=lambda e: e["step_s"])
    assert best["speedup"] == pytest.approx(advice["here"]["steady_s"] / best["step_s"])
    if best["speedup"] >= 1.2:
        assert f"should be ~{times(best['speedup'])} faster" in advice["verdict"]
    else:
        assert "no faster" in advice["verdict"] or "slower" in advice["verdict"]
    text = format_text(session.result)
    row = next(line for line in text.splitlines() if line.strip().startswith(advice["reference_gpu"] + " *"))
    assert row.rstrip().endswith(times(best["speedup"]))  # the table's "vs here" is the verdict's figure
    assert "unstalled" in text
