"""Entry point of each process when `ampkit compare --nproc N` runs a precision under torchrun."""

import sys

from ampkit.compare import _torchrun_worker

if __name__ == "__main__":
    _torchrun_worker(*sys.argv[1:4])
