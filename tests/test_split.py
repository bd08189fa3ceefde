"""The split path against the float64 reference, and where ``auto`` sends a call.

On CPU the depth kernels run under the Triton interpreter and SDPA's CPU
flash op stands in for the vendor's kernel (float32, small shapes); on a GPU
the same tests run the cuDNN or FlashAttention op in bfloat16 and float16.
"""

import types
from contextlib import nullcontext

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from moda_flex import backends, moda_attention  # noqa: E402
from moda_flex import variants as v  # noqa: E402
from moda_flex.backends import split  # noqa: E402
from moda_flex.backends.reference import reference_attention  # noqa: E402
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs, moda_shapes, relative_error, tolerance  # noqa: E402

from budget import examples  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float32,)
# Head dims: on a GPU also 64, where the sequence part runs on cuDNN (FlashAttention at the others).
HEAD_DIMS = (8, 16, 64) if DEVICE == "cuda" else (8, 16)
# The variants the split path computes: the sequence mask of the vendor's kernel, depth slots of the token's own.
KINDS = ("causal", "full", "depth_window", "depth_only")


def _split_variants(shape: MoDAShape):
    """Variants the split path runs for ``shape``: causal ones only at Tq == Tk (the vendor aligns it top-left)."""
    any_length = st.sampled_from([v.full(), v.depth_only()])
    causal = st.just(v.causal()) | st.integers(1, max(shape.slots, 1)).map(v.depth_window)  # a causal depth window
    return (any_length | causal) if shape.q_len == shape.kv_len else any_length


# 16 keeps the suite within its 10 minutes on 2 cores (HYPOTHESIS_PROFILE=dev draws ten times as many)
@settings(max_examples=examples(16))
@given(
    shape=moda_shapes(max_kv_len=40, max_slots=9, max_kv_heads=2, head_dims=HEAD_DIMS),
    dtype=st.sampled_from(DTYPES),
    strided=st.booleans(),
    entries=st.booleans(),
    data=st.data(),
)
def test_matches_reference(shape, dtype, strided, entries, data):
    """Output, lse and the five gradients: odd lengths, G of 1..8, L of 0..9, Tq < Tk under full, strided depth.

    With ``entries``, depth is a list of per-layer tensors, each given its own gradient.
    """
    variant = data.draw(_split_variants(shape))
    inputs = make_inputs(shape, dtype=dtype, device=DEVICE, strided_depth=strided, depth_entries=entries)
    assert split.unsupported_reason(inputs["q"], inputs["k"], variant) is None
    assert_matches_reference(inputs, backend="split", variant=variant)


@pytest.mark.parametrize("form", ["slab", "entries"])
def test_depth_read_in_place_whatever_its_strides(form):
    """Depth read through its slot addresses: a slab whose head dim is not its last stride, or entries whose
    strides differ from one another."""
    shape = MoDAShape(batch=2, q_heads=4, kv_heads=2, q_len=7, kv_len=7, slots=3, head_dim=16)
    inputs = make_inputs(shape, dtype=DTYPES[0], device=DEVICE)
    B, Hk, T, L, D = inputs["depth_k"].shape
    if form == "slab":  # (B, Hk, T, D, L) memory seen as (B, Hk, T, L, D)
        for name in ("depth_k", "depth_v"):
            inputs[name] = inputs[name].detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
        assert inputs["depth_k"].stride(-1) == L
    else:
        layouts = [lambda t: t, lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
                   lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)]  # fmt: skip
        for name in ("depth_k", "depth_v"):
            entries = inputs[name].detach().unbind(3)
            inputs[name] = [layout(e).requires_grad_() for layout, e in zip(layouts, entries, strict=True)]
        assert len({e.stride() for e in inputs["depth_k"]}) == 3
    assert_matches_reference(inputs, backend="split", variant=v.causal())


