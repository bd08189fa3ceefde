"""The Triton backend against the float64 reference.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``,
set by conftest.py), so shapes are small and example counts low.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from moda_flex import moda_attention  # noqa: E402
from moda_flex import variants as v  # noqa: E402
from moda_flex.backends.reference import reference_attention  # noqa: E402
from moda_flex.testing import (  # noqa: E402
    MoDAShape,
    assert_matches_reference,
    make_inputs,
    moda_shapes,
    relative_error,
    tolerance,
    variants,
)
from moda_flex.backends.triton import configs, triton_attention, unsupported_reason  # noqa: E402
from moda_flex.backends.triton.launch import Options  # noqa: E402

from budget import examples  # noqa: E402
from fused import FUSED_KINDS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(shape, dtype=torch.float32, strided_depth=False, seed=0, depth_entries=False):
    return make_inputs(
        shape, dtype=dtype, device=DEVICE, strided_depth=strided_depth, seed=seed, depth_entries=depth_entries
    )


# 20 keeps the suite within its 10 minutes on 2 cores (HYPOTHESIS_PROFILE=dev draws ten times as many)
@settings(max_examples=examples(20))
@given(
    shape=moda_shapes(max_kv_len=40, max_slots=9, max_kv_heads=2, head_dims=(16, 32)),
    strided=st.booleans(),
    entries=st.booleans(),
    data=st.data(),
)
def test_matches_reference(shape, strided, entries, data):
    """Output, lse and the five gradients, every fused variant, odd lengths, Tq <= Tk, strided depth.

    With ``entries``, depth is a list of per-layer tensors read in place through the slot table.
    """
    variant = data.draw(variants(shape, kinds=FUSED_KINDS, structured=True))
    inputs = _inputs(shape, strided_depth=strided, depth_entries=entries)
    assert_matches_reference(inputs, backend="triton", variant=variant)


@settings(max_examples=examples(6))
@given(
    shape=moda_shapes(max_kv_len=24, max_slots=5, max_kv_heads=1, head_dims=(16,)),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    causal=st.booleans(),
)
def test_half_precision(shape, dtype, causal):
    assert_matches_reference(_inputs(shape, dtype=dtype), backend="triton", variant="causal" if causal else "full")


@pytest.mark.parametrize(
    "shape, variant",
    [
        (MoDAShape(1, 8, 1, 19, 37, 9, 64), v.causal()),  # G = 8: a full 16-row depth tile at 50%
        (MoDAShape(1, 16, 1, 7, 7, 4, 16), v.full()),  # G = 16: no padding rows
        (MoDAShape(2, 6, 2, 13, 13, 17, 128), v.depth_window(5)),  # G = 3, L over one depth block
        (MoDAShape(1, 4, 2, 1, 29, 3, 32), v.sliding_window(4)),  # one-token decode
    ],
    ids=lambda x: str(x) if isinstance(x, MoDAShape) else x.name,
)
def test_named_cases(shape, variant):
    assert_matches_reference(_inputs(shape, strided_depth=True, seed=3), backend="triton", variant=variant)


def test_rows_with_no_key_give_zeros():
    """Depth-only attention with L = 0: every row is empty, out = 0, lse = -inf, zero gradients."""
    shape = MoDAShape(1, 4, 2, 5, 9, 0, 16)
    assert_matches_reference(_inputs(shape), backend="triton", variant=v.depth_only())


def test_lse_gradient():
    """lse is differentiable: a loss on lse alone back-propagates like the reference."""
    shape = MoDAShape(1, 4, 2, 11, 17, 5, 16)
    inputs = _inputs(shape, strided_depth=True)
    names = list(inputs)
    ours = [inputs[n].detach().requires_grad_() for n in names]
    ref = [inputs[n].detach().double().requires_grad_() for n in names]
    weight = torch.randn(shape.batch, shape.q_heads, shape.q_len, device=DEVICE)
    _, lse = triton_attention(*ours, v.causal(), 0.25)
    _, ref_lse = reference_attention(*ref, v.causal(), 0.25)
    (lse * weight).sum().backward()
    (ref_lse * weight.double()).sum().backward()
    for name, a, b in zip(names, ours, ref):
        expected = torch.zeros_like(b) if b.grad is None else b.grad  # lse does not depend on v
        assert relative_error(a.grad, expected) < tolerance(torch.float32, DEVICE), name


@pytest.mark.parametrize("path", ["eager", "op"])
def test_a_second_derivative_is_refused(path):
    """The kernels' gradients have no graph: a backward under create_graph=True raises, first order still runs.

    ``eager`` is a direct call; ``op`` is the torch.library op that torch.compile traces, with its registered autograd.
    """
    inputs = _inputs(MoDAShape(1, 2, 1, 1, 5, 2, 16))
    leaves = list(inputs.values())

    def loss():
        if path == "eager":
            out = moda_attention(*leaves, variant=v.depth_window(1), backend="triton")
        else:
            q, k, vv, depth_k, depth_v = leaves
            # depth_window(1) of L = 2 slots: the first visible slot is 1.
            opts = Options(
                scale=0.25, causal=True, window=0, depth_first=1, sequence=True, softcap=0.0, bias_first=False
            )
            out, _ = torch.ops.moda_flex.triton_forward(q, k, vv, [depth_k], [depth_v], None, None, *opts)
        return out.pow(2).sum()

    with pytest.raises(NotImplementedError, match=r"backend 'triton'.*create_graph=True.*backend='reference'"):
        torch.autograd.grad(loss(), leaves, create_graph=True)
    grads = torch.autograd.grad(loss(), leaves)
    expected = torch.autograd.grad(
        moda_attention(*leaves, variant=v.depth_window(1), backend="reference").pow(2).sum(), leaves
    )
    for name, mine, theirs in zip(inputs, grads, expected):
        assert relative_error(mine, theirs) < tolerance(torch.float32, DEVICE), name


def test_backward_is_deterministic():
    shape = MoDAShape(1, 8, 2, 21, 21, 6, 16)
    inputs = _inputs(shape)
    grads = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in inputs.values()]
        out = moda_attention(*leaves, backend="triton")
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in leaves])
    for first, second in zip(*grads):
        assert torch.equal(first, second)


@pytest.mark.parametrize("backend", ["triton", "split"])  # the fused kernels, and the split path's on them
def test_out_is_laid_out_for_a_models_reshape(backend):
    """out comes laid out as (B, T, H, D), so that a model's reshape to (B, T, H * D) is a view, and the
    gradient that comes back through it, in that layout and taken without a copy, gives the reference's."""
    shape = MoDAShape(batch=2, q_heads=6, kv_heads=2, q_len=9, kv_len=9, slots=3, head_dim=16)
    inputs = _inputs(shape)
    out = moda_attention(**inputs, backend=backend)
    B, Hq, T, D = out.shape
    y = out.transpose(1, 2).reshape(B, T, Hq * D)
    assert y.data_ptr() == out.data_ptr() and y._base is not None  # a view of out, no copy
    grad = torch.randn(B, T, Hq * D, dtype=out.dtype)
    ref_inputs = {name: t.detach().double().requires_grad_() for name, t in inputs.items()}
    ref_out, _ = reference_attention(*ref_inputs.values(), v.causal(), D**-0.5)
    grads = torch.autograd.grad(y, list(inputs.values()), grad)
    ref_y = ref_out.transpose(1, 2).reshape(B, T, Hq * D)
    ref_grads = torch.autograd.grad(ref_y, list(ref_inputs.values()), grad.double())
    for name, got, ref in zip(inputs, grads, ref_grads):
        assert relative_error(got, ref) <= tolerance(torch.float32, DEVICE), name


