"""The traced ops' launches (moda_flex.backends.traced, .triton.traced), checked where no GPU is needed.

``torch.compile`` traces the ops only on CUDA (``wrap_triton`` does not take
the interpreter's kernels; tests/test_traced_gpu.py compiles them). Here the
same route runs the flat wrappers directly under the interpreter: the
entries stacked into depth slabs, every stride a scalar, and the results
equal the eager route's bit for bit, forward and backward.
"""

import functools

import pytest
import torch

pytest.importorskip("triton")

from moda_flex import DepthStream  # noqa: E402
from moda_flex.backends import traced  # noqa: E402
from moda_flex.backends.slot_pointers import SLOT_ARGS  # noqa: E402
from moda_flex.backends.triton import launch  # noqa: E402
from moda_flex.backends.triton import ops as fused_ops  # noqa: E402
from moda_flex.backends.triton import traced as fused_traced  # noqa: E402
from moda_flex.backends.triton.kernels.flat import forward_flat  # noqa: E402
from moda_flex.nn import Block, BlockConfig  # noqa: E402
from moda_flex.testing import MoDAShape, make_inputs  # noqa: E402

# The traced route with each flat wrapper launched as Triton launches it, not through wrap_triton.
DIRECT = fused_traced.TRACED._replace(launch=functools.partial(fused_traced.launch_traced, wrap=lambda kernel: kernel))


def _records(shape, entries, strided, causal=True, depth_first=0):
    t = make_inputs(shape, depth_entries=entries, strided_depth=strided, requires_grad=False, seed=1)
    inputs = launch.Inputs(t["q"], t["k"], t["v"], *(list(d) if entries else [d] for d in (t["depth_k"], t["depth_v"])),
                           None, None)  # fmt: skip
    return inputs, launch.Options(shape.head_dim**-0.5, causal, 0, depth_first, True, 0.0, False)


