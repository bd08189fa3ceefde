"""The benchmark suite: a MoDA model's training step and MoDA's kernel calls, each against its baseline.

Models. A nanoGPT-style GPT, written below with the public API only: each
attention layer reads the depth stream, attends with ``moda_attention`` over
``[k, v | depth]`` and appends its own k, v (``arm`` attn); with ``attn+ffn``
each FFN also appends a K/V, one Linear of its input to 2 * Hk * D. The
baseline is the same model with no depth (``F.scaled_dot_product_attention``).

| shape | layers, width, heads (q/kv), D, norm, vocab | B x T | arms |
|---|---|---|---|
| table6 | 24, 384, 6/2, 64, post, 256 | 32 x 512 | attn, attn+ffn |
| gpt2s-mha | 12, 768, 12/12, 64, pre, 50304 (nanoGPT's GPT-2 small) | 12 x 1024 | attn, attn+ffn |
| llama | 16, 2048, 16/4, 128, pre, 32000 | 2 x 4096 | attn |
| long | 8, 1024, 16/2, 64, pre, 256 | 1 x 16384 | attn |

A step is forward, backward and fused AdamW in bf16 autocast on random
tokens, compiled with ``torch.compile(fullgraph=True)`` in the default mode or
``mode="reduce-overhead"`` (CUDA graphs). For each (shape, mode) the baseline
and the arms are compiled in turn (the first step's wall time is the
``compile`` column; inductor's FX-graph and AOT-autograd caches are off, so
each row compiles its own graphs), warmed up (the peak memory of these steps,
over what the process held before the row was built, is ``peak``), then timed
in rounds that take turns: each round is ``--steps`` steps back to back and
one synchronize. ``step`` is the median of the rounds (min-max in brackets),
``/ base`` the median of each round's ratio to the baseline's same round.

``floor``: the baseline's step plus the time the depth entries' bytes take at
the copy bandwidth measured in this run (a 1 GiB device-to-device copy):
each entry a layer reads is read in the forward, read again and its gradient
written in the backward, 6 * (B * Hk * T * D) bf16 values a read.

Kernel calls. One ``moda_attention(backend="auto")`` call, forward and
backward (B=1, Hq=64, Hk=8, L=64, D=64, bf16, causal, depth one
(B, Hk, T, L, D) tensor), beside SDPA on cuDNN with the sequence only
(``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``, causal, ``enable_gqa``): ms per
call, calls back to back, median of rounds.

Usage::

    python benchmarks/suite.py                                   # everything (about an hour of compiles)
    python benchmarks/suite.py --shapes gpt2s-mha --arms attn --kernel-lengths none
    python benchmarks/suite.py --shapes none --kernel-lengths 1024,4096,16384,65536
    python benchmarks/suite.py --cpu-smoke                        # tiny models on CPU, eager: seconds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch._functorch.config
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import moda_flex
from moda_flex import DepthStream, moda_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model and its batch: layers, width, query / KV heads, head size, norm placement, vocabulary, B, T."""

    name: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    norm: str  # "pre" or "post"
    vocab: int
    batch: int
    seq: int
    arms: tuple[str, ...]


SHAPES = {
    s.name: s
    for s in (
        Shape("table6", 24, 384, 6, 2, 64, "post", 256, 32, 512, ("attn", "attn+ffn")),
        Shape("gpt2s-mha", 12, 768, 12, 12, 64, "pre", 50304, 12, 1024, ("attn", "attn+ffn")),
        Shape("llama", 16, 2048, 16, 4, 128, "pre", 32000, 2, 4096, ("attn",)),
        Shape("long", 8, 1024, 16, 2, 64, "pre", 256, 1, 16384, ("attn",)),
    )
}
ARMS = ("attn", "attn+ffn")
MODES = ("default", "reduce-overhead", "eager")
BASE = "base"  # the arm with no depth


def shrunk(shape: Shape) -> Shape:
    """``shape`` at a size a CPU runs in milliseconds: 2 layers, D=8, B=2, T=16, 64 tokens; heads and norm kept."""
    return dataclasses.replace(shape, layers=2, width=8 * shape.heads, head_dim=8, vocab=64, batch=2, seq=16)


# ----------------------------------------------------------------------------------------------------------------
# The model


