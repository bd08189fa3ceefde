"""A variant of your own in a few lines, property-tested against the reference.

In a model whose layers alternate attention and FFN blocks, each writing one
depth slot per token, the even slots come from attention layers and the odd
ones from FFNs. This variant reads only the attention slots, causally.

A learned depth bias (one logit offset per slot, an ``nn.Parameter``) then
lets the model weigh the slots it reads: trained for a few steps here, and
property-tested, its gradient included, against the reference.

To keep only each token's last N depth slots, intersect with the built-in that
is given L (a predicate is not): ``attention_slots_only() & depth_window(N)``
reads the attention slots among the last N.

    python examples/custom_variant.py            # mask picture, property tests, a few training steps
    python examples/custom_variant.py --examples 200

Needs hypothesis, from the test extra (pip install -e ".[test]"): the property
tests and moda_flex.testing are written with it.
"""

import cli
import torch

from moda_flex import Variant, depth_bias, moda_attention
from moda_flex.visualize import MaskView


def attention_slots_only() -> Variant:
    """Causal MoDA over the depth slots written by attention layers (even slots) only."""

    def sequence(b, h, q_pos, k_pos):
        return k_pos <= q_pos

    def depth(b, h, q_pos, d_pos, slot):
        return (d_pos == q_pos) & (slot % 2 == 0)

    return Variant("attention_slots_only", sequence, depth)


def check_against_reference(examples: int) -> None:
    """Output, lse and all five gradients on the flex backend against the float64 reference."""
    from hypothesis import given, settings

    from moda_flex.testing import assert_matches_reference, make_inputs, moda_shapes

    @settings(max_examples=examples, deadline=None)
    @given(shape=moda_shapes(max_kv_len=32, max_slots=6, head_dims=(8, 16)))
    def matches(shape):
        inputs = make_inputs(shape, strided_depth=True)
        assert_matches_reference(inputs, backend="flex", variant=attention_slots_only())

    matches()


def check_learned_bias(examples: int) -> None:
    """The variant with a learned (L,) depth bias: output, lse, all gradients and the bias's gradient."""
    from hypothesis import given, settings

    from moda_flex.testing import assert_matches_reference, make_inputs, moda_shapes

    @settings(max_examples=examples, deadline=None)
    @given(shape=moda_shapes(max_kv_len=32, max_slots=6, head_dims=(8, 16)))
    def matches(shape):
        bias = torch.randn(shape.slots, generator=torch.Generator().manual_seed(shape.slots)).requires_grad_()
        variant = attention_slots_only() & depth_bias(bias)
        assert_matches_reference(make_inputs(shape), backend="flex", variant=variant)

    matches()


def train_bias(steps: int = 30) -> torch.Tensor:
    """Fit a depth bias so that attention lands on slot 2: the bias of slot 2 must grow."""
    from moda_flex.testing import MoDAShape, make_inputs

    shape = MoDAShape(batch=2, q_heads=4, kv_heads=2, q_len=8, kv_len=8, slots=6, head_dim=16)
    inputs = make_inputs(shape, requires_grad=False)
    target = inputs["depth_v"][:, :, :, 2].repeat_interleave(2, dim=1)  # (B, Hq, Tq, D): slot 2's values
    bias = torch.nn.Parameter(torch.zeros(shape.slots))
    optimizer = torch.optim.Adam([bias], lr=0.2)
    variant = attention_slots_only() & depth_bias(bias)
    for step in range(steps):
        out = moda_attention(**inputs, variant=variant, backend="flex")
        loss = (out - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:2d}  loss {loss.item():.4f}  bias {[round(b, 2) for b in bias.tolist()]}")
    return bias.detach()


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--examples", type=cli.at_least(1), default=20, help="hypothesis examples to check")
    args = parser.parse_args(argv)
    cli.require_extra(parser, "hypothesis", "test")
    print(MaskView(attention_slots_only(), q_len=5, kv_len=8, slots=6).text())
    check_against_reference(args.examples)
    check_learned_bias(args.examples)
    print(f"\nflex matches the reference on {args.examples} random shapes, with and without a learned depth bias\n")
    bias = train_bias()
    print(f"the learned bias favours slot {int(bias.argmax())}")


if __name__ == "__main__":
    main()
