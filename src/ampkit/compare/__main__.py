"""Each torchrun process of `ampkit compare --nproc N`: `python -m ampkit.compare SPEC OUT PROGRESS`."""

import sys

from ampkit.compare.spawn import torchrun_worker

torchrun_worker(*sys.argv[1:4])
