"""What a precision preset is and keeps: the policy records, the loss scaler and its outcomes, fp8, fp32
master weights and Kahan-compensated bf16 weights.

Importing the package itself imports no torch: the command line reads `ampkit.precision.names` before
torch is loaded.
"""
