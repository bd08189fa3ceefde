"""The one launcher (moda_flex.backends.launch, .flat) and the traced ops, checked where no GPU is needed.

``torch.compile`` traces the ops only on CUDA (``wrap_triton`` does not take
the interpreter's kernels; tests/test_traced_gpu.py compiles them). Every
eager call runs the same flat wrappers and depth arguments under the
interpreter, so the backends' tests against the reference check them; here
the pieces: how depth reaches a kernel, the wrappers'
arguments, and the traced ops' autograd.
"""

import pytest
import torch

pytest.importorskip("triton")

from moda_flex import DepthStream  # noqa: E402
from moda_flex.backends import launch as launching  # noqa: E402
from moda_flex.backends.slot_pointers import SLOT_ARGS  # noqa: E402
from moda_flex.backends.triton import launch  # noqa: E402
from moda_flex.backends.triton import ops as fused_ops  # noqa: E402
from moda_flex.backends.triton import traced as fused_traced  # noqa: E402
from moda_flex.backends import flat  # noqa: E402
from moda_flex.backends.triton.kernels import forward_kernel  # noqa: E402
from moda_flex.nn import Block, BlockConfig  # noqa: E402
from moda_flex.testing import MoDAShape, make_inputs  # noqa: E402


def _records(shape, entries, strided, causal=True, depth_first=0):
    t = make_inputs(shape, depth_entries=entries, strided_depth=strided, requires_grad=False, seed=1)
    inputs = launch.Inputs(t["q"], t["k"], t["v"], *(list(d) if entries else [d] for d in (t["depth_k"], t["depth_v"])),
                           None, None)  # fmt: skip
    return inputs, launch.Options(shape.head_dim**-0.5, causal, 0, depth_first, True, 0.0, False)


def test_a_slab_is_read_as_it_lies():
    """Depth given as a slab reaches the kernels as that slab, no table and no copy."""
    inputs, _ = _records(MoDAShape(1, 2, 1, 4, 4, 3, 8), entries=False, strided=True)
    arguments = launching.pointer_depth(inputs.depth_k, inputs.depth_v, 3, inputs.q.device)
    assert arguments["SLOTS"] == 2 and arguments["DK"][0] is inputs.depth_k[0]
    slab = inputs.depth_k[0]
    assert arguments["sdk"] == (*slab.stride()[:3], slab.stride(4), slab.stride(3))


def test_flat_arguments_spread_tuples_and_leave_none_to_the_wrapper():
    arguments = dict(G=1, QD=None, num_warps=4, sq=(4, 3, 2, 1), Q="q")
    assert flat.flat_arguments(arguments) == dict(G=1, num_warps=4, sq0=4, sq1=3, sq2=2, sq3=1, Q="q")
    assert dict(flat.launch_kinds(arguments)) == dict(G="value", QD=None, sq=4, Q="value")  # launch options: no kind


def test_a_flat_wrapper_is_written_only_for_a_launch_that_gives_every_argument():
    with pytest.raises(TypeError, match="a launch of forward_kernel gives no 'Q'"):
        flat.flat_wrapper(forward_kernel, (("NOT_AN_ARGUMENT", "value"),))


def test_the_fused_kernels_take_a_models_entries_as_pointers_uncopied():
    keys = [torch.randn(1, 2, 3, 8) for _ in range(3)]
    values = list(torch.randn(1, 2, 3, 3, 8).unbind(3))  # the slots of a slab: strided, each 32 bytes apart
    arguments = launching.pointer_depth(keys, values, 3, keys[0].device)
    assert arguments["SLOTS"] == 3 and arguments["SLOT_PTRS"] == 4
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
    arguments = launching.pointer_depth(depth_k, depth_v, len(depth_k), x.device)
    assert len(depth_k) == 6 and arguments["SLOTS"] == 3  # 2: one slab, the entries stacked into it


@pytest.mark.parametrize("case", ["more than the arguments", "strides that differ", "misaligned", "a slab"])
def test_other_depth_reaches_the_pointer_arguments_as_one_slab(case):
    slab = torch.randn(1, 2, 3, SLOT_ARGS + 1 if case == "more than the arguments" else 4, 8)
    entries = list(slab.unbind(3))
    if case == "strides that differ":
        entries[1] = entries[1].contiguous()
    if case == "misaligned":  # 8 bytes into its storage
        entries = [torch.randn(1, 2, 3, 10)[..., 2:] for _ in entries]
    depth = [slab] if case == "a slab" else entries
    arguments = launching.pointer_depth(depth, depth, slab.shape[3], slab.device)
    assert arguments["SLOTS"] == 2
    stacked = arguments["DK"][0]
    assert arguments["DK"] == (stacked, *(None,) * (SLOT_ARGS - 1))
    torch.testing.assert_close(stacked, torch.stack(entries, 3), rtol=0, atol=0)


def test_only_static_cuda_calls_are_traced():
    q = torch.zeros(1, 2, 3, 4)
    assert not launching.traceable(q, q)  # CPU: the interpreter's kernels cannot be traced


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
    monkeypatch.setattr(fused_traced, "TRACED", route._replace(wrap=lambda kernel: launched.append(kernel) or route.wrap(kernel)))
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
