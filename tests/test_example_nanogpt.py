"""examples/nanogpt_shaped.py equals its unconverted twin (torch.autocast, its own accumulation
division and clip) bit for bit. (That the saved model loads without ampkit: tests/test_scripts.py.)"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import nanogpt_shaped as ex  # noqa: E402


def native_twin(precision: str, c: ex.Config) -> dict[str, list[float]]:
    """The loop as nanoGPT writes it, before the conversion."""
    torch.manual_seed(c.seed)
    data = ex.make_data(c)
    model = ex.GPT(c)
    optimizer = model.configure_optimizers(0.1, c.learning_rate)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ("train", "val"):
            g = torch.Generator().manual_seed(c.seed + 1)
            losses = torch.zeros(c.eval_iters)
            for k in range(c.eval_iters):
                with ctx:
                    _, loss = model(*ex.get_batch(data[split], c, g))
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    g = torch.Generator().manual_seed(c.seed)
    X, Y = ex.get_batch(data["train"], c, g)
    record: dict[str, list[float]] = {"loss": [], "val": []}
    for it in range(c.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = ex.get_lr(it, c)
        if it % c.eval_interval == 0:
            record["val"].append(estimate_loss()["val"])
        for _micro_step in range(c.gradient_accumulation_steps):
            with ctx:
                _, loss = model(X, Y)
                loss = loss / c.gradient_accumulation_steps
            X, Y = ex.get_batch(data["train"], c, g)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record["loss"].append(loss.item() * c.gradient_accumulation_steps)
    record["params"] = [p.detach().clone() for p in model.parameters()]  # type: ignore[assignment]
    return record


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_converted_nanogpt_loop_equals_its_autocast_twin_bitwise(precision, tmp_path):
    c = ex.Config(max_iters=12)
    expected = native_twin(precision, c)
    got = ex.train(precision, c, out_dir=tmp_path)
    assert got["loss"] == expected["loss"]
    assert got["val"] == expected["val"]
    saved = torch.load(tmp_path / "model.pt", weights_only=False)
    for a, b in zip(saved.parameters(), expected["params"]):
        assert torch.equal(a, b)
    assert (tmp_path / "checkpoints" / "latest").exists()