def test_depth_view_is_read_in_place():
    """A slot-buffer view gives the same result as its contiguous copy, and its buffer gets no gradient copy."""
    shape = MoDAShape(1, 4, 1, 9, 9, 3, 16)
    inputs = _inputs(shape, strided_depth=True)
    assert not inputs["depth_k"].is_contiguous()
    out_view = moda_attention(*inputs.values(), backend="triton")
    contiguous = [t.detach().contiguous() for t in inputs.values()]
    out_copy = moda_attention(*contiguous, backend="triton")
    assert torch.equal(out_view, out_copy)


def test_config_hook_changes_the_launches_not_the_result():
    """``config=`` sees each kernel's default launch and may replace it; the result stays the reference's."""
    seen = []

    def config(kernel, default):
        seen.append(kernel)
        return {**default, "BLOCK_N": 2 * default["BLOCK_N"]}

    inputs = _inputs(MoDAShape(1, 4, 2, 9, 37, 3, 16))

    def run(q, k, vv, depth_k, depth_v, variant, scale):
        return triton_attention(q, k, vv, depth_k, depth_v, variant, scale, config=config)

    assert_matches_reference(inputs, backend=run, variant=v.causal())
    assert sorted(seen) == ["dkdv", "dq", "fwd"]  # each kernel's launch, once