class Attention(nn.Module):
    """Causal self-attention; with a depth stream, MoDA over ``[k, v | the stream's entries]``."""

    def __init__(self, s: Shape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.qkv = nn.Linear(s.width, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        self.proj = nn.Linear(s.heads * s.head_dim, s.width, bias=False)

    def forward(self, x: Tensor, depth: Optional[DepthStream]) -> tuple[Tensor, Optional[DepthStream]]:
        B, T, _ = x.shape
        Hq, Hk, D = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([Hq * D, Hk * D, Hk * D], dim=-1)
        q = q.view(B, T, Hq, D).transpose(1, 2)  # (B, Hq, T, D)
        k = k.view(B, T, Hk, D).transpose(1, 2)  # (B, Hk, T, D)
        v = v.view(B, T, Hk, D).transpose(1, 2)  # (B, Hk, T, D)
        if depth is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hk)
        else:
            depth_k, depth_v = depth.read()  # lists of (B, Hk, T, D), or None before the first entry
            y = moda_attention(q, k, v, depth_k, depth_v)
            depth = depth.append(k, v)
        y = y.transpose(1, 2).reshape(B, T, Hq * D)  # (B, T, Hq * D)
        return self.proj(y), depth


class Block(nn.Module):
    """Attention and a GELU MLP, pre- or post-norm; with ``ffn_depth`` the MLP's input also gives a depth K/V."""

    def __init__(self, s: Shape, ffn_depth: bool):
        super().__init__()
        self.post = s.norm == "post"
        self.kv_heads, self.head_dim = s.kv_heads, s.head_dim
        self.norm1 = nn.LayerNorm(s.width, bias=False)
        self.attn = Attention(s)
        self.norm2 = nn.LayerNorm(s.width, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(s.width, 4 * s.width, bias=False), nn.GELU(), nn.Linear(4 * s.width, s.width, bias=False)
        )
        self.depth_kv = nn.Linear(s.width, 2 * s.kv_heads * s.head_dim, bias=False) if ffn_depth else None

    def ffn_entry(self, h: Tensor, depth: Optional[DepthStream]) -> Optional[DepthStream]:
        """``depth`` with the FFN's entry appended, a K/V projected from its input ``h`` (B, T, width)."""
        if self.depth_kv is None or depth is None:
            return depth
        B, T, _ = h.shape
        kv = self.depth_kv(h).view(B, T, 2, self.kv_heads, self.head_dim)  # (B, T, 2, Hk, D)
        return depth.append(kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2))  # each (B, Hk, T, D)

    def forward(self, x: Tensor, depth: Optional[DepthStream]) -> tuple[Tensor, Optional[DepthStream]]:
        if self.post:
            a, depth = self.attn(x, depth)
            x = self.norm1(x + a)
            depth = self.ffn_entry(x, depth)
            return self.norm2(x + self.mlp(x)), depth
        a, depth = self.attn(self.norm1(x), depth)
        x = x + a
        h = self.norm2(x)
        depth = self.ffn_entry(h, depth)
        return x + self.mlp(h), depth


class GPT(nn.Module):
    """Token and position embeddings, the blocks, a final norm and the tied head; returns the mean cross-entropy."""

    def __init__(self, s: Shape, arm: str):
        super().__init__()
        self.arm = arm
        self.wte = nn.Embedding(s.vocab, s.width)
        self.wpe = nn.Embedding(s.seq, s.width)
        self.blocks = nn.ModuleList(Block(s, arm == "attn+ffn") for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.width, bias=False)
        self.head = nn.Linear(s.width, s.vocab, bias=False)
        self.head.weight = self.wte.weight
        self.capacity = (2 if arm == "attn+ffn" else 1) * s.layers  # the entries a pass appends

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, width)
        depth = None if self.arm == BASE else DepthStream(capacity=self.capacity)
        for block in self.blocks:
            x, depth = block(x, depth)
        logits = self.head(self.norm(x))  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def depth_reads(shape: Shape, arm: str) -> int:
    """Depth entries the attention layers read per token in a forward: layer l reads l (attn) or 2 l (attn+ffn)."""
    per_layer = {BASE: 0, "attn": 1, "attn+ffn": 2}[arm]
    return per_layer * shape.layers * (shape.layers - 1) // 2


