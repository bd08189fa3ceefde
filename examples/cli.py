"""What the command lines of the examples and benchmarks share: help that shows defaults, clean device errors.

    parser = cli.parser(__doc__)
    parser.add_argument("--steps", type=cli.at_least(1), default=400, help="training steps")
    cli.add_device(parser)
    cli.add_backend(parser)
    args = parser.parse_args(argv)
    device = cli.check_device(parser, args.device)
    cli.check_backend(parser, args.backend, device, n_head=4, n_kv_head=2, head_dim=32, slots=8)

``--help`` then prints the module docstring as written and each option as
``--steps STEPS   training steps (default: 400)``. Whatever can be checked
before the work starts (a number out of range, a device or backend this
machine cannot run) ends in a one-line usage error and exit status 2, not a
traceback from deep inside the run.
"""

from __future__ import annotations

import argparse
import importlib
import math
from typing import Callable

import torch

from moda_flex import causal
from moda_flex.backends import NAMES as BACKENDS
from moda_flex.backends import choose

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


def require_extra(parser: argparse.ArgumentParser, module: str, extra: str) -> None:
    """A one-line usage error (exit 2) naming the extra to install when ``module`` cannot be imported."""
    try:
        importlib.import_module(module)
    except ImportError:
        parser.error(f"needs {module}, from the {extra} extra: pip install -e \".[{extra}]\" (or pip install {module})")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``, else a usage error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (a learning rate, a temperature)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers (``"1,2,3"``)."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def choice_list(choices) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma-separated, non-empty list of ``choices`` (``"none,attn"``), in its order."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        items = [item for item in text.split(",") if item]
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            what = f"{unknown[0]!r} is not one of" if unknown else "give at least one of"
            raise argparse.ArgumentTypeError(f"{what} {', '.join(allowed)}")
        return items

    return parse


def add_model_shape(parser: argparse.ArgumentParser, *, n_embd: int, n_head: int, n_kv_head: int, block_size: int,
                    n_layer: int | None = None) -> None:
    """The model's shape options with a script's defaults; ``--n-layer`` only where the script takes it."""
    if n_layer is not None:
        parser.add_argument("--n-layer", type=at_least(1), default=n_layer, help="blocks")
    parser.add_argument("--n-embd", type=at_least(1), default=n_embd, help="model width")
    parser.add_argument("--n-head", type=at_least(1), default=n_head, help="query heads")
    parser.add_argument("--n-kv-head", type=at_least(1), default=n_kv_head, help="key/value heads (GQA)")
    parser.add_argument("--block-size", type=at_least(1), default=block_size, help="context length in bytes")


def add_backend(parser: argparse.ArgumentParser) -> None:
    """The ``--backend`` option: one of moda_flex's backend names, ``auto`` by default."""
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="moda_attention backend; auto picks the fastest exact one")  # fmt: skip


def check_backend(
    parser: argparse.ArgumentParser,
    name: str,
    device: torch.device,
    *,
    n_head: int,
    n_kv_head: int,
    head_dim: int,
    slots: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """A usage error (exit 2) when backend ``name`` cannot run a causal model's attention on ``device``.

    Asks the library's own choice (``moda_flex.backends.choose``) about one
    token of that shape with ``slots`` depth entries, so the message is the
    one the first call would have raised (a fused backend without CUDA or
    without the triton package), without a traceback.
    """
    q = torch.empty(1, n_head, 1, head_dim, dtype=dtype, device=device)  # (B, Hq, T, D)
    k = torch.empty(1, n_kv_head, 1, head_dim, dtype=dtype, device=device)  # (B, Hk, T, D)
    try:
        choose(name, q, k, slots, causal(), return_lse=False)
    except NotImplementedError as error:
        parser.error(f"--backend {name}: {error} (--backend auto picks one that can)")
