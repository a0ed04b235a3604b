"""The precision presets' names, without torch: the command line lists and checks them before it imports
torch, so that `ampkit --help` and a typo'd preset answer at once.

`ampkit.precision.policy.PRESETS` defines the presets themselves, and `ampkit.precision.policy.PRESET_NAMES` derives
the names from them; tests/test_cli_fast.py checks that this copy is the same tuple.
"""

PRESET_NAMES: tuple[str, ...] = (
    "fp32",
    "bf16-mixed",
    "fp16-mixed",
    "fp16-master",
    "bf16-master",
    "bf16-true",
    "fp8-mixed",
    "auto",
)
