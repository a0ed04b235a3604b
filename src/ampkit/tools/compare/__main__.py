"""Each torchrun process of `ampkit compare --nproc N`: `python -m ampkit.tools.compare SPEC OUT PROGRESS`."""

import sys

from ampkit.tools.compare.turns import torchrun_worker

if len(sys.argv) != 4:
    sys.exit("this is the worker `ampkit compare --nproc N` starts under torchrun; run `ampkit compare` instead")
torchrun_worker(*sys.argv[1:4])