@pytest.mark.parametrize("variant", [v.causal(), v.depth_window(20)], ids=lambda x: x.name)
def test_slots_in_several_steps_and_tokens_a_program(variant, monkeypatch):
    """The Tensor Core tiles' (token, slot) columns at G=3: twice the least tokens a program, L=37 slots, 16
    columns a step (a token's slots span steps, a step holds two tokens' slots, the last one partial; a depth
    window starts mid-step), a ragged last block of tokens."""
    chosen = split.ops._layout

    def layout(*args):
        tiles = chosen(*args, design="tiles")
        return dict(tiles, BLOCK_T=2 * tiles["BLOCK_T"], BLOCK_C=16)

    monkeypatch.setattr(split.ops, "_layout", layout)
    shape = MoDAShape(batch=1, q_heads=6, kv_heads=2, q_len=11, kv_len=11, slots=37, head_dim=16)
    assert_matches_reference(make_inputs(shape, dtype=DTYPES[0], device=DEVICE), backend="split", variant=variant)


def _design(patch, design: str, **constants):
    """Make ``ops._layout`` give ``design``'s layout whatever G is, with ``constants`` over its own."""
    chosen = split.ops._layout
    patch.setattr(split.ops, "_layout", lambda *args: dict(chosen(*args, design=design), **constants))


@pytest.mark.parametrize("design", ["tiles", "tokens"])
@pytest.mark.parametrize("q_heads", [2, 6, 16])
def test_either_design_at_any_group(design, q_heads, monkeypatch):
    """Both depth kernel designs at G of 1, 3 and 8, whichever ``_layout`` picks for that G: a depth window, a
    ragged last block of tokens (4 a program), strided entries."""
    _design(monkeypatch, design, **({"BLOCK_T": 4} if design == "tokens" else {}))
    shape = MoDAShape(batch=2, q_heads=q_heads, kv_heads=2 if q_heads > 2 else 1, q_len=13, kv_len=13, slots=6,
                      head_dim=16)  # fmt: skip
    inputs = make_inputs(shape, dtype=DTYPES[0], device=DEVICE, strided_depth=True, depth_entries=True)
    assert_matches_reference(inputs, backend="split", variant=v.depth_window(4))


def _per_token_kernels(monkeypatch):
    """The per-token kernels (the forward two slots a step), four tokens a program."""
    _design(monkeypatch, "tokens", BLOCK_T=4)


# each slot count once with a sequence part and once without (a window of 3 slots is the whole depth at 1 or 2
# slots: it starts on slot 2 at 5 slots, on slot 3 at 6)
@pytest.mark.parametrize("slots, variant", [
    (1, v.depth_only()), (2, v.causal()), (5, v.depth_only()), (6, v.causal()),
    (5, v.depth_window(3)), (6, v.depth_window(3)),
], ids=lambda x: getattr(x, "name", str(x)))
def test_two_slots_a_step(slots, variant, monkeypatch):
    """The per-token forward's steps of two slots: odd and even slot counts (an odd count's last step has one
    slot), a depth window that starts on an odd slot, no sequence part; G=3, a ragged last block of tokens."""
    _per_token_kernels(monkeypatch)
    shape = MoDAShape(batch=2, q_heads=6, kv_heads=2, q_len=7, kv_len=7, slots=slots, head_dim=16)
    inputs = make_inputs(shape, dtype=DTYPES[0], device=DEVICE, depth_entries=True)
    assert_matches_reference(inputs, backend="split", variant=variant)


def _assert_gradients_match_reference(inputs: dict, out, lse, variant, loss) -> None:
    """Every input's gradient of ``loss(out, lse)`` against the float64 reference's; zero where the reference's
    loss does not depend on an input."""
    ref_inputs = {name: t.detach().double().requires_grad_() for name, t in inputs.items()}
    ref_out, ref_lse = reference_attention(*ref_inputs.values(), variant, inputs["q"].shape[-1] ** -0.5)
    grads = torch.autograd.grad(loss(out.float(), lse), list(inputs.values()))
    ref_grads = torch.autograd.grad(loss(ref_out, ref_lse), list(ref_inputs.values()), allow_unused=True)
    for name, grad, ref in zip(inputs, grads, ref_grads):
        if ref is None:
            assert not grad.any(), name
        else:
            assert relative_error(grad, ref) <= tolerance(DTYPES[0], DEVICE), name


