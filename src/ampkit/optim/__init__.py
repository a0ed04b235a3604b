"""Drop-in optimizers for bf16 weights: `AdamW`, `Adam` and `SGD` with bf16-true's compensated (Kahan) update.

    model = model.to(torch.bfloat16)
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-3)

Each is a subclass of torch's optimizer of the same name (`isinstance(opt, torch.optim.AdamW)` holds, so
Hugging Face's `Trainer`, Lightning's `configure_optimizers` and any LR scheduler accept it). bf16 weights are
updated by bf16-true's own fused kernel (`ampkit.precision.kahan`); every other weight by torch's step.

`GradScaler` is torch's `torch.amp.GradScaler`, bit for bit, that also learns without waiting whether each step
was applied or skipped (for a scheduler that follows applied steps) and raises on a collapsed scale.
"""

from __future__ import annotations

from ampkit.optim.dropin import SGD, Adam, AdamW, CompensatedStep
from ampkit.optim.scaler import GradScaler

__all__ = ["SGD", "Adam", "AdamW", "CompensatedStep", "GradScaler"]