def floor_bytes(shape: Shape, arm: str) -> int:
    """HBM bytes the depth entries cost a step: each read is K and V read forward, read and written backward."""
    return 6 * depth_reads(shape, arm) * shape.batch * shape.kv_heads * shape.seq * shape.head_dim * 2


# ----------------------------------------------------------------------------------------------------------------
# Timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second, read and written, of a device-to-device copy of 1 GiB (16 MiB on CPU): median of 10."""
    src = torch.empty(2**28 if device.type == "cuda" else 2**22, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def compiled(model: nn.Module, mode: str) -> Callable:
    """``model`` as ``mode`` runs it: itself (eager), or ``torch.compile(fullgraph=True)`` in that mode with
    inductor's FX-graph cache off (the AOT-autograd cache is off too: :func:`main`)."""
    if mode == "eager":
        return model
    options = dict(torch._inductor.list_mode_options(mode), fx_graph_cache=False)
    return torch.compile(model, fullgraph=True, options=options)


def warm_compiler(device: torch.device) -> None:
    """Compile a small network's forward and backward once, so that the compiler's one-time costs (its imports,
    its pool of compile workers) fall on no row."""
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    compiled(net, "default")(torch.randn(8, 64, device=device)).sum().backward()
    torch._dynamo.reset()


@dataclasses.dataclass
class Row:
    """One model of a (shape, mode) group: its step, and what was measured of it."""

    shape: Shape
    arm: str
    mode: str
    step: Optional[Callable[[], None]] = None
    compile_s: float = math.nan
    peak_bytes: float = math.nan
    rounds_ms: list = dataclasses.field(default_factory=list)
    error: str = ""


def prepare(row: Row, device: torch.device, warmup: int) -> None:
    """Build ``row``'s model and optimizer, take the first step (its wall time: ``compile_s``) and ``warmup``
    more (their peak memory over what was held before: ``peak_bytes``); ``row.step`` then takes one step."""
    s = row.shape
    held = memory_allocated(device)
    torch.manual_seed(0)
    model = GPT(s, row.arm).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = compiled(model, row.mode)
    idx = torch.randint(0, s.vocab, (s.batch, s.seq), device=device)
    graphs = row.mode == "reduce-overhead"

    def step() -> None:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's graph outputs may be overwritten
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = run(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    synchronize(device)
    t0 = time.perf_counter()
    step()
    synchronize(device)
    row.compile_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    synchronize(device)
    if device.type == "cuda":
        row.peak_bytes = torch.cuda.max_memory_allocated(device) - held
    row.step = step


def time_round(fn: Callable[[], None], calls: int, device: torch.device) -> float:
    """ms per call of ``calls`` calls back to back, one synchronize after the last."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / calls * 1e3


def spread(values: list[float]) -> tuple[float, float, float]:
    """Median, min and max."""
    return statistics.median(values), min(values), max(values)


def round_ratios(rounds: list[float], base: list[float]) -> list[float]:
    """Each round over the baseline's same round."""
    return [r / b for r, b in zip(rounds, base)]


def _ms(values: list[float], digits: int = 1) -> str:
    """``median (min-max)``, or "-" where nothing was measured."""
    if not values:
        return "-"
    mid, lo, hi = spread(values)
    return f"{mid:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def _num(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


# ----------------------------------------------------------------------------------------------------------------
# The model table


MODEL_HEADER = (
    "| shape | mode | arm | step ms | / base | peak GiB | / base | compile s | / base | floor ms | / floor |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def model_lines(rows: list[Row], bandwidth: float) -> list[str]:
    """The table's lines for one (shape, mode) group; its first row is the baseline."""
    base = rows[0]
    lines = []
    for row in rows:
        s = row.shape
        head = f"| {s.name} | {row.mode} | {row.arm} |"
        if row.error:
            lines.append(f"{head} failed: {row.error} | | | | | | | |")
            continue
        ratios = round_ratios(row.rounds_ms, base.rounds_ms) if base.rounds_ms and row is not base else []
        floor = statistics.median(base.rounds_ms) + floor_bytes(s, row.arm) / bandwidth * 1e3 if base.rounds_ms else math.nan
        lines.append(
            f"{head} {_ms(row.rounds_ms)} | {_ms(ratios, 2) if row is not base else '1'} | "
            f"{_num(row.peak_bytes / 2**30, '.2f')} | {_num(row.peak_bytes / base.peak_bytes, '.2f')} | "
            f"{_num(row.compile_s, '.0f')} | {_num(row.compile_s / base.compile_s, '.2f')} | "
            f"{_num(floor, '.1f')} | {_num(statistics.median(row.rounds_ms) / floor, '.2f')} |"
        )
    return lines


def run_group(shape: Shape, mode: str, arms: list[str], device: torch.device, args, bandwidth: float) -> list[str]:
    """Compile, warm up and time the baseline and ``arms`` of ``shape`` in ``mode``; their table lines."""
    rows = [Row(shape, arm, mode) for arm in [BASE, *arms]]
    for row in rows:
        try:
            prepare(row, device, args.warmup)
        except Exception as error:  # one row that does not compile or run must not end the suite
            row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
            row.step = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"  {shape.name} {mode} {row.arm}: "
              + (row.error or f"first step {row.compile_s:.1f} s, peak {_num(row.peak_bytes / 2**30, '.2f')} GiB"),
              flush=True)  # fmt: skip
    timed = [row for row in rows if row.step is not None]
    for _ in range(args.rounds):
        for row in timed:
            row.rounds_ms.append(time_round(row.step, args.steps, device))
    lines = model_lines(rows, bandwidth)
    for row in rows:
        row.step = None
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return lines


# ----------------------------------------------------------------------------------------------------------------
# The kernel calls


@dataclasses.dataclass(frozen=True)
class CallShape:
    batch: int = 1
    heads: int = 64
    kv_heads: int = 8
    slots: int = 64
    head_dim: int = 64


def call_pair(T: int, c: CallShape, device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """Forward + backward of MoDA (``auto``) and of SDPA sequence-only (cuDNN on CUDA), on one set of inputs."""
    B, Hq, Hk, L, D = c.batch, c.heads, c.kv_heads, c.slots, c.head_dim
    dtype = torch.bfloat16

    def leaf(*shape: int) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    q, k, v = leaf(B, Hq, T, D), leaf(B, Hk, T, D), leaf(B, Hk, T, D)
    depth_k, depth_v = leaf(B, Hk, T, L, D), leaf(B, Hk, T, L, D)
    grad = torch.randn(B, Hq, T, D, device=device, dtype=dtype)

    def moda() -> None:
        out = moda_attention(q, k, v, depth_k, depth_v, backend="auto")
        torch.autograd.grad(out, (q, k, v, depth_k, depth_v), grad)

    def sdpa() -> None:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if device.type == "cuda" else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad)

    return moda, sdpa


def calls_per_round(fn: Callable[[], None], device: torch.device, target_s: float) -> int:
    """How many back-to-back calls take about ``target_s`` (at least 1, at most 200), after two warm-up calls."""
    fn()
    fn()
    one = time_round(fn, 1, device) / 1e3
    return max(1, min(200, round(target_s / max(one, 1e-6))))


def kernel_lines(lengths: list[int], c: CallShape, device: torch.device, rounds: int) -> list[str]:
    lines = ["| T | auto ms | SDPA ms | auto / SDPA |", "|---|---|---|---|"]
    for T in lengths:
        times = {}
        try:
            fns = dict(zip(("auto", "sdpa"), call_pair(T, c, device)))
            calls = {name: calls_per_round(fn, device, 0.05) for name, fn in fns.items()}
            times = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    times[name].append(time_round(fn, calls[name], device))
            line = (f"| {T} | {_ms(times['auto'], 3)} | {_ms(times['sdpa'], 3)} | "
                    f"{_ms(round_ratios(times['auto'], times['sdpa']), 2)} |")  # fmt: skip
        except Exception as error:  # a length that does not fit or run is a line of the table
            line = f"| {T} | failed: {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''} | | |"
        print("  " + line, flush=True)
        lines.append(line)
        fns = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines


# ----------------------------------------------------------------------------------------------------------------
# The command line


def choice_list(choices) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names from ``choices``, or ``none`` for an empty list."""

    def parse(text: str) -> list[str]:
        if text == "none":
            return []
        items = [item for item in text.split(",") if item]
        for item in items:
            if item not in choices:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(choices)}")
        return items

    return parse


def length_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated sequence lengths >= 1, or ``none``."""
    if text == "none":
        return []
    lengths = cli.int_list(text)
    if any(T < 1 for T in lengths):
        raise argparse.ArgumentTypeError(f"lengths must be >= 1, got {text}")
    return lengths


def parser() -> argparse.ArgumentParser:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--shapes", type=choice_list(SHAPES), default=",".join(SHAPES),
                   help=f"comma-separated, from {', '.join(SHAPES)}, or none")  # fmt: skip
    p.add_argument("--arms", type=choice_list(ARMS), default=",".join(ARMS),
                   help="comma-separated MoDA arms, each timed where its shape has it (the baseline always is)")
    p.add_argument("--modes", type=choice_list(MODES), default=None,
                   help="comma-separated, from default, reduce-overhead (torch.compile's modes) and eager "
                        "(default: default,reduce-overhead; with --cpu-smoke, eager)")  # fmt: skip
    p.add_argument("--kernel-lengths", type=length_list, default=None,
                   help="sequence lengths of the kernel calls, comma-separated, or none (default: "
                        "1024,4096,16384,65536; with --cpu-smoke, 32)")  # fmt: skip
    p.add_argument("--rounds", type=cli.at_least(1), default=5, help="timed rounds, the rows taking turns")
    p.add_argument("--steps", type=cli.at_least(1), default=10, help="training steps a round, back to back")
    p.add_argument("--warmup", type=cli.at_least(1), default=3, help="steps after the first, before the rounds")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run every part on CPU at a tiny size (2 layers, D=8, T=16; kernel calls with Hq=4, "
                        "Hk=2, L=4, D=8 at T=32 unless --kernel-lengths says): a check that the suite runs")  # fmt: skip
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        shapes = [shrunk(SHAPES[name]) for name in args.shapes]
        modes = args.modes if args.modes is not None else ["eager"]
        lengths = args.kernel_lengths if args.kernel_lengths is not None else [32]
        call = CallShape(heads=4, kv_heads=2, slots=4, head_dim=8)
    else:
        if not torch.cuda.is_available():
            p.error(f"suite.py needs a CUDA GPU, and none is available (torch {torch.__version__}); "
                    "--cpu-smoke runs it on CPU at a tiny size")  # fmt: skip
        device = torch.device("cuda")
        shapes = [SHAPES[name] for name in args.shapes]
        modes = args.modes if args.modes is not None else ["default", "reduce-overhead"]
        lengths = args.kernel_lengths if args.kernel_lengths is not None else [1024, 4096, 16384, 65536]
        call = CallShape()
    # each row compiles its own graphs, as a user's first run does
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)

    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"moda_flex {moda_flex.__file__}, copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)  # fmt: skip
    print(f"rounds {args.rounds}, steps a round {args.steps}, warm-up {args.warmup} steps after the first", flush=True)

    tables = []
    if lengths:
        print(f"\nkernel calls, fwd+bwd, bf16, causal: B={call.batch} Hq={call.heads} Hk={call.kv_heads} "
              f"L={call.slots} D={call.head_dim}", flush=True)  # fmt: skip
        tables.append("\n".join(kernel_lines(lengths, call, device, args.rounds)))
    model_rows = []
    if shapes and any(mode != "eager" for mode in modes):
        warm_compiler(device)
    for shape in shapes:
        arms = [arm for arm in args.arms if arm in shape.arms]
        for mode in modes:
            print(f"\n{shape.name} ({shape.layers} layers, width {shape.width}, heads {shape.heads}/{shape.kv_heads}, "
                  f"D {shape.head_dim}, {shape.norm}-norm, vocab {shape.vocab}, B={shape.batch} T={shape.seq}), "
                  f"{mode}", flush=True)  # fmt: skip
            lines = run_group(shape, mode, arms, device, args, bandwidth)
            print("\n".join([MODEL_HEADER, *lines]), flush=True)
            model_rows += lines
    if model_rows:
        tables.append("\n".join([MODEL_HEADER, *model_rows]))
    print("\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()
