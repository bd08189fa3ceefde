"""Time building the structural FlexAttention BlockMask at long lengths.

    python benchmarks/flex_block_mask.py --tokens 65536 --groups 8 --slots 64

Prints the median build time (cache bypassed) and the size of the block lists.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from moda_flex import variants
from moda_flex.backends.flex.block_mask import Layout, mask_mod, structural_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import cli  # noqa: E402


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=65536, help="T")
    parser.add_argument("--groups", type=int, default=8, help="G = Hq / Hk")
    parser.add_argument("--slots", type=int, default=64, help="L depth entries per token")
    parser.add_argument("--repeats", type=int, default=5, help="timed builds (the median is reported)")
    parser.add_argument("--part", choices=("concat", "sequence", "depth"), default="concat", help="which call's mask")
    cli.add_device(parser)
    args = parser.parse_args(argv)
    cli.check_device(parser, args.device)

    variant = variants.causal()
    T, G, L = args.tokens, args.groups, args.slots
    layout = Layout.of(args.part, T, T, G, L)
    element_mask = mask_mod(variant, layout, args.device)

    def build():
        block_mask = structural_block_mask(variant.structure, layout, args.device, element_mask)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return block_mask

    build()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        block_mask = build()
        times.append(time.perf_counter() - start)
    lists = [block_mask.kv_indices, block_mask.full_kv_indices, block_mask.q_indices, block_mask.full_q_indices]
    entries = sum(t.numel() for t in lists)
    visited = int(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum())
    print(
        f"T={T} G={G} L={L} device={args.device}: build {statistics.median(times) * 1e3:.1f} ms (median of "
        f"{args.repeats}); blocks visited {visited}; index entries {entries} ({entries * 4 / 2**20:.0f} MiB); "
        f"dense mask would be {layout.rows * layout.columns:.2e} entries"
    )


if __name__ == "__main__":
    main()
