"""The W&B and MLflow trackers, read back from what the real packages wrote (W&B offline: its run file, through
W&B's own protobuf records; MLflow: a local file store, through MLflow's client), and the figures beyond the
loss: tokens/s, `acc.track` values, the lost-update share. `ampkit.Tracker` (for the drop-ins) in
test_tracker_dropins.py."""

from __future__ import annotations

import json
import re
import struct
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit
import ampkit.engine.writers

STEPS, EVERY, BATCH, SEQ, VOCAB = 8, 4, 4, 6, 11


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def train_lm(tmp_path, precision="fp32", lr=0.1, resume=False, ckpt="ckpt", **kwargs):
    """A tiny LM over token-id batches through a prepared DataLoader, STEPS steps, `acc.track`ing its
    accuracy; with `resume`, a second run that resumes the first's checkpoint and trains STEPS more."""
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ))
    acc = ampkit.Accelerator(precision=precision, device="cpu", log_dir=tmp_path / "runs", **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(ids), BATCH))
    if resume:
        acc.resume(tmp_path / ckpt)
    for (x,) in loader:
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))
        acc.track("accuracy", (logits.argmax(-1) == x[:, 1:]).float().mean())
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    acc.save_checkpoint(tmp_path / ckpt)
    return acc


def test_the_records_carry_tokens_per_second_and_the_tracked_values(tmp_path):
    train_lm(tmp_path, log_to="jsonl", log_every=EVERY)
    records = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8]
    for r in records:
        assert r["tokens_per_s"] / r["samples_per_s"] == pytest.approx(SEQ)  # the batches' token ids
        assert 0 <= r["track/accuracy"] <= 1
        assert r["lost_update_share"] is None  # fp32 weights: not measured


def test_two_fresh_runs_into_one_folder_are_told_apart_by_their_run(tmp_path):
    runs = [train_lm(tmp_path, ckpt=f"ckpt{i}", log_to="jsonl", log_every=EVERY).run_id for i in range(2)]
    records = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["run"], r["step"]) for r in records] == [(runs[0], 4), (runs[0], 8), (runs[1], 4), (runs[1], 8)]


def test_the_lost_update_share_shows_what_bf16_weights_round_away_and_bf16_true_keeps(tmp_path):
    """At Adam's ~1e-4 steps, half a bf16 ulp is larger than the update for most weights: plain bf16 storage
    loses most updates, bf16-true's compensation keeps them (the detector itself: test_numerics.py)."""
    plain = ampkit.Precision(name="bf16-plain", compute_dtype=torch.bfloat16, param_dtype=torch.bfloat16)
    shares = {}
    for name, precision in (("plain", plain), ("bf16-true", "bf16-true")):
        train_lm(tmp_path / name, precision, lr=1e-4, log_to="jsonl", log_every=EVERY)
        lines = (tmp_path / name / "runs" / "metrics.jsonl").read_text().splitlines()
        shares[name] = [json.loads(line)["lost_update_share"] for line in lines]
    assert all(s > 0.5 for s in shares["plain"]) and all(s < 0.05 for s in shares["bf16-true"]), shares


