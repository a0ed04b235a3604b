"""The `ampkit` command: parses flags into a call of the library, nothing else.

Each subcommand's flags and handler live in a module of its own (`ampkit.cli.compare`, `cli_run`, ...);
this one puts them under one parser and runs the one the command line names, once every flag is checked.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys

from ampkit.cli import args as flags
from ampkit.cli import compare as cli_compare
from ampkit.cli import doctor as cli_doctor
from ampkit.cli import export as cli_export
from ampkit.cli import info as cli_info
from ampkit.cli import plan as cli_plan
from ampkit.cli import run as cli_run
from ampkit.cli.args import Parser
from ampkit.util.processes import end_on_sigterm

# The subcommands, in the order `ampkit --help` lists them; each has add_parser(sub) and handle(args).
COMMANDS = (cli_compare, cli_run, cli_export, cli_info, cli_doctor, cli_plan)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: `ampkit` and each subcommand of COMMANDS with its flags."""
    parser = Parser(prog="ampkit", description="Mixed-precision training for PyTorch: measured and explained.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def version_line() -> str:
    """`ampkit --version`: ampkit's and torch's versions from the installed metadata, without importing torch
    (so it answers at once); "0+unknown" for a source tree never installed."""
    versions = []
    for package in ("ampkit", "torch"):
        try:
            versions.append(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            versions.append("0+unknown" if package == "ampkit" else "not installed")
    return f"ampkit {versions[0]} (torch {versions[1]}, Python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extras = build_parser().parse_known_args(argv)
    if extras:  # a typo'd flag: the subcommand's own error, with the flag it probably meant
        args.parser.unknown(extras)
    if problem := flags.check_numbers(args.command, args):
        return flags.usage(args.command, problem)
    args.argv = argv
    end_on_sigterm()  # `kill` (a timeout, a scheduler) ends the runs and torchruns this command started
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
