"""``python -m axon4d.train`` and ``torchrun ... -m axon4d.train``: parse the flags, run the job.

The help text is the package's docstring; the flags are ``TrainConfig``'s fields (``config``).
Before the job makes a tensor, this entry puts host tensors in transparent huge pages
(``axon4d.device.environment.use_huge_pages``: sets ``THP_MEM_ALLOC_ENABLE=1`` unless the environment already
sets it; ``THP_MEM_ALLOC_ENABLE=0`` turns it off). Importing axon4d does not.
"""

import argparse
import sys

from axon4d.device.environment import HUGE_PAGES_ENV, use_huge_pages
from axon4d.reliability.errors import run, take_debug_flag
from axon4d.train import __doc__ as DESCRIPTION
from axon4d.train import add_arguments, main

EPILOG = (
    f"Host memory: this entry sets {HUGE_PAGES_ENV}=1 (torch's host allocator asks for transparent\n"
    f"huge pages; axon4d.device.environment.use_huge_pages) unless the environment sets it; {HUGE_PAGES_ENV}=0\n"
    "turns it off. Importing axon4d sets nothing.\n\n"
    "A refused input (a bad flag value, a checkpoint that does not match) ends the job with its one\n"
    "message and exit code 2; --debug anywhere on the line shows the traceback."
)

if __name__ == "__main__":
    use_huge_pages()  # before the job's first tensor: torch reads it at its first host allocation
    argv = take_debug_flag(sys.argv[1:])  # --debug: refusals with their traceback (axon4d.reliability.errors)
    parser = argparse.ArgumentParser(
        prog="python -m axon4d.train",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    raise SystemExit(run(lambda: main(args), "axon4d train"))
