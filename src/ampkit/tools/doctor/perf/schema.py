"""`DOCTOR_SCHEMA`: the contract of `ampkit doctor --json` (and of what `DoctorSession` returns)."""

from __future__ import annotations

from typing import Any

#: The measured phases of a step, in step order ("other" is the step time not covered by them).
PHASES: tuple[str, ...] = ("data", "h2d", "forward", "backward", "optimizer")

NUM = {"type": "number", "minimum": 0}
NUM_OR_NULL = {"type": ["number", "null"], "minimum": 0}
STR = {"type": "string"}
TEXT = {"type": "string", "minLength": 1}
INT = {"type": "integer", "minimum": 0}


def obj(required: dict[str, Any], **described: str) -> dict[str, Any]:
    props = {k: (dict(v, description=described[k]) if k in described else v) for k, v in required.items()}
    return {"type": "object", "additionalProperties": False, "required": list(required), "properties": props}


SUBJECT = obj({"kind": {"enum": ["script", "task", "loop"]}, "name": STR, "argv": {"type": "array", "items": STR}})

_SITE = obj(
    {
        "file": STR,
        "line": INT,
        "code": STR,
        "call": STR,
        "via": {"type": ["string", "null"]},
        "per_step": NUM,
        "reads": {"type": "integer", "minimum": 1},
        "steps_seen": INT,
        "every_step": {"type": "boolean"},
    },
    file="The user's file that caused the sync.",
    code="The source line there.",
    call="The Tensor method that read the value (item, __float__, __format__, ...) or 'cuda-sync'.",
    via="The library line that made the read on the user's behalf (e.g. ampkit/engine/optim.py:245); null: the user's.",
    per_step="Its reads over the watched steps, per step.",
    reads="Its reads in the watched steps.",
    steps_seen="In how many of the watched steps it read.",
    every_step="It read in (about) every watched step: the training step's own; false: evaluation or logging "
    "that runs every few steps.",
)

_ESTIMATE = obj(
    {
        "gpu": STR,
        "dtype": {"enum": ["fp32", "bf16", "fp16"]},
        "step_s": NUM,
        "host_s": NUM,
        "device_s": NUM,
        "bound": {"enum": ["host", "device"]},
        "speedup": NUM,
    },
    speedup="here.steady_s over the estimate (> 1: the GPU is faster): the figure the verdict judges by.",
)

_FINDING = obj(
    {
        "id": {
            "enum": ["data-wait", "busy-threads", "overhead-bound", "small-batch", "micro-batch", "precision", "sync"]
        },
        "title": TEXT,
        "evidence": TEXT,
        "fix": TEXT,
        "saved_s": NUM,
        "saved_share": NUM,
        "saved_on_gpu_s": NUM_OR_NULL,
    },
    saved_s="Estimated seconds saved per step on this device (0: the issue costs nothing here).",
    saved_on_gpu_s="Estimated seconds saved per step on the reference GPU, where that differs.",
)

