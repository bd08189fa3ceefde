"""A variant of your own in a few lines, property-tested against the reference.

In a model whose layers alternate attention and FFN blocks, each writing one
depth slot per token, the even slots come from attention layers and the odd
ones from FFNs. This variant reads only the attention slots, causally:

    python examples/custom_variant.py            # mask picture, then the property test
    python examples/custom_variant.py --examples 200
"""

import sys
from pathlib import Path

from hypothesis import given, settings

# Run from a checkout, installed or not: the helpers beside this file, the package above it.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import cli  # noqa: E402

from moda_flex import Variant  # noqa: E402
from moda_flex.testing import assert_matches_reference, make_inputs, moda_shapes  # noqa: E402
from moda_flex.visualize import mask_text  # noqa: E402


def attention_slots_only() -> Variant:
    """Causal MoDA over the depth slots written by attention layers (even slots) only."""

    def sequence(b, h, q_pos, k_pos):
        return k_pos <= q_pos

    def depth(b, h, q_pos, d_pos, slot):
        return (d_pos == q_pos) & (slot % 2 == 0)

    return Variant("attention_slots_only", sequence, depth)


def check_against_reference(examples: int) -> None:
    """Output, lse and all five gradients on the flex backend against the float64 reference."""

    @settings(max_examples=examples, deadline=None)
    @given(shape=moda_shapes(max_kv_len=32, max_slots=6, head_dims=(8, 16)))
    def matches(shape):
        inputs = make_inputs(shape, strided_depth=True)
        assert_matches_reference(inputs, backend="flex", variant=attention_slots_only())

    matches()


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--examples", type=int, default=20, help="hypothesis examples to check")
    args = parser.parse_args(argv)
    print(mask_text(attention_slots_only(), q_len=5, kv_len=8, slots=6))
    check_against_reference(args.examples)
    print(f"\nflex matches the reference on {args.examples} random shapes")


if __name__ == "__main__":
    main()
