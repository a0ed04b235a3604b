"""What the machine's devices can do: the device capability table, the CPU's features, and `auto`'s choice
with its reason."""
