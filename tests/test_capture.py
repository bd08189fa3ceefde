"""``auto``'s kernels for a model's calls: the fused kernel, or the split path while a CUDA graph is captured.

Compiled, the forward op and the backward op each choose when they launch,
so a step may run its forward on one kernel and its backward on the other:
every pairing is checked against the float64 reference, on the output, the
lse and every gradient. On CPU (Triton's
interpreter, float32) a capture is simulated; on a GPU a real one is taken.
"""

import itertools

import pytest
import torch

pytest.importorskip("triton")

from moda_flex import moda_attention  # noqa: E402
from moda_flex import variants as v  # noqa: E402
from moda_flex.backends import capture, split  # noqa: E402
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# Each pairing of the forward's kernel with the backward's: (forward captured, backward captured).
PAIRINGS = [(False, False), (True, True), (False, True), (True, False)]
PAIRING_IDS = ["fused", "split", "fused-then-split", "split-then-fused"]


class Captures:
    """Stands in for :func:`capture.capturing`: the n-th launch of a call sees ``states[n]``; counts the
    kernels each launch ran (with no capture to prepare: :func:`capture.prepare_capture` is a GPU test's). A
    compiled call takes the opaque ops, which choose at launch, on CUDA too, where it would otherwise take the
    traced ones, which choose when inductor compiles them (``tests/test_traced_gpu.py``)."""

    def __init__(self, monkeypatch, states):
        self.states, self.seen, self.ran = states, 0, []
        monkeypatch.setattr(capture, "capturing", self._capturing)
        monkeypatch.setattr(capture, "traceable", lambda *tensors: False)
        monkeypatch.setattr(capture, "prepare_capture", lambda inputs, opts: None)
        for module, name in [(capture.split_ops, "_forward"), (capture.split_ops, "backward_in_op_layouts"),
                             (capture.fused_ops, "_run_forward"), (capture.fused_ops, "_run_backward")]:  # fmt: skip
            monkeypatch.setattr(module, name, self._spy(getattr(module, name), name))

    def _capturing(self, device):
        self.seen += 1
        return self.states[self.seen - 1]

    def _spy(self, fn, name):
        def spied(*args, **kwargs):
            self.ran.append(name)
            return fn(*args, **kwargs)

        return spied

    def expected(self) -> list[str]:
        forward, backward = self.states
        return [("_forward" if forward else "_run_forward"), ("backward_in_op_layouts" if backward else "_run_backward")]


def _compiled_capture():
    """:func:`capture.capture_attention` under ``torch.compile(fullgraph=True)``: the ops, traced once (the
    frames of earlier tests' compiles dropped: they share one code object and its recompile limit)."""
    torch._dynamo.reset()
    return torch.compile(capture.capture_attention, backend="aot_eager", fullgraph=True, dynamic=False)


CALLS = {
    # (shape, variant, depth form) for the pairings: odd lengths, G of 1 and 3, strided entries, L = 0, Tq < Tk
    "causal, G=3, strided entries": (MoDAShape(2, 6, 2, 7, 7, 5, 16), v.causal(), dict(strided_depth=True,
                                                                                      depth_entries=True)),
    "full, Tq < Tk, G=4": (MoDAShape(1, 4, 1, 5, 9, 3, 8), v.full(), {}),
    "depth window, no slot seen twice": (MoDAShape(1, 2, 2, 6, 6, 4, 8), v.depth_window(2), {}),
    "depth only": (MoDAShape(1, 6, 2, 5, 5, 3, 16), v.depth_only(), dict(depth_entries=True)),
    "no depth": (MoDAShape(1, 4, 2, 9, 9, 0, 8), v.causal(), {}),
}


@pytest.mark.parametrize("states", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_pairing_matches_the_reference(call, states, monkeypatch):
    """Output, lse and the five gradients, whichever kernel each half ran on."""
    shape, variant, form = CALLS[call]
    inputs = make_inputs(shape, dtype=DTYPE, device=DEVICE, **form)
    assert split.unsupported_reason(inputs["q"], inputs["k"], variant) is None
    captures = Captures(monkeypatch, states)
    assert_matches_reference(inputs, backend=_compiled_capture(), variant=variant)
    assert captures.seen == 2 and captures.ran == captures.expected()


@pytest.mark.parametrize("captured", [False, True])
def test_an_eager_call_runs_wholly_on_the_kernel_chosen_when_it_is_made(captured, monkeypatch):
    """Eagerly, the call is one backend's, forward and backward: the split path's while a graph is captured."""
    captures = Captures(monkeypatch, [captured])
    called = []
    for module, name in [(capture.split_ops, "split_attention"), (capture.fused_ops, "triton_attention")]:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, fn=fn, name=name: called.append(name) or fn(*args))
    inputs = make_inputs(MoDAShape(1, 4, 2, 5, 5, 2, 8), dtype=DTYPE, device=DEVICE)
    assert_matches_reference(inputs, backend=capture.capture_attention)
    assert captures.seen == 1 and called == ["split_attention" if captured else "triton_attention"]
    # the backward is the same backend's: the fused one runs its own, the split path's its own (not spied)
    assert captures.ran == (["_forward"] if captured else ["_run_forward", "_run_backward"])


