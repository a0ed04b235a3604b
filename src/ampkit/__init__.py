"""ampkit: mixed-precision training for PyTorch in four lines."""