@pytest.mark.parametrize(
    "shape, entries, strided, causal, depth_first",
    [
        (MoDAShape(1, 3, 1, 9, 9, 5, 16), True, False, True, 0),  # G=3, a model's entries: 5 of 8 pointers
        (MoDAShape(2, 4, 2, 5, 11, 3, 8), False, True, True, 1),  # Tq < Tk, a strided slab, a masked first slot
        (MoDAShape(1, 2, 2, 7, 7, 0, 16), True, False, False, 0),  # no depth, full
    ],
)
def test_the_flat_wrappers_compute_what_the_eager_launches_do(shape, entries, strided, causal, depth_first):
    inputs, opts = _records(shape, entries, strided, causal, depth_first)
    out, lse = launch.forward(inputs, opts)
    flat_out, flat_lse = launch.forward(inputs, opts, route=DIRECT)
    torch.testing.assert_close(flat_out, out, rtol=0, atol=0)
    torch.testing.assert_close(flat_lse, lse, rtol=0, atol=0)
    grads = launch.Grads(torch.randn_like(out), torch.randn_like(lse), out, lse, False)
    expected = launch.backward(grads, inputs, opts)
    actual = launch.backward(grads, inputs, opts, route=DIRECT)
    for name, a, e in zip(("dq", "dk", "dv", "depth_k", "depth_v"), actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("shape, entries, causal", [
    (MoDAShape(1, 3, 1, 9, 9, 4, 16), True, True),  # G=3: the per-token kernels
    (MoDAShape(2, 8, 1, 6, 6, 3, 8), False, False),  # G=8: the tiles
    (MoDAShape(1, 8, 1, 5, 5, 0, 8), True, True),  # no depth: a null table, not an empty slab
])  # fmt: skip
def test_the_split_paths_flat_wrappers_compute_what_its_eager_launches_do(shape, entries, causal):
    from moda_flex import variants
    from moda_flex.backends.split import ops

    direct = ops.CAPTURED  # the traced launches, made by Triton
    fused, _ = _records(shape, entries, strided=False)
    inputs = ops.Inputs(*fused[:5])
    opts = ops.call_options(inputs.q, inputs.k, shape.slots, variants.causal() if causal else variants.full(),
                            shape.head_dim**-0.5)  # fmt: skip
    out, lse = ops._forward(*inputs, opts)
    flat_out, flat_lse = ops._forward(*inputs, opts, route=direct)
    torch.testing.assert_close(flat_out, out, rtol=0, atol=0)
    torch.testing.assert_close(flat_lse, lse, rtol=0, atol=0)
    grads = ops.Grads(torch.randn_like(out), torch.randn(out.shape[:3]), out, lse)
    expected = ops.backward_in_op_layouts(grads, inputs, opts)
    actual = ops.backward_in_op_layouts(grads, inputs, opts, route=direct)
    for name, a, e in zip(("dq", "dk", "dv", "depth_k", "depth_v"), actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=name)


def test_a_slab_is_read_as_it_lies():
    """Eagerly too: depth given as a slab reaches the kernels as that slab, no table and no copy."""
    inputs, _ = _records(MoDAShape(1, 2, 1, 4, 4, 3, 8), entries=False, strided=True)
    arguments, held = launch.EAGER.depth(inputs.depth_k, inputs.depth_v, 3, inputs.q.device)
    assert arguments["SLOTS"] == 2 and arguments["DK_TAB"] is inputs.depth_k[0] and not held
    slab = inputs.depth_k[0]
    assert arguments["sdk"] == (*slab.stride()[:3], slab.stride(4), slab.stride(3))


def test_flat_arguments_flatten_tuples_and_refuse_what_the_wrapper_lacks():
    flat = traced.flat_arguments(forward_flat, dict(G=1, QD=None, num_warps=4, sq=(4, 3, 2, 1), Q="q"))
    assert flat == dict(G=1, num_warps=4, sq0=4, sq1=3, sq2=2, sq3=1, Q="q")  # QD (None) left to the wrapper
    with pytest.raises(TypeError, match="QD"):
        traced.flat_arguments(forward_flat, dict(QD="a descriptor"))


@pytest.mark.parametrize("count", [1, 5, 33])  # one launch, one part-filled, two launches
def test_the_stack_kernel_stacks_both_sides_of_any_strides(count):
    keys = torch.randn(2, 3, 7, count, 12)  # strided entries: the slots of a slab, D=12 padded to 16 inside
    values = torch.randn(2, 3, 7, 12, count).transpose(3, 4)  # other strides, the head dim's not 1
    stack = functools.partial(traced.stack_sides, wrap=lambda kernel: kernel)
    for k, v in zip(stack(list(keys.unbind(3)), list(values.unbind(3))), (keys, values), strict=True):
        torch.testing.assert_close(k, v, rtol=0, atol=0)
    mixed = [keys[:, :, :, 0].contiguous(), *keys.unbind(3)[1:]]  # strides that differ: stacked all the same
    for k, v in zip(stack(mixed, list(values.unbind(3))), (keys, values), strict=True):
        torch.testing.assert_close(k, v, rtol=0, atol=0)


def test_the_fused_kernels_take_a_models_entries_as_pointers_uncopied():
    keys = [torch.randn(1, 2, 3, 8) for _ in range(3)]
    values = list(torch.randn(1, 2, 3, 3, 8).unbind(3))  # the slots of a slab: strided, each 32 bytes apart
    arguments, held = traced.pointer_depth(keys, values, 3, keys[0].device)
    assert arguments["SLOTS"] == 3 and arguments["SLOT_PTRS"] == 4 and not held
    for given, side in ((arguments["DK"], keys), (arguments["DV"], values)):  # 3 rounds up to 4, then None
        assert given == (*side, side[-1], *(None,) * (SLOT_ARGS - 4))
    assert arguments["sdk"] == (*keys[0].stride(), 0) and arguments["sdv"] == (*values[0].stride(), 0)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_models_attention_and_ffn_entries_take_the_pointer_path(norm):
    """A stream of moda_flex.nn blocks' attention and FFN entries: each side one stride tuple at 16-byte offsets,
    so the kernels take every entry as a pointer where it lies, not a stack of them copied each call."""
    config = BlockConfig(n_embd=48, n_head=6, n_kv_head=2, depth_kv="attn+ffn", norm=norm)
    x, stream = torch.randn(2, 5, 48), DepthStream()
    for block in [Block(config) for _ in range(3)]:
        x, stream = block(x, stream)
    depth_k, depth_v = stream.read()
    arguments, _ = traced.pointer_depth(depth_k, depth_v, len(depth_k), x.device)
    assert len(depth_k) == 6 and arguments["SLOTS"] == 3  # 2: one slab, the entries stacked into it


@pytest.mark.parametrize("case", ["more than the arguments", "strides that differ", "misaligned", "a slab"])
def test_other_depth_reaches_the_pointer_arguments_as_one_slab(case, monkeypatch):
    monkeypatch.setattr(traced, "stack_sides", functools.partial(traced.stack_sides, wrap=lambda kernel: kernel))
    slab = torch.randn(1, 2, 3, SLOT_ARGS + 1 if case == "more than the arguments" else 4, 8)
    entries = list(slab.unbind(3))
    if case == "strides that differ":
        entries[1] = entries[1].contiguous()
    if case == "misaligned":  # 8 bytes into its storage
        entries = [torch.randn(1, 2, 3, 10)[..., 2:] for _ in entries]
    depth = [slab] if case == "a slab" else entries
    arguments, _ = traced.pointer_depth(depth, depth, slab.shape[3], slab.device)
    assert arguments["SLOTS"] == 2
    stacked = arguments["DK"][0]
    assert arguments["DK"] == (stacked, *(None,) * (SLOT_ARGS - 1))
    torch.testing.assert_close(stacked, torch.stack(entries, 3), rtol=0, atol=0)


def test_only_static_cuda_calls_are_traced():
    q = torch.zeros(1, 2, 3, 4)
    assert not traced.traceable(q, q)  # CPU: the interpreter's kernels cannot be traced


@pytest.mark.parametrize("backend", ["triton", "split"])
def test_the_traced_ops_autograd_gives_the_eager_gradients(backend):
    """Called eagerly (Triton launches the kernels), a traced forward op's registered autograd runs its traced
    backward op: the gradients of q, k, v and every entry are the eager path's."""
    from moda_flex import moda_attention, variants
    from moda_flex.backends.split import ops as split_ops

    t = make_inputs(MoDAShape(1, 3, 1, 6, 6, 3, 16), depth_entries=True, seed=4)
    leaves = [t["q"], t["k"], t["v"], *t["depth_k"], *t["depth_v"]]
    expected = torch.autograd.grad(moda_attention(*leaves[:3], t["depth_k"], t["depth_v"], backend=backend)
                                   .square().sum(), leaves)  # fmt: skip
    depth = [list(t["depth_k"]), list(t["depth_v"])]
    scale = 16**-0.5
    if backend == "split":
        opts = split_ops.call_options(t["q"], t["k"], 3, variants.causal(), scale)
        out, _ = split_ops.traced_forward(*leaves[:3], *depth, *opts)
    else:
        opts = launch.Options(scale, True, 0, 0, True, 0.0, False)
        out, _ = fused_ops.traced_forward(*leaves[:3], *depth, None, None, *opts)
    actual = torch.autograd.grad(out.square().sum(), leaves)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graphs", [False, True])
def test_autos_traced_op_launches_the_fused_kernels_itself_unless_the_graph_is_captured(graphs, monkeypatch):
    """``auto``'s traced op, called eagerly under inductor's ``triton.cudagraphs`` setting: without CUDA graphs
    its body launches the fused kernels through the traced route; with them it holds the opaque ops, which
    choose at launch. Either way the results and every gradient are the fused kernel's."""
    from torch._inductor import config

    from moda_flex import moda_attention, variants
    from moda_flex.backends import capture
    from moda_flex.backends.split import ops as split_ops

    launched = []
    route = fused_traced.TRACED
    monkeypatch.setattr(fused_traced, "TRACED", route._replace(
        launch=lambda kernel, *args, **kwargs: launched.append(kernel) or route.launch(kernel, *args, **kwargs)))
    t = make_inputs(MoDAShape(1, 3, 1, 6, 6, 3, 16), depth_entries=True, seed=5)
    leaves = [t["q"], t["k"], t["v"], *t["depth_k"], *t["depth_v"]]
    out = moda_attention(*leaves[:3], t["depth_k"], t["depth_v"], backend="triton")
    expected = (out, *torch.autograd.grad(out.square().sum(), leaves))
    opts = split_ops.call_options(t["q"], t["k"], 3, variants.causal(), 16**-0.5)
    with config.patch({"triton.cudagraphs": graphs}):
        out, _ = capture.traced_forward(*leaves[:3], list(t["depth_k"]), list(t["depth_v"]), *opts)
        actual = (out, *torch.autograd.grad(out.square().sum(), leaves))
    assert bool(launched) != graphs
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode, graphs", [("default", False), ("reduce-overhead", True), ("max-autotune", True)])
def test_a_traced_body_sees_whether_its_graph_runs_as_a_cuda_graph(mode, graphs):
    """What ``auto``'s traced op relies on: inductor traces a triton_op's body under the compile mode's settings
    (here with a body of PyTorch ops on CPU, which inductor compiles without a GPU)."""
    from moda_flex.backends import capture

    seen = []

    @torch.library.triton_op("moda_flex_test::graphs_probe_" + mode.replace("-", "_"), mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(capture.graphs_captured())
        return x * 2

    torch._dynamo.reset()
    # a cached graph would be reused untraced (its key holds the mode's settings): trace afresh
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(lambda x: probe(x) + 1, mode=None if mode == "default" else mode, fullgraph=True)(torch.ones(3))
    assert seen[-1] is graphs  # the trace inductor compiles (Dynamo's earlier one sees the defaults)