@pytest.mark.parametrize("G", [3, 5, 6])
def test_dq_added_by_the_dkdv_kernel_over_packed_rows(G):
    """dQ's sequence part added by the dK/dV kernel (``DQ_ATOMIC`` 1) over its rows packed without padding,
    Tq < Tk: a block of BLOCK_M // G tokens, the rows past them idle."""

    def config(kernel, default):
        return {**default, "DQ_ATOMIC": 1} if kernel == "dkdv" else default

    def run(q, k, vv, depth_k, depth_v, variant, scale):
        return triton_attention(q, k, vv, depth_k, depth_v, variant, scale, config=config)

    inputs = _inputs(MoDAShape(1, 2 * G, 2, 19, 29, 3, 16), strided_depth=True)
    assert_matches_reference(inputs, backend=run, variant=v.causal())


@pytest.mark.parametrize("head_dim, hopper, rows", [(64, False, 3), (32, False, 3), (128, False, 4), (64, True, 4)])
def test_dkdv_rows_a_token(head_dim, hopper, rows):
    """G = 3: the dK/dV kernel packs a token's rows (G) on the generic path up to D=64, and pads them to GP where
    that measured faster (D=128) or the descriptors need it (the Hopper path)."""
    assert configs.launch_config(torch.device("cpu"), head_dim, 3, "dkdv", None, hopper=hopper)["ROW_G"] == rows


def test_compiles_fullgraph():
    shape = MoDAShape(1, 4, 2, 7, 7, 3, 16)
    inputs = _inputs(shape)

    def step(q, k, vv, dk, dv):
        return moda_attention(q, k, vv, dk, dv, backend="triton").sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [t.detach().requires_grad_() for t in inputs.values()]
    loss = compiled(*leaves)
    loss.backward()
    eager = [t.detach().requires_grad_() for t in inputs.values()]
    eager_loss = step(*eager)
    eager_loss.backward()
    assert torch.allclose(loss, eager_loss)
    for a, b in zip(leaves, eager):
        assert torch.allclose(a.grad, b.grad)


def test_runs_under_autocast():
    shape = MoDAShape(1, 2, 1, 6, 6, 2, 16)
    inputs = _inputs(shape, dtype=torch.bfloat16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = moda_attention(*inputs.values(), backend="triton")
    out.float().sum().backward()
    expected = reference_attention(*(t.detach().double() for t in inputs.values()), v.causal(), 0.25)[0]
    assert out.dtype == torch.bfloat16
    assert relative_error(out, expected) < 3e-2
    assert all(t.grad is not None for t in inputs.values())


@pytest.mark.parametrize(
    "variant, dim, dtype, needle",
    [
        (v.chunk_depth(4), 16, torch.float32, "depth_chunk"),
        (v.Variant("mine", lambda b, h, q, k: k <= q), 16, torch.float32, "Structure"),
        (v.causal(), 264, torch.float32, "D=264"),
        (v.causal(), 16, torch.float64, "float64"),
    ],
)
def test_unsupported_reason(variant, dim, dtype, needle):
    q = torch.zeros(1, 1, 1, dim, dtype=dtype, device=DEVICE)
    reason = unsupported_reason(q, variant)
    assert reason is not None and needle in reason
    with pytest.raises(NotImplementedError, match=needle):
        moda_attention(q, q, q, q[:, :, :, None], q[:, :, :, None], variant=variant, scale=1.0, backend="triton")


@settings(max_examples=examples(6))
@given(
    shape=moda_shapes(max_kv_len=20, max_slots=4, max_kv_heads=1, max_groups=3, head_dims=(8, 24, 40, 80, 136)),
    data=st.data(),
)
def test_head_dims_that_are_not_powers_of_two(shape, data):
    """D is padded to a power of two inside the kernels: output, lse and every gradient stay exact."""
    variant = data.draw(variants(shape, kinds=("causal", "full", "document"), structured=True))
    assert_matches_reference(_inputs(shape, depth_entries=data.draw(st.booleans())), backend="triton", variant=variant)


def test_supported_variants_have_no_reason():
    q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    for variant in (v.causal(), v.full(), v.sliding_window(3), v.depth_window(2), v.depth_only()):
        assert unsupported_reason(q, variant) is None


def test_doc_ids_of_wrong_length_raise():
    shape = MoDAShape(1, 2, 1, 5, 5, 1, 16)
    inputs = _inputs(shape)
    with pytest.raises(ValueError, match="doc_ids"):
        moda_attention(*inputs.values(), variant=v.document(torch.zeros(7, dtype=torch.long)), backend="triton")


def test_document_ids_that_differ_beyond_int32_stay_distinct():
    """The kernel reads int32 ids: the variant hands it dense ranks, so 0 and 2**32 are two documents."""
    ids = torch.tensor([0] * 6 + [2**32] * 7, device=DEVICE)
    shape = MoDAShape(1, 2, 1, 13, 13, 2, 16)
    assert_matches_reference(_inputs(shape), backend="triton", variant=v.causal() & v.document(ids))