def _wandb_history(folder):
    """The history rows of the W&B offline runs under `folder`: the run files are LevelDB-style logs (32 KiB
    blocks of crc/length/type-framed chunks after a 7-byte ':W&B' header) of W&B's `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunks = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last chunk of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(chunks)
                chunks = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append(
                        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                    )
    return rows


def test_wandb_offline_run_reads_back_and_a_resumed_run_writes_on_in_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "ampkit-test")
    first = train_lm(tmp_path, "fp16-mixed", log_to="wandb", log_every=EVERY)
    ampkit.engine.writers.finish_all()  # as at exit: the W&B run is finished and its file complete
    train_lm(tmp_path, "fp16-mixed", resume=True, log_to="wandb", log_every=EVERY)
    ampkit.engine.writers.finish_all()
    rows = _wandb_history(tmp_path / "runs")
    assert [r["_step"] for r in rows] == [4, 8, 12, 16]  # the resumed run goes on numbering
    assert all(r["ampkit/loss_scale"] > 0 and "ampkit/skipped_steps" in r for r in rows)
    assert all("ampkit/tokens_per_s" in r and "ampkit/track/accuracy" in r for r in rows)
    # offline-run-<date>_<time>-<run id>, with "-1", "-2" where W&B made another folder in the same second
    runs = {
        re.match(r"offline-run-\d+_\d+-([0-9a-f]+)", p.name)[1] for p in (tmp_path / "runs").glob("wandb/offline-run-*")
    }
    assert runs == {first.run_id}  # both processes' records in one W&B run, named by the training run


def test_mlflow_file_store_reads_back_and_a_resumed_run_writes_on_in_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = f"file://{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    first = train_lm(tmp_path, "fp16-mixed", log_to=["mlflow", "jsonl"], log_every=EVERY)
    ampkit.engine.writers.finish_all()
    train_lm(tmp_path, "fp16-mixed", resume=True, log_to=["mlflow", "jsonl"], log_every=EVERY)
    ampkit.engine.writers.finish_all()
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("ampkit").experiment_id])
    assert run.data.tags["ampkit_run_id"] == first.run_id and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "ampkit/loss")
    records = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [m.step for m in history] == [r["step"] for r in records] == [4, 8, 12, 16]
    assert {r["run"] for r in records} == {first.run_id}  # the resumed run's records name the same run
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    scale = client.get_metric_history(run.info.run_id, "ampkit/loss_scale")
    assert [m.value for m in scale] == [r["loss_scale"] for r in records]


def test_a_tracker_that_cannot_start_is_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow refuses its file store without it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_lm(tmp_path, log_to=["mlflow", "jsonl"], log_every=EVERY)
    said = [str(w.message) for w in caught if "log_to='mlflow'" in str(w.message)]
    assert len(said) == 1 and "could not start" in said[0]
    assert len((tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()) == 2  # the others went on


def test_a_missing_package_is_one_warning_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.warns(UserWarning, match=r"log_to='wandb': the wandb package is not installed.*ampkit\[wandb\]"):
        acc = ampkit.Accelerator(device="cpu", log_to=["wandb", "jsonl"], log_dir=tmp_path / "runs")
    assert len(acc.events) == 1  # jsonl still listens


def test_fp8_mixed_logs_the_share_of_elements_fp8_flushes_to_zero(tmp_path):
    """One outlier of 1e6 in the fp8 layer's weight: scaled by it, every other weight (~0.1) falls below
    e4m3's smallest subnormal and becomes 0, which the share shows; without it, nothing is flushed."""
    pytest.importorskip("torchao")
    shares = {}
    for name, outlier in (("plain", None), ("outlier", 1e6)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        if outlier is not None:
            with torch.no_grad():
                model[2].weight[0, 0] = outlier
        acc = ampkit.Accelerator(
            "fp8-mixed",
            device="cpu",
            fp8_emulate=True,
            fp8_min_weight=0,
            log_to="jsonl",
            log_every=EVERY,
            log_dir=tmp_path / name,
        )
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
        assert [n for n, why in acc.fp8.layers if why is None] == ["2"]  # the middle layer runs in fp8
        for _ in range(STEPS):
            acc.backward(model(torch.randn(8, 16)).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # an evaluation forward between steps is not sampled
                model(torch.randn(8, 16))
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        shares[name] = [json.loads(line)["fp8_underflow_share"] for line in lines]
    assert shares["plain"] == [0.0, 0.0]
    # the weight's 1023 other elements, of its 1024 and the input's nonzero elements (ReLU zeroes about half)
    assert all(0.75 < s < 0.95 for s in shares["outlier"]), shares


def test_mfu_is_six_flops_per_weight_and_token_over_the_gpus_datasheet_peak(tmp_path, monkeypatch):
    import ampkit.engine.tracking as tracking
    from ampkit.hardware.capability import GPU_MODELS, gpu_for_device, peak_tflops

    train_lm(tmp_path / "cpu", log_to="jsonl", log_every=EVERY)  # a CPU: no datasheet, no MFU
    assert all(json.loads(line)["mfu"] is None for line in (tmp_path / "cpu" / "runs" / "metrics.jsonl").open())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    a100 = gpu_for_device(torch.device("cuda", 0))
    assert a100 is GPU_MODELS["A100"] and peak_tflops(a100, torch.bfloat16) == 312.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")  # the lent machine's
    assert gpu_for_device(torch.device("cuda", 0)) is GPU_MODELS["H200"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(tracking, "device_peak", lambda device, dtype: 312e12 if dtype == torch.bfloat16 else None)
    acc = train_lm(tmp_path / "gpu", "bf16-mixed", log_to="jsonl", log_every=EVERY)  # as if on that A100
    weights = sum(p.numel() for p in acc.models[0].parameters())
    for line in (tmp_path / "gpu" / "runs" / "metrics.jsonl").open():
        r = json.loads(line)
        assert r["mfu"] == pytest.approx(6 * weights * r["tokens_per_s"] / 312e12, rel=1e-9)