def test_each_layout_is_prepared_once(monkeypatch):
    """The split path runs uncaptured once a layout (CUDA only; here its body on CPU): again for another depth
    count or stride, not for new values."""
    monkeypatch.setattr(capture, "_PREPARED", set())
    ran = []
    forward = capture.split_ops._forward

    def counted(*args, **kwargs):
        ran.append(args)
        return forward(*args, **kwargs)

    monkeypatch.setattr(capture.split_ops, "_forward", counted)

    def prepare(slots, seed=0, strided=False):
        inputs = make_inputs(MoDAShape(1, 4, 2, 5, 5, slots, 8), dtype=DTYPE, device=DEVICE, seed=seed,
                             depth_entries=True, strided_depth=strided, requires_grad=False)  # fmt: skip
        records = split.ops.Inputs(*inputs.values())
        capture._prepare(records, split.ops.call_options(records.q, records.k, slots, v.causal(), 8**-0.5))
        return len(ran)

    assert [prepare(3), prepare(3, seed=1), prepare(4), prepare(3, strided=True), prepare(0)] == [1, 1, 2, 3, 4]


def test_the_ops_fakes_give_either_kernels_layouts(monkeypatch):
    """Inductor checks each op output's strides against its fake's: out laid out as (B, T, H, D) and lse
    (B, Hq, Tq) from either kernel, for q in a (B, T, H, D) layout, as a model's projection gives it, and
    contiguous, as the rotation gives it."""
    B, Hq, Hk, T, D, L = 1, 4, 2, 5, 16, 3
    q, k, v_ = (torch.randn(B, T, H, D, device=DEVICE, dtype=DTYPE).transpose(1, 2) for H in (Hq, Hk, Hk))
    depth = [torch.randn(B, Hk, T, D, device=DEVICE, dtype=DTYPE) for _ in range(2 * L)]
    opts = split.ops.call_options(q, k, L, v.causal(), D**-0.5)
    for captured, queries in itertools.product((False, True), (q, q.contiguous())):
        inputs = split.ops.Inputs(queries, k, v_, depth[:L], depth[L:])
        monkeypatch.setattr(capture, "capturing", lambda device: captured)
        torch.library.opcheck(torch.ops.moda_flex.capture_forward.default, (*inputs, *opts),
                              test_utils=("test_faketensor",))  # fmt: skip
        out, lse = torch.ops.moda_flex.capture_forward(*inputs, *opts)
        assert out.transpose(1, 2).is_contiguous() and lse.shape == (B, Hq, T) and lse.is_contiguous()
        grads = split.ops.Grads(torch.randn_like(out), None, out, lse)
        torch.library.opcheck(torch.ops.moda_flex.capture_backward.default, (*grads, *inputs, *opts),
                              test_utils=("test_faketensor",))  # fmt: skip


def test_no_second_derivative(monkeypatch):
    """The ops' gradients have no graph: a backward that builds one is refused (autograd runs the ops' own
    backward under dynamo's eager backend)."""
    Captures(monkeypatch, [False, False])
    inputs = make_inputs(MoDAShape(1, 2, 1, 4, 4, 2, 8), dtype=DTYPE, device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(capture.capture_attention, backend="eager", fullgraph=True)
    out, _ = compiled(*inputs.values(), v.causal(), 8**-0.5)
    with pytest.raises(NotImplementedError, match="backend 'auto' has no second derivative"):
        torch.autograd.grad(out.square().sum(), inputs["q"], create_graph=True)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.gpu
def test_a_captured_graph_replays_new_inputs():
    """A real capture, eager and compiled: an eager forward launched while capturing runs the split path, a
    compiled one its traced launches of the fused kernel (no host address in either); the replay gives the
    fused kernel's output (to bf16 rounding) for new inputs copied into the captured ones."""
    shape = MoDAShape(batch=2, q_heads=6, kv_heads=2, q_len=64, kv_len=64, slots=5, head_dim=64)
    inputs = make_inputs(shape, dtype=DTYPE, device=DEVICE, depth_entries=True, requires_grad=False)
    fresh = make_inputs(shape, dtype=DTYPE, device=DEVICE, depth_entries=True, requires_grad=False, seed=1)
    for fn, runs_split in ((capture.capture_attention, True), (_compiled_capture(), False)):
        calls = []
        split_forward = capture.split_ops._forward

        def spied(*args, **kwargs):
            calls.append(torch.cuda.is_current_stream_capturing())
            return split_forward(*args, **kwargs)

        capture.split_ops._forward = spied
        try:
            args = (*inputs.values(), v.causal(), 64**-0.5)
            fn(*args)  # warm-up: the fused kernel
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, _ = fn(*args)
        finally:
            capture.split_ops._forward = split_forward
        assert (True in calls) == runs_split
        for name, t in inputs.items():
            if isinstance(t, list):
                for entry, new in zip(t, fresh[name]):
                    entry.copy_(new)
            else:
                t.copy_(fresh[name])
        graph.replay()
        expected = moda_attention(*fresh.values(), backend="triton")
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
