"""The contract of `ampkit info --json`: `INFO_SCHEMA`, the JSON Schema every report `collect_info`
returns validates against (a test checks), kept apart so that the contract reads on its own.
"""

from __future__ import annotations

from typing import Any

from ampkit.hardware.capability import CAPABILITIES, CPU_FLAGS
from ampkit.precision.policy import PRESETS

#: One report as `collect_info` returns it and `--json` prints it (`INFO_SCHEMA`).
Info = dict[str, Any]


def _object(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A JSON object with exactly `properties`, each one required."""
    return {
        "type": "object",
        **extra,
        "additionalProperties": False,
        "required": list(properties),
        "properties": properties,
    }


_FACT = _object(
    {
        "supported": {"type": ["boolean", "null"], "description": "null: unknown (never a guess)."},
        "source": {"type": "string", "minLength": 1, "description": "Where the fact comes from."},
    }
)
_CAPABILITIES = _object(
    {c: {"$ref": "#/$defs/fact"} for c in CAPABILITIES},
    description="Per dtype: does the device have hardware that runs matmuls in it faster than fp32?",
)
_BENCH_RESULT = _object(
    {
        "dtype": {"enum": ["fp32", "bf16", "fp16"]},
        "size": {"type": ["integer", "null"], "minimum": 1, "description": "n of the n×n @ n×n matmul."},
        "iterations": {"type": "integer", "minimum": 0},
        "seconds": {"type": "number", "minimum": 0, "description": "Time the timed iterations took."},
        "flops_per_s": {"type": ["number", "null"], "exclusiveMinimum": 0, "description": "2n³ per matmul."},
        "ratio_to_fp32": {"type": ["number", "null"], "exclusiveMinimum": 0},
        "table": {"type": ["boolean", "null"], "description": "The capability table's fact for this dtype."},
        "fast_here": {
            "type": ["boolean", "null"],
            "description": "Measured: ratio_to_fp32 >= FAST_RATIO (null for fp32 or on error).",
        },
        "agreement": {
            "enum": ["agrees", "disagrees", "busy", "noise", None],
            "description": "What the ratio says of `table` (ampkit.tools.info.bench.agreement): busy: the machine was "
            "busy, noise: within NOISE of FAST_RATIO; null for fp32, on error, or where the table does not know.",
        },
        "error": {"type": ["string", "null"], "description": "Why the dtype could not be measured."},
    }
)
_LOAD = _object(
    {
        "load_average": {
            "type": ["number", "null"],
            "minimum": 0,
            "description": "1-minute load average less what the bench can have added (ampkit.tools.load.own_load), "
            "or the cores busy in a quarter second's look where fewer (ampkit.tools.load.busy_cores); null where the "
            "OS has none.",
        },
        "cores": {"type": "integer", "minimum": 1},
        "threads": {"type": "integer", "minimum": 1, "description": "torch's threads."},
        "matmul_slowdown": {
            "type": ["number", "null"],
            "minimum": 0,
            "description": "Mean / fastest of a burst of small fp32 matmuls (idle: ~1-1.3); null on a GPU.",
        },
        "busy": {"type": "boolean", "description": "Others held over half the cores, or the burst ran 2x slow."},
    },
    description="How busy the machine was while the bench ran (ampkit.tools.load.check_load; the busier of the looks "
    "before and after): a busy machine's figures are not compared with the table.",
)

INFO_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://ampkit.invalid/schemas/info-v1.json",
    "title": "ampkit info",
    "description": "`ampkit info --json`: versions, devices, what each runs fast (with sources), the "
    "preset precision='auto' picks on `device`, and an optional matmul benchmark.",
    "$defs": {"fact": _FACT, "capabilities": _CAPABILITIES},
    **_object(
        {
            "schema_version": {"const": 1},
            "ampkit_version": {"type": "string"},
            "torch": {"type": "string"},
            "cuda": {"type": ["string", "null"], "description": "CUDA torch was built with; null: none."},
            "cudnn": {"type": ["string", "null"], "description": "cuDNN version, e.g. '9.1.0'; null: none."},
            "hip": {"type": ["string", "null"], "description": "ROCm/HIP torch was built with; null: none."},
            "python": {"type": "string"},
            "platform": {"type": "string"},
            "device": {"type": "string", "description": "The device the recommendation and benchmark are for."},
            "cpu": _object(
                {
                    "name": {"type": "string"},
                    "threads": {"type": "integer", "minimum": 1, "description": "torch.get_num_threads()."},
                    "flags": _object(
                        {f: {"type": "boolean"} for f in CPU_FLAGS},
                        type=["object", "null"],
                        description="Each flag a boolean under exactly its Linux name; null: the OS did not say.",
                    ),
                    "flags_source": {"type": "string"},
                    "capabilities": {"$ref": "#/$defs/capabilities"},
                }
            ),
            "gpus": {
                "type": "array",
                "items": _object(
                    {
                        "device": {"type": "string", "pattern": r"^cuda:\d+$"},
                        "name": {"type": "string"},
                        "compute_capability": {
                            "type": "string",
                            "pattern": r"^(\d+\.\d+|gfx[0-9a-f]+)$",
                            "description": "NVIDIA's major.minor; on ROCm the gfx architecture.",
                        },
                        "memory_bytes": {"type": "integer", "minimum": 0},
                        "sm_count": {"type": "integer", "minimum": 0},
                        "capabilities": {"$ref": "#/$defs/capabilities"},
                    }
                ),
            },
            "mps": _object(
                {"capabilities": {"$ref": "#/$defs/capabilities"}},
                type=["object", "null"],
                description="Apple's GPU, or null where MPS is not available.",
            ),
            "recommended": _object(
                {"preset": {"enum": list(PRESETS)}, "reason": {"type": "string", "minLength": 1}},
                description="What precision='auto' picks on `device` (ampkit.hardware.capability.auto_precision).",
            ),
            "bench": _object(
                {
                    "device": {"type": "string"},
                    "seconds": {"type": "number", "exclusiveMinimum": 0, "description": "Budget, all dtypes."},
                    "threads": {"type": "integer", "minimum": 1},
                    "float32_matmul_precision": {
                        "enum": ["highest", "high", "medium"],
                        "description": "Not 'highest': fp32 matmuls may use tf32/bf16.",
                    },
                    "load": _LOAD,
                    "results": {"type": "array", "items": _BENCH_RESULT},
                },
                type=["object", "null"],
                description="Matmul throughput per dtype on `device` (--bench); null when not run.",
            ),
        }
    ),
}