DOCTOR_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://ampkit.invalid/schemas/doctor-v1.json",
    "title": "ampkit doctor",
    "description": "`ampkit doctor --json`: where a training step's time goes, and what to change.",
    **obj(
        {
            "schema_version": {"const": 1},
            "ampkit_version": STR,
            "torch": STR,
            "subject": SUBJECT,
            "device": obj(
                {
                    "device": STR,
                    "name": STR,
                    "threads": {"type": "integer", "minimum": 1},
                    "precision": STR,
                    "precision_reason": STR,
                    "bf16_fast": {"type": "boolean"},
                }
            ),
            "steps": obj(
                {
                    "warmup": INT,
                    "profiled": {"type": "integer", "minimum": 1},
                    "timed": INT,
                    "requested": {"type": "integer", "minimum": 1},
                    "complete": {"type": "boolean"},
                }
            ),
            "step": obj(
                {"time_s": NUM, "host_s": NUM, "samples": NUM_OR_NULL, "samples_per_s": NUM_OR_NULL},
                time_s="Median step time (on CUDA from device events; else the host clock).",
                host_s="Median host time per step; the phases (medians too) add up to it.",
                samples="Samples per step from the prepared DataLoader's batches; null: unknown.",
            ),
            "phases": {
                "type": "array",
                "minItems": len(PHASES) + 1,
                "maxItems": len(PHASES) + 1,
                "items": obj({"name": {"enum": [*PHASES, "other"]}, "seconds": NUM, "share": NUM}),
            },
            "ops": obj(
                {
                    "per_step": NUM,
                    "mean_us": NUM,
                    "floor_us": NUM,
                    "seconds_per_step": NUM,
                    "work_s_per_step": NUM_OR_NULL,
                    "kernel_share": NUM,
                    "flops_per_step": NUM,
                    "bytes_per_step": NUM,
                    "matmul_share": NUM,
                    "profiler_scale": NUM,
                    "cuda_kernels_per_step": NUM_OR_NULL,
                    "cuda_kernel_mean_us": NUM_OR_NULL,
                    "top": {
                        "type": "array",
                        "items": obj(
                            {
                                "name": STR,
                                "per_step": NUM,
                                "us_per_step": NUM,
                                "median_us": NUM,
                                "share": NUM,
                                "matmul": {"type": "boolean"},
                            }
                        ),
                    },
                },
                per_step=(
                    "Kernel ops per step: the outermost ops that do work on a backend (about one GPU kernel each)."
                ),
                kernel_share="Share of the compute time (data wait excluded) spent inside kernels.",
                work_s_per_step="Seconds the kernels' FLOPs and bytes need at this device's measured matmul peak and "
                "copy bandwidth; null: not measured.",
                profiler_scale="Factor applied to profiled op times to match the unprofiled step.",
            ),
            "syncs": obj(
                {
                    "per_step": NUM,
                    "method": {"enum": ["tensor-reads", "cuda-sync-debug"]},
                    "real": {"type": "boolean"},
                    "watched_steps": {"type": "integer", "minimum": 1},
                    "sites": {"type": "array", "items": _SITE},
                    "cuda_debug": {"type": ["string", "null"]},
                },
                per_step="Syncs per training step, of the sites that read in every watched step.",
                real="True on a GPU (the syncs happened); false on a CPU (they would happen on a GPU).",
            ),
            "utilisation": obj(
                {
                    "achieved_flops_per_s": NUM,
                    "peak_flops_per_s": NUM_OR_NULL,
                    "fraction": NUM_OR_NULL,
                    "peak_source": STR,
                }
            ),
            "bound": obj({"kind": {"enum": ["overhead", "compute", "data"]}, "reason": STR}),
            "advisor": obj(
                {
                    "here": obj(
                        {"device": STR, "name": STR, "step_s": NUM, "steady_s": NUM},
                        steady_s="step_s less the time its threads waited for cores (a busy machine); else step_s.",
                    ),
                    "reference_gpu": STR,
                    "estimates": {"type": "array", "items": _ESTIMATE},
                    "verdict": TEXT,
                    "assumptions": STR,
                    "gpus": {
                        "type": "array",
                        "items": obj(
                            {
                                "name": STR,
                                "fp32_tflops": NUM,
                                "bf16_tflops": NUM_OR_NULL,
                                "fp16_tflops": NUM,
                                "memory_gbps": NUM,
                                "launch_us": NUM,
                                "source": STR,
                            }
                        ),
                    },
                }
            ),
            "findings": {
                "type": "array",
                "items": _FINDING,
                "description": "Ranked: most time saved on this device first, then most saved on the GPU.",
            },
            "notes": {"type": "array", "items": STR},
        }
    ),
}


def validate_result(result: dict[str, Any], schema: dict[str, Any] = DOCTOR_SCHEMA) -> None:
    """Raise `jsonschema.ValidationError` if `result` breaks `schema` (needs jsonschema)."""
    import jsonschema

    jsonschema.validate(result, schema, cls=jsonschema.Draft202012Validator)