@pytest.mark.parametrize("variant", [v.causal(), v.full(), v.depth_window(2), v.depth_only()], ids=lambda x: x.name)
def test_the_lse_gradient(variant):
    """A loss of out and lse: the lse's gradient reaches the vendor's backward through its extra head lanes."""
    shape = MoDAShape(batch=2, q_heads=6, kv_heads=2, q_len=9, kv_len=9, slots=5, head_dim=16)
    inputs = make_inputs(shape, dtype=DTYPES[0], device=DEVICE)
    out, lse = moda_attention(**inputs, variant=variant, backend="split", return_lse=True)
    weights = torch.randn(lse.shape, dtype=torch.float64, device=DEVICE)
    _assert_gradients_match_reference(inputs, out, lse, variant,
                                      lambda o, l: (o.sum(-1) * 0.3 + l * weights.to(l.dtype)).sum())  # fmt: skip


def test_a_loss_of_the_lse_alone():
    """No gradient reaches the output: the backward reads the lse's gradient only (the values' is zero)."""
    shape = MoDAShape(batch=1, q_heads=2, kv_heads=1, q_len=5, kv_len=5, slots=3, head_dim=8)
    inputs = make_inputs(shape, dtype=DTYPES[0], device=DEVICE)
    out, lse = moda_attention(**inputs, backend="split", return_lse=True)
    _assert_gradients_match_reference(inputs, out, lse, v.causal(), lambda o, l: l.sum())


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("forward_on", ["flash", "default"])
def test_the_backward_runs_on_the_forwards_kernel(with_lse, forward_on, monkeypatch):
    """The vendor's op is chosen once, in the forward: a backward run after SDPA's switches changed (the forward
    under ``sdpa_kernel([FLASH_ATTENTION])``, the backward outside it) still takes the forward's op and its lse.
    ``default``: at D=64 on an H100 the forward runs on cuDNN, and the lse's gradient on FlashAttention.

    On CPU the switch is simulated: after the forward, choosing an op fails.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = MoDAShape(batch=1, q_heads=4, kv_heads=2, q_len=12, kv_len=12, slots=3, head_dim=64)
    inputs = make_inputs(shape, dtype=DTYPES[0], device=DEVICE)
    switches = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]) if forward_on == "flash" else nullcontext()
    with switches:
        out, lse = moda_attention(**inputs, backend="split", return_lse=True)
    if DEVICE == "cpu":
        def refuse(*args):
            raise AssertionError("the backward chose the vendor's op again")

        monkeypatch.setattr(split.sequence, "kernel_for", refuse)
    _assert_gradients_match_reference(inputs, out, lse, v.causal(),
                                      lambda o, l: o.sum() + (l.sum() if with_lse else 0))  # fmt: skip


@pytest.mark.parametrize("layout", ["heads_first", "strided_lanes"])
def test_an_output_gradient_in_any_layout(layout):
    """dO need not have out's (B, T, H, D) layout: a contiguous one, and one whose head dim has stride 2,
    give the reference's gradients."""
    shape = MoDAShape(batch=2, q_heads=6, kv_heads=2, q_len=9, kv_len=9, slots=4, head_dim=16)
    inputs = make_inputs(shape, dtype=DTYPES[0], device=DEVICE)
    out = moda_attention(**inputs, backend="split")
    B, Hq, T, D = out.shape
    if layout == "heads_first":
        grad = torch.randn(B, Hq, T, D, device=DEVICE, dtype=out.dtype)
    else:
        grad = torch.randn(B, Hq, T, 2 * D, device=DEVICE, dtype=out.dtype)[..., ::2]
    assert grad.stride() != out.stride()
    ref_inputs = {name: t.detach().double().requires_grad_() for name, t in inputs.items()}
    ref_out, _ = reference_attention(*ref_inputs.values(), v.causal(), D**-0.5)
    grads = torch.autograd.grad(out, list(inputs.values()), grad)
    ref_grads = torch.autograd.grad(ref_out, list(ref_inputs.values()), grad.double())
    for name, got, ref in zip(inputs, grads, ref_grads):
        assert relative_error(got, ref) <= tolerance(DTYPES[0], DEVICE), name


