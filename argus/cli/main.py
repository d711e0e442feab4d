"""The ``argus`` command: a registry of subcommands, each imported only when it runs.

Every subcommand is a :class:`CLISubcommand`. ``main`` builds the parser from their names and
help lines without importing their modules, so ``argus plan`` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

from argus.plumbing.quoting import LIMIT, quoted, shorten


def passive_openmp() -> None:
    """Let torch's OpenMP threads sleep rather than spin while they wait for work (libgomp reads
    ``OMP_WAIT_POLICY`` when torch loads, so this runs before; a value the environment sets
    wins). A denoising step alternates Python (diffusers' modules, the cancel checkpoints) and
    short parallel regions; between them spinning threads hold the cores, and two worker
    processes sharing cores starve each other: ``argus up --workers 2`` on 2 cores was ready
    after 89 s with spinning threads and after 8.4 s with sleeping ones, its first requests
    taking 1.9-2.9 s against 0.5 s."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


def add_nice_argument(parser: argparse.ArgumentParser) -> None:
    """``--nice N``: a compute process (worker, ControlNet service) that shares its machine's
    cores with the control plane lowers its own priority, so the router's admission and
    refusals are not queued behind denoising (``argus up`` passes it)."""
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="add N (0..19) to this process's nice value before it starts any thread",
    )


def lower_priority(niceness: int) -> None:
    """Add ``niceness`` to this process's nice value. On Linux a nice value is per thread and
    new threads inherit their creator's, so this runs before torch, gRPC or any pool starts a
    thread; CLIError outside 0..19."""
    if not 0 <= niceness <= 19:
        raise CLIError(f"--nice: {niceness} outside 0..19")
    if niceness:
        os.nice(niceness)


def config_error(err: ValueError, args: argparse.Namespace) -> CLIError:
    """A config's ValueError as the user's error: a message that starts with a field the
    command has a flag for (``period_s: ...``) names the flag instead (``--period-s: ...``).
    The configs validate their values; the commands only translate."""
    message = str(err)
    field, sep, rest = message.partition(":")
    if sep and field in vars(args):
        return CLIError(f"--{field.replace('_', '-')}:{rest}")
    return CLIError(message)


class CLISubcommand(Protocol):
    name: str
    help: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# name -> (module, class, one-line help); modules load only when their command runs
COMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": ("argus.cli.plan", "PlanCommand", "solve one allocation and PASM; print JSON"),
    "replay": (
        "argus.cli.replay",
        "ReplayCommand",
        "replay a trace through policies (simulated, or --live on a cluster)",
    ),
    "evaluate": (
        "argus.cli.evaluate",
        "EvaluateCommand",
        "load sweep of every policy over paired seeds (the paper's Fig. 17), simulated",
    ),
    "profile": ("argus.cli.profile", "ProfileCommand", "score every prompt at every level"),
    "worker": ("argus.cli.worker", "WorkerCommand", "run a GPU worker (gRPC)"),
    "allocator": ("argus.cli.allocator", "AllocatorCommand", "run the allocator service (gRPC)"),
    "router": ("argus.cli.router", "RouterCommand", "run a router: the public endpoint (gRPC)"),
    "up": ("argus.cli.up", "UpCommand", "run a whole cluster as local processes, until Ctrl-C"),
    "client": ("argus.cli.client", "ClientCommand", "send prompts to a router, save the images"),
    "train-classifier": (
        "argus.cli.train_classifier",
        "TrainClassifierCommand",
        "train the level classifiers (one per strategy) from quality tables",
    ),
    "controlnet": (
        "argus.cli.controlnet",
        "ControlNetCommand",
        "run the shared ControlNet service (gRPC)",
    ),
    "profile-lora": (
        "argus.cli.profile_lora",
        "ProfileLoraCommand",
        "find the LoRA bound K: the first step where the LoRA changes the latents",
    ),
    "issue-cert": (
        "argus.cli.issue_cert",
        "IssueCertCommand",
        "create the cluster CA, or issue a component's internal-plane certificate",
    ),
    "health": (
        "argus.cli.health",
        "HealthCommand",
        "check an internal service's gRPC health with this pod's certificate",
    ),
    "generate": (
        "argus.cli.generate",
        "GenerateCommand",
        "send a prompt to a worker, save the PNG",
    ),
}


ERROR_CHARS = 3 * LIMIT
"""Length at which argparse's own error messages are cut: they quote the user's values inside
their words ("argument --steps: invalid int value: '...'"), so the whole line is shortened,
keeping argparse's words and the start of the value."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error on a single, bounded line (exit code 2) and takes no
    abbreviated options: ``--worker 3`` is an error, not ``--workers 3``, and adding an option
    can never change what an existing command line means."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {shorten(message, ERROR_CHARS)}\n")


def load_command(name: str) -> CLISubcommand:
    module_name, class_name, _ = COMMANDS[name]
    command: CLISubcommand = getattr(importlib.import_module(module_name), class_name)()
    return command


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(prog="argus", description="Argus: quality-aware text-to-image serving")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineParser
    )
    for name, (_, _, help_line) in COMMANDS.items():
        subparsers.add_parser(name, help=help_line, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        parser.error(f"unknown command {quoted(name)}; choose from {', '.join(COMMANDS)}")
    command = load_command(name)
    sub = OneLineParser(prog=f"argus {name}", description=command.help)
    command.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return command.run(args)
    except CLIError as exc:
        print(f"argus {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
