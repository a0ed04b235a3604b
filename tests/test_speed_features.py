"""Speed features are checked for correctness, not speed (benchmarks/peers.py measures speed):
compile=True and channels_last=True train like the eager, default-layout run; the foreach/flat
master and Kahan updates equal a per-parameter reference written out by hand; bf16-true keeps
8 bytes per parameter between AdamW steps; cuda_graphs=True is refused off CUDA."""

from __future__ import annotations

import copy
import io
import linecache
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit
from ampkit.engine.events import Events, Listener
from conftest import assert_bitwise_equal, make_loader, make_model

STEPS = 8


def losses_of(
    precision: str, steps: int = STEPS, batch_size: int = 32, **kwargs
) -> tuple[list[float], ampkit.Accelerator, nn.Module]:
    model = make_model(width=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(precision, device="cpu", **kwargs)
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=batch_size))
    losses = []
    for _, (x, y) in zip(range(steps), loader):
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, acc, model


# --- compile=True -------------------------------------------------------------------------------
@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None, reason="inductor on CPU needs a C++ compiler"
)
def test_compile_matches_eager_trajectory_and_reports_compile_time_apart():
    eager, _, _ = losses_of("bf16-mixed")
    compiled, acc, model = losses_of("bf16-mixed", compile=True)
    assert acc.compile_stats.fallback is None
    assert acc.compile_stats.first_forward_s is not None and acc.compile_stats.first_forward_s > 0
    assert acc.compile_stats.first_backward_s is not None
    assert acc.compile_stats.models == ["Sequential"]
    # the user's module stays the user's: same class and state_dict keys
    assert type(model) is nn.Sequential and list(model.state_dict()) == list(make_model().state_dict())
    # the compiler may fuse the bf16 casts differently: equal within bf16 tolerance
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


def test_compile_options_reach_torch_compile_and_fp32_aot_eager_is_close():
    eager, _, _ = losses_of("fp32")
    compiled, acc, _ = losses_of("fp32", compile={"backend": "aot_eager"})
    assert acc.compile_stats.fallback is None and acc.compile_stats.first_forward_s is not None
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend always fails")


