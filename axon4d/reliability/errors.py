"""How a command ends on bad input: one clear message and a non-zero exit, not a traceback.

A *refusal* is an error the input caused and whose message says what to change: a bad flag value
or file (``ValueError``, and ``axon4d.files.ckptfiles.CheckpointError``, a subclass), a path that is
missing, in the way or not writable (``FileNotFoundError``, ``FileExistsError``,
``NotADirectoryError``, ``IsADirectoryError``, ``PermissionError``), a run stopped on non-finite
values (``FloatingPointError``). The ``axon4d`` command and ``python -m axon4d.train`` print a
refusal as ``<prog>: error: <message>`` (with the rank when the job has several) and exit with
``EXIT_REFUSED``; any other exception is a fault of the program and keeps its traceback. With
``--debug`` anywhere on the command line (it sets ``AXON4D_DEBUG=1`` for the process) refusals
show their traceback too.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence

from axon4d.grid.launch_env import env_rank

#: the environment variable ``--debug`` sets: refusals print their traceback
DEBUG_ENV = "AXON4D_DEBUG"
#: the flag, accepted anywhere on the command line
DEBUG_FLAG = "--debug"
#: exit code of a refused input (argparse's for a bad flag)
EXIT_REFUSED = 2
#: exit code of an interrupt (128 + SIGINT)
EXIT_INTERRUPTED = 130
#: the exception types that are refusals
REFUSALS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    FloatingPointError,
)
#: set on an exception once its message has been printed (by the watchdog's report of a failed rank)
_REPORTED = "_axon4d_reported"


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is bad input with a message for the user (the module docstring)."""
    return isinstance(error, REFUSALS)


def debugging() -> bool:
    """Whether tracebacks of refusals are wanted (``--debug``, ``AXON4D_DEBUG=1``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def take_debug_flag(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--debug``; if it was there, set ``AXON4D_DEBUG=1`` for this process (and
    the ranks it spawns)."""
    rest = [a for a in argv if a != DEBUG_FLAG]
    if len(rest) != len(argv):
        os.environ[DEBUG_ENV] = "1"
    return rest


def mark_reported(error: BaseException) -> None:
    """Note that ``error``'s message has been printed, so the command does not print it again."""
    try:
        setattr(error, _REPORTED, True)
    except AttributeError:  # an exception type without a __dict__
        pass


def format_error(error: BaseException, prog: str, rank: int | None = None) -> str:
    """What is printed for ``error``: the one message of a refusal (``<prog>: error: ...``, with
    ``rank`` when given), or under ``--debug`` and for any other exception its traceback."""
    where = f"{prog}: rank {rank}" if rank is not None else prog
    if is_refusal(error) and not debugging():
        return f"{where}: error: {error}"
    tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return f"{where} failed:\n{tb}".rstrip()


def run(main: Callable[[], int | None], prog: str) -> int:
    """Run a command's ``main``; a refusal ends it with its message on stderr (once per rank: not
    again if the watchdog printed it) and ``EXIT_REFUSED``, an interrupt with ``EXIT_INTERRUPTED``;
    other exceptions propagate with their traceback."""
    try:
        return int(main() or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BaseException as e:
        if not is_refusal(e):
            raise
        if not getattr(e, _REPORTED, False):
            print(format_error(e, prog, env_rank()), file=sys.stderr, flush=True)
        return EXIT_REFUSED