def test_no_second_derivative():
    """The kernels' gradients have no graph: a backward that builds one is refused, not silently wrong."""
    inputs = make_inputs(MoDAShape(1, 2, 1, 4, 4, 2, 8), dtype=DTYPES[0], device=DEVICE)
    out = moda_attention(**inputs, backend="split")
    with pytest.raises(NotImplementedError, match="backend 'split' has no second derivative"):
        torch.autograd.grad(out.square().sum(), inputs["q"], create_graph=True)


# ---- auto's choice --------------------------------------------------------------------------------------------


def _call(device: str, dtype=torch.bfloat16, q_len=8192, kv_len=8192, head_dim=64, batch=2):
    """Stand-ins for q and k: the policy reads only their shapes, dtype and device."""
    q = types.SimpleNamespace(shape=(batch, 8, q_len, head_dim), dtype=dtype, device=torch.device(device),
                              numel=lambda: 1)  # fmt: skip
    k = types.SimpleNamespace(shape=(batch, 2, kv_len, head_dim), dtype=dtype, device=torch.device(device))
    return q, k


T = 8192  # (2, 8, T, 64) queries over T keys: 2^30 logits, a call the split path takes
CASES = {
    # (variant, slots, q_len, dtype, head_dim, return_lse) -> what auto runs on an sm90 GPU
    "causal, no depth": ((v.causal(), 0, T, torch.bfloat16, 64, False), "sdpa_attention"),
    "causal MoDA": ((v.causal(), 8, T, torch.bfloat16, 64, False), "split_attention"),
    "causal MoDA, lse": ((v.causal(), 8, T, torch.float16, 64, True), "split_attention"),
    "causal MoDA, a small call": ((v.causal(), 8, T, torch.bfloat16, 64, False), "capture_attention"),
    "full MoDA, Tq < Tk, a small call": ((v.full(), 8, T // 2, torch.bfloat16, 64, True), "capture_attention"),
    "full MoDA, Tq < Tk": ((v.full(), 8, T // 2, torch.bfloat16, 128, False), "split_attention"),
    "depth window": ((v.depth_window(2), 8, T, torch.bfloat16, 64, False), "split_attention"),
    "depth only": ((v.depth_only(), 8, T, torch.bfloat16, 64, False), "split_attention"),
    "causal MoDA, Tq < Tk": ((v.causal(), 8, T // 2, torch.bfloat16, 64, False), "triton_attention"),
    "float32": ((v.causal(), 8, T, torch.float32, 64, False), "triton_attention"),
    "head dim 20": ((v.causal(), 8, T, torch.bfloat16, 20, False), "triton_attention"),
    "head dim 512": ((v.causal(), 8, T, torch.bfloat16, 512, False), "flex_attention_backend"),
    "sliding window": ((v.sliding_window(4), 8, T, torch.bfloat16, 64, False), "triton_attention"),
    "documents": ((v.causal() & v.document(torch.tensor([[0] * (T // 2) + [1] * (T // 2)] * 2)), 8, T,
                   torch.bfloat16, 64, False), "triton_attention"),  # fmt: skip
    "chunk-visible depth": ((v.chunk_depth(4), 8, T, torch.bfloat16, 64, False), "flex_attention_backend"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_on_cuda(case, monkeypatch):
    """The policy is a function of the call: shapes, dtype, device and variant, here on a stand-in sm90 GPU."""
    (variant, slots, q_len, dtype, head_dim, return_lse), expected = CASES[case]
    monkeypatch.setattr(split.support, "capability", lambda device: (9, 0))
    monkeypatch.setattr(split.sequence, "capability", lambda device: (9, 0))
    if case.endswith("a small call"):  # 1 x 8 x 1024 x 1024 logits, below the split path's threshold
        q, k = _call("cuda", dtype, q_len * 1024 // T, 1024, head_dim, batch=1)
    else:
        q, k = _call("cuda", dtype, q_len, T, head_dim)
    assert backends.choose("auto", q, k, slots, variant, return_lse=return_lse).__name__ == expected


@pytest.mark.parametrize("kind", sorted(v.BUILTINS))
def test_auto_on_cpu_never_runs_a_kernel(kind):
    variant = v.BUILTINS[kind].example(64, 8)
    q, k = _call("cpu", torch.float32)
    assert backends.choose("auto", q, k, 8, variant, return_lse=False) is reference_attention


def test_split_by_name_says_why_not():
    inputs = make_inputs(MoDAShape(1, 2, 1, 3, 5, 2, 8), device=DEVICE, dtype=DTYPES[0])
    with pytest.raises(NotImplementedError, match=r"backend 'split' cannot run this call \(.*variant 'causal'\): a causal mask .* top-left"):
        moda_attention(**inputs, backend="split")


@pytest.mark.parametrize("grad_lse", [False, True], ids=["dO", "dO+dLSE"])
@pytest.mark.parametrize("q_layout", ["BHTD", "BTHD"])
@pytest.mark.parametrize("variant", [v.causal(), v.depth_only()], ids=lambda x: x.name)
def test_the_ops_fakes_give_the_kernels_layouts(variant, q_layout, grad_lse):
    """Inductor checks each op output's strides against its fake's: both ops' fakes must match what the ops
    return, whatever layouts the vendor's kernel picks (the CPU op's lse and gradients are (B, T, H) in memory),
    for q, k, v in either layout, with and without a sequence part and the lse's gradient."""
    B, Hq, Hk, T, D, L = 1, 4, 2, 5, HEAD_DIMS[-1], 3
    dtype = DTYPES[0]

    def heads(H):  # (B, H, T, D) in the layout of the parameter
        t = torch.randn(B, T, H, D, device=DEVICE, dtype=dtype).transpose(1, 2)
        return t.contiguous() if q_layout == "BHTD" else t

    q, k, v = heads(Hq), heads(Hk), heads(Hk)
    depth = [torch.randn(B, Hk, T, D, device=DEVICE, dtype=dtype) for _ in range(2 * L)]
    opts = split.ops.call_options(q, k, L, variant, D**-0.5)
    inputs = split.ops.Inputs(q, k, v, depth[:L], depth[L:])
    torch.library.opcheck(torch.ops.moda_flex.split_forward.default, (*inputs, *opts), test_utils=("test_faketensor",))
    out, lse = torch.ops.moda_flex.split_forward(*inputs, *opts)
    glse = torch.randn(B, Hq, T, device=DEVICE).reshape(lse.shape) if grad_lse else None
    grads = split.ops.Grads(torch.randn_like(out), glse, out, lse)
    torch.library.opcheck(torch.ops.moda_flex.split_backward.default, (*grads, *inputs, *opts),
                          test_utils=("test_faketensor",))  # fmt: skip


@pytest.mark.parametrize("variant", [v.causal(), v.depth_only()], ids=lambda x: x.name)
def test_traces_under_fullgraph_compile(variant):
    """The ops' fakes let torch.compile trace a call (depth as entries, as a model passes it) in one graph, with
    a sequence part and without."""
    shape = MoDAShape(batch=1, q_heads=4, kv_heads=2, q_len=6, kv_len=6, slots=3, head_dim=8)
    inputs = make_inputs(shape, dtype=DTYPES[0], device=DEVICE, depth_entries=True)

    def loss(q, k, v, depth_k, depth_v):
        out, lse = moda_attention(q, k, v, depth_k, depth_v, variant=variant, backend="split", return_lse=True)
        return out.float().square().sum() + lse.sum()

    names = list(inputs)
    leaves = [inputs["q"], inputs["k"], inputs["v"], *inputs["depth_k"], *inputs["depth_v"]]
    expected = torch.autograd.grad(loss(*inputs.values()), leaves)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    actual = torch.autograd.grad(compiled(*(inputs[name] for name in names)), leaves)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
