"""A user's own variant, for the tests that need predicates without a Structure."""

from moda_flex import Variant


def user_variant() -> Variant:
    """Even query heads, keys at even distance, odd depth slots of batch row 0: touches every argument."""

    def sequence(b, h, q_pos, k_pos):
        return (h % 2 == 0) & ((q_pos - k_pos) % 2 == 0) & (k_pos <= q_pos)

    def depth(b, h, q_pos, d_pos, slot):
        return (d_pos == q_pos) & (slot % 2 == 1) & (b == 0)

    return Variant("user", sequence, depth)
