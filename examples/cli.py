"""What the command lines of the examples and benchmarks share: help that shows defaults, clean device errors.

    parser = cli.parser(__doc__)
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    cli.add_device(parser)
    args = parser.parse_args(argv)
    device = cli.check_device(parser, args.device)

``--help`` then prints the module docstring as written and each option as
``--steps STEPS   training steps (default: 400)``.
"""

from __future__ import annotations

import argparse

import torch

DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda where there is one, else cpu)"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and ``(default: ...)`` after each option's help.

    A help that already speaks of its default (``"default: bfloat16 on
    CUDA"``, the way to say what a None default means) is left as it is.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with :class:`HelpFormatter`; ``description`` is usually the module docstring."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def default_device() -> str:
    """``"cuda"`` where a CUDA device is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(parser: argparse.ArgumentParser, note: str = "") -> None:
    """The ``--device`` option, defaulting to :func:`default_device`; ``note`` is added to its help."""
    parser.add_argument("--device", default=default_device(), help=DEVICE_HELP + note)


def check_device(parser: argparse.ArgumentParser, name: str, flag: str = "--device") -> torch.device:
    """The ``torch.device`` that ``name`` names, or a usage error (exit 2) saying why it cannot be used.

    Catches what would otherwise end in a traceback deep inside the first
    ``.to(device)``: a malformed name, CUDA asked for on a machine without it,
    a device index past the last GPU.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        parser.error(f"{flag} {name!r} is not a device name: use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            parser.error(f"{flag} {name}: no CUDA device is available (torch {torch.__version__}, {built}); "
                         f"use {flag} cpu")  # fmt: skip
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        parser.error(f"{flag} {name}: only cpu and cuda are supported here")
    return device


def require_cuda(parser: argparse.ArgumentParser, what: str) -> None:
    """A usage error (exit 2) unless a CUDA device is present: for scripts that only run on a GPU."""
    if not torch.cuda.is_available():
        parser.error(f"{what} needs a CUDA GPU, and none is available (torch {torch.__version__})")
