"""The ``axon4d`` command: one subcommand per tool, each implemented in its own module.

A subcommand module provides ``add_arguments(parser)`` and ``main(args) -> int``; it is imported
only when its subcommand runs, so ``axon4d plan`` never pays for what ``axon4d train`` imports. A
refused input ends a command with its one message and exit code 2; ``--debug`` anywhere on the
line shows the traceback (``axon4d.reliability.errors``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from axon4d.reliability import errors

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("axon4d.train", "train a GPT or Llama model on the 4D grid, or fine-tune a saved Hugging Face one"),
    "prepare-data": (
        "axon4d.data.prepare",
        "tokenize .txt or .jsonl text with a Hugging Face tokenizer into a token file",
    ),
    "plan": ("axon4d.plan.cli", "price every (x, y, z, data) grid of a job and print the fastest that fit in memory"),
    "calibrate": ("axon4d.measure.calibrate", "measure this machine's compute and communication rates for the planner"),
    "export-hf": (
        "axon4d.export.cli",
        "write a checkpoint's model in Hugging Face format (safetensors shards, config)",
    ),
    "trace": ("axon4d.trace", "merge per-rank timeline dumps into a Chrome/Perfetto trace JSON and a PNG"),
    "demo": ("axon4d.demo", "train an MLP of axon4d.Linear layers and compare it with one process"),
}


def main(argv: list[str] | None = None) -> int:
    """The ``axon4d`` command: ``run_command``, where bad input ends the command with its one
    message and exit code 2 (``axon4d.reliability.errors``; ``--debug`` anywhere for the traceback)."""
    argv = errors.take_debug_flag(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv and argv[0] in COMMANDS else ""
    return errors.run(lambda: run_command(argv), f"axon4d {name}".strip())


def run_command(argv: list[str]) -> int:
    """Parse ``argv`` (a subcommand and its flags) and run the subcommand; its errors propagate."""
    parser = argparse.ArgumentParser(prog="axon4d", description="4D hybrid-parallel transformer training")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    parser.parse_args(argv[:1])  # an unknown subcommand exits here with argparse's message (status 2)
    if argv[0] == "train":  # as python -m axon4d.train: host tensors in huge pages, before the first one
        from axon4d.device.environment import use_huge_pages

        use_huge_pages()
    module = importlib.import_module(COMMANDS[argv[0]][0])
    sub_parser = argparse.ArgumentParser(
        prog=f"axon4d {argv[0]}", description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    module.add_arguments(sub_parser)
    return int(module.main(sub_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
