"""The paper's Table 6 comparison at its shape, on one GPU, offline.

    python examples/compare_models.py --budget-s 480 --out-dir results

Trains six byte-level GPTs of 24 layers, width 384, 6 query / 2 KV heads:
baseline, +depth KV (attention), +depth KV +FFN KV, each with post-norm and
pre-norm, from the same seed on the same batches, in bf16 autocast; then
prints validation loss, parameters, step time and peak memory (train_gpt's
table) and writes it to ``<out-dir>/results.md``.

Data: the largest text this Python installation holds without a network:
the pydoc topics, the standard library's sources and the descriptions of
the installed distributions, shuffled by document (fixed seed) so that the
validation tail looks like the rest. The number of steps is chosen so that
all six runs fit ``--budget-s``, from a short timing of the slowest model.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import cli  # noqa: E402
import train_gpt  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

SHAPE = ["--n-layer", "24", "--n-embd", "384", "--n-head", "6", "--n-kv-head", "2"]


def build_corpus(max_bytes: int) -> bytes:
    """pydoc topics + stdlib sources + distribution descriptions, shuffled by document, at most ``max_bytes``."""
    docs = [train_gpt.load_text(None)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" not in path.parts:
            docs.append(path.read_bytes())
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        description = dist.metadata.get_payload() or ""
        if len(description) > 1000:
            docs.append(description.encode("utf-8", errors="replace"))
    random.Random(0).shuffle(docs)
    return b"\n\n".join(docs)[:max_bytes]


def step_time(backend: str, batch_size: int, block_size: int, compile: bool, steps: int = 6) -> float:
    """Seconds per training step of the slowest configuration (MoDA, attention + FFN depth KV).

    Also decodes two tokens, so that a backend that cannot run any part of
    the comparison fails here, before the budget is spent.
    """
    torch.manual_seed(0)
    config = GPTConfig(n_embd=384, n_head=6, n_kv_head=2, n_layer=24, depth_kv="attn+ffn", backend=backend,
                       block_size=block_size)  # fmt: skip
    model = GPT(config).cuda()
    run = torch.compile(model, fullgraph=True) if compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, 256, (batch_size, block_size), device="cuda")
    for i in range(steps + 2):
        if i == 2:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = run(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model.generate(x[:1, :8], 2)  # the cached decoding path runs on this backend too
    return seconds


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds of training for all six runs")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--block-size", type=int, default=512, help="context length in bytes")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--max-bytes", type=int, default=200_000_000, help="the most corpus bytes to use")
    p.add_argument("--out-dir", default="results", help="results.md and corpus statistics go here")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="train compiled models (--no-compile to opt out)")
    args = p.parse_args(argv)
    cli.require_cuda(p, "compare_models.py (train_gpt.py runs on CPU)")

    corpus = build_corpus(args.max_bytes)
    work = Path(tempfile.mkdtemp(prefix="moda_compare_"))
    (work / "corpus.txt").write_bytes(corpus)
    print(f"corpus: {len(corpus) / 1e6:.1f} MB; device: {torch.cuda.get_device_name()}")

    backend = None
    for candidate in ("auto", "flex", "reference"):
        try:
            seconds = step_time(candidate, args.batch_size, args.block_size, args.compile)
        except Exception as error:  # report and fall back to the next backend
            print(f"backend {candidate!r} failed: {type(error).__name__}: {error}")
            continue
        backend = candidate
        break
    if backend is None:
        raise SystemExit("no backend could train the MoDA model")
    steps = max(20, int(args.budget_s / 6 / seconds))
    print(f"backend {backend!r}: {1000 * seconds:.1f} ms per MoDA step -> {steps} steps per run")

    train_gpt.main(
        ["--data", str(work / "corpus.txt"), "--depth-kv", "none,attn,attn+ffn", "--norm", "post,pre", *SHAPE,
         "--block-size", str(args.block_size), "--batch-size", str(args.batch_size), "--steps", str(steps),
         "--lr", str(args.lr), "--warmup", str(max(1, steps // 10)), "--skip-timing", "10", "--eval-iters", "40",
         "--sample-tokens", "100", "--backend", backend, "--device", "cuda", "--out-dir", str(work / "out"),
         "--compile" if args.compile else "--no-compile"]
    )  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = (work / "out" / "results.md").read_text()
    header = (
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, backend {backend!r}, "
        f"corpus {len(corpus) / 1e6:.1f} MB, {steps} steps x {args.batch_size} x {args.block_size} tokens, bf16\n\n"
    )
    (out / "results.md").write_text(header + table)


if __name__ == "__main__":
    main()
