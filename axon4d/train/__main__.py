"""``python -m axon4d.train`` and ``torchrun ... -m axon4d.train``: parse the flags, run the job.

The help text is the package's docstring; the flags are ``TrainConfig``'s fields (``config``).
"""

import argparse

from axon4d.train import __doc__ as DESCRIPTION
from axon4d.train import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m axon4d.train", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
