"""Reduced-precision inference: export a trained model in fp32, bf16, fp16 or int8 and measure what it buys.

    exported = ampkit.export(model, example_batch, precision="int8", backend="onnx", out="model.onnx")
    exported.run(batch)                       # served by onnxruntime (backend="torch": a torch.export program)
    ampkit.Exported.load("model.onnx")        # in another process: no code runs from the file
    ampkit.export(model, batch, "bf16", acc=acc)   # from a prepared setup: the fp32 truth, not rounded weights

`measure(task)` trains a built-in task in fp32, exports it in every precision and backend and
measures latency, file size, peak memory and the held-out metric (`ampkit export --task NAME`).
"""

from ampkit.inference import PRECISIONS, SUPPORTED, Exported, ExportError, export, fp32_copy, load
from ampkit.tools.export.measure import auto_choice, measure
from ampkit.tools.export.report import SCHEMA, InferenceReport, InferenceRow, format_text, render_html_section, write

__all__ = [
    "PRECISIONS",
    "SCHEMA",
    "SUPPORTED",
    "ExportError",
    "Exported",
    "InferenceReport",
    "InferenceRow",
    "auto_choice",
    "export",
    "format_text",
    "fp32_copy",
    "load",
    "measure",
    "render_html_section",
    "write",
]
