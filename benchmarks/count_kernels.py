"""How many kernels inductor generates for a compiled training step of the example GPT, per arm and depth.

MoDA's cost in a compiled step is partly kernel count: each depth entry's
gradient sums over every later layer that reads it. This compiles
``torch.compile(model, fullgraph=True)``, runs one forward and backward on
random tokens, and prints inductor's generated kernel count (forward and
backward together), and each MoDA arm's extra kernels over the baseline of
the same depth. A count, not a time: it runs on CPU (C++ kernels, the fused
Triton ops under the interpreter) as on CUDA (Triton kernels).

Usage::

    python benchmarks/count_kernels.py                         # CPU, 2/4/8 layers, a tiny model
    python benchmarks/count_kernels.py --device cuda --layers 12,24 --n-embd 384 --n-head 6 --n-kv-head 2
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


def kernel_count(config, device, batch: int) -> int:
    """Inductor's generated kernels for one compiled forward and backward of a GPT of ``config``."""
    import torch
    import torch._inductor.metrics as metrics
    from gpt import GPT

    torch.manual_seed(0)
    model = GPT(config).to(device)
    torch._dynamo.reset()
    metrics.reset()
    step = torch.compile(model, fullgraph=True)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device)
    _, loss = step(tokens, tokens)
    loss.backward()
    return metrics.generated_kernel_count


def main(argv=None) -> None:
    p = cli.parser(__doc__)
    cli.add_device(p)
    p.add_argument("--layers", type=cli.int_list, default="2,4,8", help="comma-separated model depths")
    p.add_argument("--arms", default="none,attn,attn+ffn", help="comma-separated depth_kv arms; none is the baseline")
    cli.add_model_shape(p, n_embd=32, n_head=4, n_kv_head=2, block_size=16)
    p.add_argument("--batch-size", type=cli.at_least(1), default=2, help="sequences per step")
    cli.add_backend(p)
    args = p.parse_args(argv)
    device = cli.check_device(p, args.device)
    arms = [a for a in args.arms.split(",") if a]
    if "none" not in arms:
        p.error(f"--arms {args.arms!r}: include none, the baseline the others are counted against")
    if device.type == "cpu":  # the fused kernels run through Triton's interpreter, chosen before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from gpt import GPTConfig

    from moda_flex.nn import DEPTH_KV

    if not set(arms) <= set(DEPTH_KV):
        p.error(f"--arms {args.arms!r}: a comma-separated subset of {','.join(DEPTH_KV)}")
    cli.check_backend(p, args.backend, device, n_head=args.n_head, n_kv_head=args.n_kv_head,
                      head_dim=args.n_embd // args.n_head, slots=2 * max(args.layers))  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {name}, torch {torch.__version__}, backend {args.backend}, width {args.n_embd}, "
          f"{args.n_head}/{args.n_kv_head} heads, B={args.batch_size}, T={args.block_size}")  # fmt: skip
    print("| layers | " + " | ".join(arms) + " | " + " | ".join(f"{a} extra" for a in arms if a != "none") + " |")
    print("|---" * (2 * len(arms)) + "|")
    for layers in args.layers:
        counts = {}
        for arm in arms:
            config = GPTConfig(n_layer=layers, n_embd=args.n_embd, n_head=args.n_head, n_kv_head=args.n_kv_head,
                               block_size=args.block_size, depth_kv=arm, backend=args.backend)  # fmt: skip
            counts[arm] = kernel_count(config, device, args.batch_size)
        extra = [str(counts[a] - counts["none"]) for a in arms if a != "none"]
        print(f"| {layers} | " + " | ".join(str(counts[a]) for a in arms) + " | " + " | ".join(extra) + " |", flush=True)


if __name__ == "__main__":
    main()