def test_a_failing_compiler_falls_back_to_eager_with_one_warning_and_equal_results():
    eager, _, eager_model = losses_of("fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallen, acc, model = losses_of("fp32", compile={"backend": _failing_backend})
    messages = [str(w.message) for w in caught if "compile=True" in str(w.message)]
    assert len(messages) == 1 and "this backend always fails" in messages[0] and "runs eagerly" in messages[0]
    assert acc.compile_stats.fallback is not None
    assert fallen == eager
    assert_bitwise_equal([p.detach() for p in model.parameters()], [p.detach() for p in eager_model.parameters()])


def test_every_model_compiled_in_one_process_gets_its_own_graph():
    """Dynamo keeps at most 8 graphs per function; each prepared forward must be its own function,
    or the ninth model would silently run eagerly (benchmarks compile many models in one process)."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for _ in range(11):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        acc = ampkit.Accelerator("fp32", device="cpu", compile={"backend": counting_backend})
        model = acc.prepare(model)
        for _ in range(2):
            model(torch.randn(2, 4))
    assert len(graphs) == 11


def test_one_model_failing_to_compile_leaves_the_others_compiled():
    graphs = []

    def no_relu_backend(gm, example_inputs):
        if any("relu" in str(node.target) for node in gm.graph.nodes):
            raise RuntimeError("this backend refuses relu")
        graphs.append(gm)
        return gm.forward

    acc = ampkit.Accelerator("fp32", device="cpu", compile={"backend": no_relu_backend})
    with pytest.warns(UserWarning, match=r"compiling Sequential failed: .*refuses relu.*this model runs eagerly"):
        relu_model = acc.prepare(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        relu_model(torch.randn(2, 4))
    tanh_model = acc.prepare(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    tanh_model(torch.randn(2, 4))
    assert len(graphs) == 1 and "refuses relu" in acc.compile_stats.fallback


def test_a_compiled_model_cannot_be_prepared_twice():
    acc = ampkit.Accelerator("bf16-mixed", device="cpu", compile={"backend": "eager"})
    model = acc.prepare(make_model())
    with pytest.raises(ValueError, match="Sequential was already prepared; prepare each model once"):
        ampkit.Accelerator("bf16-mixed", device="cpu").prepare(model)


def test_no_cxx_compiler_warns_at_construction_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match=r"needs a C\+\+ compiler and none was found"):
        acc = ampkit.Accelerator("fp32", device="cpu", compile=True)
    model = acc.prepare(make_model())
    assert acc.compile_stats.models == [] and acc.compile_options is None
    model(torch.randn(2, 8))


def test_a_model_bug_under_compile_raises_the_models_own_error():
    model = nn.Linear(8, 4)
    acc = ampkit.Accelerator("fp32", device="cpu", compile={"backend": "aot_eager"})
    model = acc.prepare(model)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        model(torch.randn(2, 5))


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"mode": "fast", "turbo": True}, r"compile=\{.*'turbo'.*unknown key\(s\) \['turbo'\]"),
        ("yes", r"compile='yes': expected True, False or a dict"),
        ({"trial": "no"}, r"compile=\{'trial': 'no'\}: 'trial' must be True or False"),
    ],
)
def test_bad_compile_arguments_name_what_was_passed(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ampkit.Accelerator("fp32", device="cpu", compile=bad)


# --- the compile trial: eager or compiled, measured -----------------------------------------------
class FakeClock:
    """A clock under which a timed trial step takes `eager_s` or `compiled_s`, by the kind in flight
    (the trial reads the clock once at a step's start and once at its end)."""

    def __init__(self, trial, eager_s: float, compiled_s: float) -> None:
        self.trial, self.costs, self.now = trial, {"eager": eager_s, "compiled": compiled_s}, 0.0

    def __call__(self) -> float:
        self.now += self.costs[self.trial.timing]
        return self.now


def trial_run(
    eager_s: float, compiled_s: float, steps: int = 12, evals: bool = False, compile: dict | None = None, **kwargs
):
    """Train `steps` micro-steps compiled with a backend counting its compiled forward's calls (training
    and `evals` apart), under a fake trial clock; `chosen`: per step, what the trial had chosen by then.
    `evals`: an eval-mode forward and a no_grad forward after every step."""
    calls: list[int] = []

    def counting_backend(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm.forward(*args)

        return run

    model = make_model(width=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator("fp32", device="cpu", compile={"backend": counting_backend, **(compile or {})}, **kwargs)
    acc.compile_trial.clock = FakeClock(acc.compile_trial, eager_s, compiled_s)
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=16))
    losses, chosen, eval_calls = [], [], 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _, (x, y) in zip(range(steps), loader):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            chosen.append(acc.compile_stats.chosen)
            if evals:
                before = len(calls)
                model.eval()
                model(x)
                model.train()
                with torch.no_grad():
                    model(x)
                eval_calls += len(calls) - before
    messages = [str(w.message) for w in caught if "compile=True" in str(w.message)]
    files = {
        (w.filename, linecache.getline(w.filename, w.lineno).strip())
        for w in caught
        if "compile=True" in str(w.message)
    }
    return SimpleNamespace(
        files=files,
        losses=losses,
        acc=acc,
        model=model,
        compiled_calls=len(calls) - eval_calls,
        eval_compiled_calls=eval_calls,
        chosen=chosen,
        messages=messages,
    )


def test_the_compile_trial_runs_eager_when_eager_measures_faster_and_training_still_works():
    eager, _, eager_model = losses_of("fp32", steps=12, batch_size=16)
    run = trial_run(eager_s=0.001, compiled_s=0.002)
    stats, model = run.acc.compile_stats, run.model
    assert stats.chosen == "eager" and (stats.eager_step_s, stats.compiled_step_s) == (0.001, 0.002)
    assert stats.reason == "eager is faster: the compiled step measured 2 ms vs eager 1 ms (median of 3 each)"
    # the first compiled step, then eager/compiled alternating 3 + 3, decided at the end of step 7
    assert run.chosen == [None] * 6 + ["eager"] * 6
    assert run.compiled_calls == 1 + 3  # steps 8-12 ran the eager forward: the compiled one was not called
    [message] = run.messages
    assert run.files == {(__file__, "acc.backward(loss)")}  # the warning names the loop's line, not ampkit's
    assert len(run.acc.events) == 0  # the trial stopped listening once it had chosen
    assert "the compiled training step measured 2 ms vs eager 1 ms" in message
    assert "models (Sequential) run eagerly" in message and "'trial': False} keeps them compiled" in message
    torch.testing.assert_close(run.losses, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # a prepared model that runs eagerly after the trial still deep-copies and pickles
    x = torch.randn(4, 8)
    torch.testing.assert_close(copy.deepcopy(model)(x), model(x))
    buf = io.BytesIO()
    torch.save(model, buf)
    torch.testing.assert_close(torch.load(io.BytesIO(buf.getvalue()), weights_only=False)(x), model(x))


@pytest.mark.parametrize("eager_s", [0.003, 0.002], ids=["compiled-faster", "tie"])
def test_the_compile_trial_keeps_compiled_when_compiled_is_faster_or_ties(eager_s):
    run = trial_run(eager_s=eager_s, compiled_s=0.002)
    assert run.acc.compile_stats.chosen == "compiled" and run.acc.compile_stats.reason.startswith(
        "compiled is not slower: the compiled step measured 2 ms vs eager"
    )
    assert run.chosen == [None] * 6 + ["compiled"] * 6
    assert run.compiled_calls == 1 + 3 + 5 and run.messages == []


def test_trial_false_keeps_compiled_without_timing_eager():
    run = trial_run(eager_s=0.001, compiled_s=0.002, compile={"trial": False})
    assert run.compiled_calls == 12 and run.messages == []
    assert run.chosen == [None] * 12 and run.acc.compile_stats.eager_step_s is None
    assert run.acc.compile_stats.first_backward_s is not None and len(run.acc.events) == 0
    idle = ampkit.Accelerator("fp32", device="cpu", compile=True)
    assert len(idle.events) == 0  # the trial listens from the first compiled forward only
    assert run.acc.compile_stats.reason == "no trial: compile={'trial': False}"
    assert "trial" not in run.acc.compile_options  # ampkit's key, not passed to torch.compile


def test_events_deliver_in_registration_order_and_first_puts_a_listener_ahead():
    seen: list[str] = []

    class Named(Listener):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_backward_end(self, acc) -> None:
            seen.append(self.name)

    events, a, b, trial = Events(), Named("a"), Named("b"), Named("trial")
    events.add(a)
    events.add(b)
    events.add(trial, first=True)
    events.emit(Listener.on_backward_end, None)
    assert seen == ["trial", "a", "b"]
    with pytest.raises(ValueError, match="already listening"):
        events.add(a, first=True)
    with pytest.raises(TypeError, match="expected an ampkit.engine.events.Listener"):
        events.add(object(), first=True)  # type: ignore[arg-type]
    assert len(events) == 3


def test_eval_and_no_grad_forwards_during_the_trial_run_compiled_and_are_not_timed():
    run = trial_run(eager_s=0.001, compiled_s=0.002, evals=True)
    assert run.chosen == [None] * 6 + ["eager"] * 6  # the same training step decides as without them
    assert run.compiled_calls == 1 + 3 and len(run.messages) == 1
    assert run.eval_compiled_calls == 2 * 6  # compiled during the trial (from step 7's end: eager, as chosen)
    assert run.acc.compile_stats.eager_step_s == 0.001 and run.acc.compile_stats.compiled_step_s == 0.002


def test_the_compile_trial_times_every_micro_step_under_gradient_accumulation():
    eager, _, eager_model = losses_of("fp32", steps=12, batch_size=16, grad_accum_steps=2)
    run = trial_run(eager_s=0.001, compiled_s=0.002, grad_accum_steps=2)
    assert run.chosen == [None] * 6 + ["eager"] * 6 and run.compiled_calls == 1 + 3
    torch.testing.assert_close(run.losses, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(run.model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --- cuda_graphs=True ---------------------------------------------------------------------------
def test_cuda_graphs_is_refused_off_cuda_with_a_clear_error():
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs a CUDA device .* runs on 'cpu'"):
        ampkit.Accelerator("fp32", device="cpu", cuda_graphs=True)


# --- channels_last=True -------------------------------------------------------------------------
class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def cnn_run(channels_last: bool) -> tuple[list[float], nn.Module, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 8, 8, generator=g)
    y = torch.randint(0, 3, (64,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = ampkit.Accelerator("fp32", device="cpu", channels_last=channels_last)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, batches = [], []
    for _ in range(3):
        for xb, yb in loader:
            batches.append(xb)
            loss = F.cross_entropy(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, model, batches


def test_channels_last_trains_like_the_default_layout():
    base, base_model, _ = cnn_run(False)
    nhwc, model, batches = cnn_run(True)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not base_model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(b.is_contiguous(memory_format=torch.channels_last) and not b.is_contiguous() for b in batches)
    torch.testing.assert_close(nhwc, base, rtol=1e-5, atol=1e-5)
    for a, b in zip(model.parameters(), base_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_channels_last_on_a_model_without_convolutions_warns():
    acc = ampkit.Accelerator("fp32", device="cpu", channels_last=True)
    with pytest.warns(UserWarning, match=r"channels_last=True: Sequential has no 4-D \(convolution\) weights"):
        acc.prepare(make_model())


# --- foreach/flat master and Kahan updates = the per-parameter reference ------------------------
class WithUnused(nn.Module):
    """An MLP with a LayerNorm and a layer the forward never uses (it never gets a gradient)."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 4)
        if unused:
            self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.norm(self.a(x))))


def reference_run(precision: str, steps: int, unused: bool, low_state: bool = True) -> list[torch.Tensor]:
    """The low-precision-weight update written out per parameter, as a careful engineer would:
    bf16 weights, fp32 stand-ins the (unchanged) AdamW steps, and either persistent fp32 masters
    (bf16-master) or a bf16 Kahan buffer plus the optimizer's state, in bf16 (`low_state`, what bf16-true's
    fused AdamW keeps) or as the optimizer keeps it (bf16-true's whole step of any other optimizer)."""
    model = WithUnused(unused)
    keep_norm = precision == "bf16-master"
    init = {p: p.detach().clone() for p in model.parameters()}
    low = [
        p
        for m in model.modules()
        if not (keep_norm and isinstance(m, nn.LayerNorm))
        for p in m.parameters(recurse=False)
    ]
    with torch.no_grad():
        for p in low:
            p.data = p.data.to(torch.bfloat16)
    stand_in = {p: nn.Parameter(init[p].clone()) for p in low}
    comp = {p: (init[p] - p.float()).to(torch.bfloat16) for p in low}
    opt = torch.optim.AdamW([stand_in.get(p, p) for p in model.parameters()], lr=1e-3, weight_decay=0.01)
    loader = make_loader(batch_size=32)
    for _, (x, y) in zip(range(steps), loader):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        for p in low:
            s = stand_in[p]
            if p.grad is None:
                continue
            if precision == "bf16-true":
                s.data = p.float() + comp[p].float()
                for k, v in opt.state.get(s, {}).items() if low_state else ():
                    if k != "step":
                        opt.state[s][k] = v.float()
            s.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p in low:
                s = stand_in[p]
                if s.grad is None:
                    continue
                p.copy_(s)
                if precision == "bf16-true":
                    comp[p] = (s - p.float()).to(torch.bfloat16)
                    for k, v in opt.state[s].items() if low_state else ():
                        if k != "step":
                            opt.state[s][k] = v.to(torch.bfloat16)
                s.grad = None
        opt.zero_grad()
        model.zero_grad()
    out = [p.detach().clone() for p in model.parameters()]
    if precision == "bf16-true":
        out += [comp[p] for p in low] + [
            v for p in low for k, v in sorted(opt.state.get(stand_in[p], {}).items()) if k != "step"
        ]
    return out


def ampkit_run(
    precision: str,
    steps: int,
    unused: bool,
    free: bool,
    clip: bool = False,
    make_opt=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
) -> list[torch.Tensor]:
    model = WithUnused(unused)
    opt = make_opt(model.parameters())
    acc = ampkit.Accelerator(precision, device="cpu", free_step_buffers=free)
    model, opt = acc.prepare(model, opt)
    loader = make_loader(batch_size=32)
    for _, (x, y) in zip(range(steps), loader):
        acc.backward(F.cross_entropy(model(x), y))
        if clip:
            acc.clip_grad_norm_(1e9)  # a clip coefficient of 1: the gradients stay as they are
        opt.step()
        opt.zero_grad()
    out = [p.detach().clone() for p in model.parameters()]
    weights = opt.weights
    if precision == "bf16-true":
        shadows = [s for _, s in weights.pairs]
        out += [c.clone() for c in weights.compensation]
        out += [v.clone() for s in shadows for k, v in sorted(opt.state.get(s, {}).items()) if k != "step"]
    return out


@pytest.mark.parametrize("free", [False, True], ids=["keep-buffers", "free-buffers"])
@pytest.mark.parametrize("unused", [False, True], ids=["all-used", "one-layer-unused"])
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-master"])
def test_fused_low_precision_updates_equal_the_per_parameter_reference(precision, unused, free):
    assert_bitwise_equal(ampkit_run(precision, 6, unused, free), reference_run(precision, 6, unused))


class SubclassedAdamW(torch.optim.AdamW):
    """Not one of torch's own optimizers: ampkit cannot know its step is elementwise."""


@pytest.mark.parametrize("free", [True, False], ids=["free-step-buffers", "keep-step-buffers"])
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-master"])
def test_an_optimizer_not_known_to_be_elementwise_is_stepped_whole(precision, free):
    make_opt = lambda ps: SubclassedAdamW(ps, lr=1e-3, weight_decay=0.01)  # noqa: E731
    got = ampkit_run(precision, 6, True, free, make_opt=make_opt)
    assert_bitwise_equal(got, reference_run(precision, 6, True, low_state=False))


def test_a_bf16_true_step_makes_no_fp32_copy_of_the_model():
    """The fused kernel reads and writes the bf16 buffers in place: a steady AdamW step raises the process's
    resident peak by the flat bf16 gradient copy (2 bytes per parameter), never by an fp32 copy (4 or more)."""
    from ampkit.tools.compare.memory import peak_rss_bytes, proc_status, reset_peak_rss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048))  # 8.4M parameters
    acc = ampkit.Accelerator("bf16-true", device="cpu")
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, 2048)
    rises = []
    for _ in range(3):
        acc.backward(model(x).float().square().mean())
        if not reset_peak_rss():
            pytest.skip("no /proc/self/clear_refs: the resident peak cannot be reset here")
        before = proc_status("VmRSS")
        opt.step()
        rises.append((peak_rss_bytes() - before) / n)
        opt.zero_grad()
    assert min(rises[1:]) < 3.5, rises  # a full fp32 temporary would add at least 4 bytes per parameter


@pytest.mark.parametrize("free", [True, False], ids=["free-step-buffers", "keep-step-buffers"])
def test_bf16_true_holds_8_bytes_per_parameter_between_adamw_steps(free):
    model = make_model(width=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = ampkit.Accelerator("bf16-true", device="cpu", free_step_buffers=free)
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=32))
    for _, (x, y) in zip(range(3), loader):
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    n = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kahan = sum(c.numel() * c.element_size() for c in opt.weights.compensation)
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k != "step")
    # weights 2 + Kahan 2 + exp_avg 2 + exp_avg_sq 2 bytes; fp32 AdamW would hold 4 + 4 + 4 = 12 (16 with fp32 grads)
    assert weights / n == 2 and kahan / n == 2 and state / n == 4
    assert (weights + kahan + state) / n == 8
    # no fp32 copy of the weights outlives prepare, and the optimizer sees none between steps
    assert all(not m for m in acc._prepared.registry.originals.values())
    assert all(s.numel() == 0 and s.grad is None for _, s in opt.weights.pairs)
    assert acc.free_step_buffers is free


@pytest.mark.parametrize("free", [False, True], ids=["keep-step-buffers", "free-step-buffers"])
def test_master_fp32_gradient_buffer_is_made_at_the_first_step_and_kept_only_without_free_step_buffers(free):
    """bf16-master's one full-size fp32 gradient buffer (4 bytes per parameter): none after prepare; made at
    the first step, clipped or not; then kept between steps (free_step_buffers=False, a CPU's default) or
    released after each (True). Steady steps hold the same memory either way, clipped or not."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    acc = ampkit.Accelerator("bf16-master", device="cpu", free_step_buffers=free)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    n = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def fp32_bytes_held() -> int:  # every distinct fp32 storage alive in the process
        gc.collect()
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in gc.get_objects()
            if type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.float32 and t.device.type == "cpu"
        }
        return sum(storages.values())

    held = [fp32_bytes_held()]
    for clip in (False, False, False, True, False):
        acc.backward(F.cross_entropy(model(x), y))
        if clip:
            acc.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        held.append(fp32_bytes_held())
    moments = sum(v.untyped_storage().nbytes() for st in opt.state.values() for k, v in st.items() if k != "step")
    assert moments == 8 * n
    assert held[1] - held[0] >= moments + (0 if free else 4 * n), held  # the moments (+ the kept gradient buffer)
    assert len(set(held[1:])) == 1, held  # steady, clipped or not
    assert (held[1] - held[0] - moments) // (4 * n) == (0 if free else 1), held


def test_free_step_buffers_defaults_by_device_and_preset_and_rejects_non_bools():
    # On a CPU freeing the full-size step buffers costs 6-14% of a clipped or loss-scaled step (page faults,
    # benchmarks/RESULTS.md): the -master presets keep them, bf16-true (the memory preset) frees them.
    assert ampkit.Accelerator("fp32", device="cpu").free_step_buffers is True
    assert ampkit.Accelerator("bf16-true", device="cpu").free_step_buffers is True
    assert ampkit.Accelerator("bf16-master", device="cpu").free_step_buffers is False
    assert ampkit.Accelerator("fp16-master", device="cpu").free_step_buffers is False
    assert ampkit.Accelerator("bf16-master", device="cpu", free_step_buffers=True).free_step_buffers is True
    with pytest.raises(TypeError, match=r"free_step_buffers='yes': expected True or False"):
        ampkit.Accelerator("fp32", device="cpu", free_step_buffers="yes")


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-master"])
def test_gradients_held_across_the_step_keep_their_values(precision):
    """A gradient the loop keeps (for logging) after optimizer.step() must stay readable: the step's
    fp32 buffers are dropped, not freed under it."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = ampkit.Accelerator(precision, device="cpu")
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=32))
    for _, (x, y) in zip(range(3), loader):
        acc.backward(F.cross_entropy(model(x), y))
        acc.clip_grad_norm_(1e9)  # unscales: the optimizer's fp32 gradients exist from here
        held = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        before = [g.clone() for g in held]
        opt.step()
        opt.zero_grad()
        assert_bitwise_equal(held, before)


def test_bf16_true_optimizer_load_state_dict_restores_the_moments():
    """opt.load_state_dict (a rollback, or a checkpoint of one's own) must replace bf16-true's
    stored optimizer state, not be overwritten by it at the next step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator("bf16-true", device="cpu")
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=32))
    batches = [b for _, b in zip(range(8), loader)]

    def step(x, y, clip_only=False):
        acc.backward(F.cross_entropy(model(x), y))
        acc.clip_grad_norm_(1e9)
        if not clip_only:
            opt.step()
            opt.zero_grad()

    for x, y in batches[:4]:
        step(x, y)
    import copy

    saved = copy.deepcopy(opt.state_dict())
    for x, y in batches[4:7]:
        step(x, y)
    opt.load_state_dict(saved)
    step(*batches[7], clip_only=True)  # the state is now in the fp32 working buffers the step will use
    shadows = [s for _, s in opt.weights.pairs]
    for i, shadow in enumerate(shadows):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[shadow][key], saved["state"][i][key].float()), (i, key)
