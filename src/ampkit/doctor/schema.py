"""`DOCTOR_SCHEMA`: the contract of `ampkit doctor --json` (and of what `DoctorSession` returns)."""

from __future__ import annotations

from typing import Any

from ampkit.doctor.phases import PHASES

_NUM = {"type": "number", "minimum": 0}
_NUM_OR_NULL = {"type": ["number", "null"], "minimum": 0}


def _obj(required: dict[str, Any], **described: str) -> dict[str, Any]:
    props = {k: (dict(v, description=described[k]) if k in described else v) for k, v in required.items()}
    return {"type": "object", "additionalProperties": False, "required": list(required), "properties": props}


_SITE = _obj(
    {"file": {"type": "string"}, "line": {"type": "integer", "minimum": 0}, "code": {"type": "string"},
     "call": {"type": "string"}, "via": {"type": ["string", "null"]}, "per_step": _NUM},
    file="The user's file that caused the sync.",
    code="The source line there.",
    call="The Tensor method that read the value (item, __float__, __format__, ...) or 'cuda-sync'.",
    via="The library line that made the read on the user's behalf (e.g. ampkit/optim.py:245); null: the user's.",
)

_ESTIMATE = _obj(
    {"gpu": {"type": "string"}, "dtype": {"enum": ["fp32", "bf16", "fp16"]}, "step_s": _NUM, "host_s": _NUM,
     "device_s": _NUM, "bound": {"enum": ["host", "device"]}, "speedup": _NUM},
    speedup="Measured step time here over the estimate (> 1: the GPU is faster).",
)

_FINDING = _obj(
    {"id": {"enum": ["data-wait", "busy-threads", "overhead-bound", "small-batch", "precision", "sync"]},
     "title": {"type": "string", "minLength": 1}, "evidence": {"type": "string", "minLength": 1},
     "fix": {"type": "string", "minLength": 1}, "saved_s": _NUM, "saved_share": _NUM,
     "saved_on_gpu_s": _NUM_OR_NULL},
    saved_s="Estimated seconds saved per step on this device (0: the issue costs nothing here).",
    saved_on_gpu_s="Estimated seconds saved per step on the reference GPU, where that differs.",
)

DOCTOR_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://ampkit.invalid/schemas/doctor-v1.json",
    "title": "ampkit doctor",
    "description": "`ampkit doctor --json`: where a training step's time goes, and what to change.",
    **_obj({
        "schema_version": {"const": 1},
        "ampkit_version": {"type": "string"},
        "torch": {"type": "string"},
        "subject": _obj({"kind": {"enum": ["script", "task", "loop"]}, "name": {"type": "string"},
                         "argv": {"type": "array", "items": {"type": "string"}}}),
        "device": _obj({"device": {"type": "string"}, "name": {"type": "string"},
                        "threads": {"type": "integer", "minimum": 1}, "precision": {"type": "string"},
                        "precision_reason": {"type": "string"}, "bf16_fast": {"type": "boolean"}}),
        "steps": _obj({"warmup": {"type": "integer", "minimum": 0}, "profiled": {"type": "integer", "minimum": 1},
                       "timed": {"type": "integer", "minimum": 0}, "requested": {"type": "integer", "minimum": 1},
                       "complete": {"type": "boolean"}}),
        "step": _obj({"time_s": _NUM, "host_s": _NUM, "samples": _NUM_OR_NULL, "samples_per_s": _NUM_OR_NULL},
                     time_s="Median step time (on CUDA from device events; else the host clock).",
                     host_s="Median host time per step; the phases (medians too) add up to it.",
                     samples="Samples per step from the prepared DataLoader's batches; null: unknown."),
        "phases": {
            "type": "array", "minItems": len(PHASES) + 1, "maxItems": len(PHASES) + 1,
            "items": _obj({"name": {"enum": [*PHASES, "other"]}, "seconds": _NUM, "share": _NUM}),
        },
        "ops": _obj({
            "per_step": _NUM, "mean_us": _NUM, "floor_us": _NUM, "seconds_per_step": _NUM, "work_s_per_step": _NUM_OR_NULL,
            "kernel_share": _NUM, "flops_per_step": _NUM, "bytes_per_step": _NUM, "matmul_share": _NUM,
            "profiler_scale": _NUM, "cuda_kernels_per_step": _NUM_OR_NULL, "cuda_kernel_mean_us": _NUM_OR_NULL,
            "top": {"type": "array", "items": _obj({"name": {"type": "string"}, "per_step": _NUM,
                                                    "us_per_step": _NUM, "median_us": _NUM, "share": _NUM,
                                                    "matmul": {"type": "boolean"}})},
        }, per_step="Kernel ops per step: the outermost ops that do work on a backend (about one GPU kernel each).",
            kernel_share="Share of the compute time (data wait excluded) spent inside kernels.",
            work_s_per_step="Seconds the kernels' FLOPs and bytes need at this device's measured matmul peak and "
                            "copy bandwidth; null: not measured.",
            profiler_scale="Factor applied to profiled op times to match the unprofiled step."),
        "syncs": _obj({"per_step": _NUM, "method": {"enum": ["tensor-reads", "cuda-sync-debug"]},
                       "real": {"type": "boolean"}, "sites": {"type": "array", "items": _SITE},
                       "cuda_debug": {"type": ["string", "null"]}},
                      real="True on a GPU (the syncs happened); false on a CPU (they would happen on a GPU)."),
        "utilisation": _obj({"achieved_flops_per_s": _NUM, "peak_flops_per_s": _NUM_OR_NULL,
                             "fraction": _NUM_OR_NULL, "peak_source": {"type": "string"}}),
        "bound": _obj({"kind": {"enum": ["overhead", "compute", "data"]}, "reason": {"type": "string"}}),
        "advisor": _obj({
            "here": _obj({"device": {"type": "string"}, "name": {"type": "string"}, "step_s": _NUM}),
            "reference_gpu": {"type": "string"},
            "estimates": {"type": "array", "items": _ESTIMATE},
            "verdict": {"type": "string", "minLength": 1},
            "assumptions": {"type": "string"},
            "gpus": {"type": "array", "items": _obj({
                "name": {"type": "string"}, "fp32_tflops": _NUM, "bf16_tflops": _NUM_OR_NULL,
                "fp16_tflops": _NUM, "memory_gbps": _NUM, "launch_us": _NUM, "source": {"type": "string"}})},
        }),
        "findings": {"type": "array", "items": _FINDING,
                     "description": "Ranked: most time saved on this device first, then most saved on the GPU."},
        "notes": {"type": "array", "items": {"type": "string"}},
    }),
}


def validate_result(result: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` if `result` breaks `DOCTOR_SCHEMA` (needs jsonschema)."""
    import jsonschema

    jsonschema.validate(result, DOCTOR_SCHEMA, cls=jsonschema.Draft202012Validator)
