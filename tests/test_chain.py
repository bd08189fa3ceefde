"""A depth stream's one gradient buffer (``moda_flex.backends.chain``): each layer's kernel adds into it.

Every gradient must equal the one autograd gives when each entry is a leaf
of its own and sums its readers' gradients (the plain path, which any
backend without the buffer takes): eagerly, compiled, checkpointed, and for
a stream that two branches read. On CPU the kernels run under Triton's
interpreter in float32, and the two paths agree to float32's rounding; on
CUDA they run in bfloat16, where the two paths round apart (the buffer adds
in float32 and rounds once, autograd rounds each sum), so each is measured
against float32's ``reference`` and the buffer's error may be at most about
the plain path's.
"""

import copy
import functools
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from moda_flex import DepthStream, backends, moda_attention  # noqa: E402
from moda_flex.backends import capture, chain  # noqa: E402
from moda_flex.backends.split import ops as split_ops  # noqa: E402
from moda_flex.nn import Block, BlockConfig  # noqa: E402
from moda_flex.testing import MoDAShape, make_inputs, moda_shapes  # noqa: E402

from budget import examples  # noqa: E402
from test_capture import PAIRING_IDS, PAIRINGS, Captures  # noqa: E402
from test_split import _split_variants  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOLERANCE = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


class IntoSpy:
    """Counts the split path's eager backward passes that put the depth gradients into a stream's buffer (not
    a traced op's fresh one), those of them that write it rather than add to it, and those given an lse
    gradient."""

    def __init__(self, monkeypatch):
        self.calls, self.writes, self.lse_grads, backward = 0, 0, 0, split_ops._backward

        def spied(grad_out, grad_lse, *args, into=None, add=False, route=split_ops.EAGER, **kwargs):
            self.calls += into is not None and route is split_ops.EAGER
            self.writes += into is not None and route is split_ops.EAGER and not add
            self.lse_grads += grad_lse is not None
            return backward(grad_out, grad_lse, *args, into=into, add=add, route=route, **kwargs)

        monkeypatch.setattr(split_ops, "_backward", spied)


def _plain(monkeypatch):
    """Every stream read as entries of their own, each summing its own gradients (no buffer), whatever it asks."""
    monkeypatch.setattr(backends, "stream_reader", lambda run: None)


def _blocks(depth_kv="attn+ffn", n_layer=3, backend="split", n_head=4):
    torch.manual_seed(0)
    config = BlockConfig(n_embd=32, n_head=n_head, n_kv_head=2, depth_kv=depth_kv, norm="post", backend=backend)
    return torch.nn.ModuleList(Block(config, ffn_depth=i < n_layer - 1) for i in range(n_layer)).to(DEVICE, DTYPE)


def _loss(blocks, x, readout, checkpointed=False, gradient_buffer=True, readers=None):
    """A loss every output element weighs into differently (with post-norm blocks, ``x.square().mean()`` would
    be 1 whatever the weights, and every gradient about zero)."""
    depth = DepthStream(gradient_buffer=gradient_buffer, readers=readers)
    for block in blocks:
        x, depth = checkpoint(block, x, depth, use_reentrant=False) if checkpointed else block(x, depth)
    return (x * readout).sum()


def _gradients(blocks, x, run=_loss, **kwargs):
    x = x.detach().requires_grad_()
    readout = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x)
    loss = run(blocks, x, readout, **kwargs)
    return torch.autograd.grad(loss, [x, *blocks.parameters()])


def _assert_same(got, expected, truth):
    """``got`` (the buffer's) equals ``expected`` (the plain path's): to float32's rounding, or in bfloat16 no
    further from ``truth`` (float32's reference, a thunk called only then) than twice the plain path's error."""
    assert len(got) == len(expected)
    if DTYPE == torch.float32:
        for i, (g, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(g, e, **TOLERANCE, msg=lambda m: f"gradient {i}: {m}")
        return
    for i, (g, e, t) in enumerate(zip(got, expected, truth(), strict=True)):
        error, plain_error = ((a.float() - t).abs().max().item() for a in (g, e))
        assert error <= 2 * plain_error + 1e-3 * t.abs().max().item(), f"gradient {i}: {error} vs plain {plain_error}"


def _reference_blocks(blocks):
    """A float32 copy of ``blocks`` (the same rounded weights) whose attentions run ``reference``."""
    reference = copy.deepcopy(blocks).float()
    for module in reference.modules():
        if hasattr(module, "backend"):
            module.backend = "reference"
    return reference


def _truth(blocks, x, **kwargs):
    return lambda: _gradients(_reference_blocks(blocks), x.float(), **kwargs)


def _input(T=5):
    return torch.randn(2, T, 32, device=DEVICE, dtype=DTYPE, generator=torch.Generator(DEVICE).manual_seed(1))


# compiled, FFN entries too: they include the attention's entries, and each compile costs seconds on CPU; the
# compiled stream is told its readers, as a model's is (compiled without, test_the_capture_kernels_add_into_the_buffer)
@pytest.mark.parametrize("depth_kv, compiled", [("attn", False), ("attn+ffn", False), ("attn+ffn", True)],
                         ids=["attn-eager", "attn+ffn-eager", "attn+ffn-aot_eager"])
def test_a_model_gets_the_gradients_of_its_entries_summed_one_by_one(depth_kv, compiled, monkeypatch):
    blocks, x = _blocks(depth_kv), _input()
    run = torch.compile(_loss, backend="aot_eager", fullgraph=True) if compiled else _loss
    torch._dynamo.reset()
    added = IntoSpy(monkeypatch)
    got = _gradients(blocks, x, run, readers=len(blocks) if compiled else None)
    assert added.calls == len(blocks) - 1  # every attention after the first reads the stream through its buffer
    # the last reader writes the buffer: eagerly no gradient reaches its path; compiled it hands on no path, whose
    # gradient would be zeros to add
    assert added.writes == 1
    assert added.lse_grads == 0  # no lse was asked for: no zero gradient of it (compiled) costs an extra pass
    _plain(monkeypatch)  # eagerly: the plain path compiled is test_compile.py's
    _assert_same(got, _gradients(blocks, x), _truth(blocks, x))


class EntrySums(TorchDispatchMode):
    """Counts the additions of (B, Hk, T, D) tensors, the depth entries' shape, that a backward runs."""

    def __init__(self, entry_shape):
        super().__init__()
        self.entry_shape, self.count = entry_shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor) and args[0].shape == self.entry_shape
        return func(*args, **(kwargs or {}))


def test_no_entry_sums_its_readers_gradients_one_by_one(monkeypatch):
    """Plain, each entry's k and v add up the gradients of the R layers that read it: R - 1 additions each;
    through the buffer, none of them (the layers' kernels added into it)."""
    n_layer = 4
    blocks, x = _blocks(n_layer=n_layer), _input()
    # block i appends entries 2i (attention) and 2i + 1 (FFN, none in the last); block i's attention reads 2i
    entries = 2 * n_layer - 1
    readers = [sum(1 for i in range(n_layer) if 2 * i > j) for j in range(entries)]
    entry_shape = (2, 2, x.shape[1], 8)  # (B, Hk, T, D)
    counts = []
    for plain in (False, True):
        if plain:
            _plain(monkeypatch)
        loss = _loss(blocks, x.detach().requires_grad_(), torch.ones_like(x))
        with EntrySums(entry_shape) as sums:
            loss.backward()
        counts.append(sums.count)
    chained, plain = counts
    assert plain - chained == 2 * sum(r - 1 for r in readers if r > 1)


def test_checkpointed_blocks_get_the_same_gradients(monkeypatch):
    blocks, x = _blocks(), _input()
    got = _gradients(blocks, x, checkpointed=True)
    _plain(monkeypatch)
    _assert_same(got, _gradients(blocks, x), _truth(blocks, x))


def test_a_stream_two_branches_read_sums_both_buffers(monkeypatch):
    """Two attentions read one stream and append apart: autograd adds their buffers where the paths meet. One
    returns its lse, whose gradient reaches q, k, v and the entries too."""
    shape = MoDAShape(1, 4, 2, 5, 5, 0, 8)
    inputs = make_inputs(shape, device=DEVICE, dtype=DTYPE)
    q1, k, v = inputs["q"], inputs["k"], inputs["v"]
    q2 = torch.randn_like(q1)
    leaves = [t.detach().requires_grad_() for t in (q1, q2, k, v)]

    def loss(q1, q2, k, v, backend="split"):
        stream = DepthStream(gradient_buffer=True).append(k.tanh(), v.sin()).append(k.cos(), v * 2)
        a, left = stream.attend(q1, k, v, backend=backend)
        (b, lse), right = stream.attend(q2, k, v, backend=backend, return_lse=True)
        c, _ = left.append(k * 3, v).attend(q2.flip(2), k, v, backend=backend)
        return (a * b).sum() + c.square().sum() + right.keys[0].sum() + lse.sin().sum()

    def truth():
        wide = [t.detach().float().requires_grad_() for t in leaves]
        return torch.autograd.grad(loss(*wide, backend="reference"), wide)

    got = torch.autograd.grad(loss(*leaves), leaves)
    _plain(monkeypatch)
    _assert_same(got, torch.autograd.grad(loss(*leaves), leaves), truth)


# A pairing is what each launch chooses at run time, a compiled graph the same ops whatever they choose: the
# mixed pairings eagerly, each kernel alone also compiled.
@pytest.mark.parametrize("states, compiled", [
    *((states, compiled) for states in PAIRINGS for compiled in (False, True) if len(set(states)) == 1),
    *((states, False) for states in PAIRINGS if len(set(states)) == 2),
], ids=lambda arg: PAIRING_IDS[PAIRINGS.index(arg)] if isinstance(arg, tuple) else ("aot_eager" if arg else "eager"))
def test_the_capture_kernels_add_into_the_buffer(states, compiled, monkeypatch):
    """``auto``'s kernels for a model (fused, or split while captured): each pairing adds alike."""
    blocks, x = _blocks(backend="auto"), _input()
    monkeypatch.setattr(backends, "_auto", lambda *args: capture.capture_attention)
    run = torch.compile(_loss, backend="aot_eager", fullgraph=True) if compiled else _loss
    torch._dynamo.reset()
    Captures(monkeypatch, states * 2 * len(blocks))  # each call's forward launch, then its backward's; two runs
    got = _gradients(blocks, x, run)
    _plain(monkeypatch)  # eagerly: the plain path compiled is test_compile.py's
    _assert_same(got, _gradients(blocks, x), _truth(blocks, x))


@pytest.mark.parametrize("kernel", ["split", "capture"])
def test_the_traced_ops_sum_the_buffer_out_of_place(kernel, monkeypatch):
    """Compiled on CUDA a call takes the traced ops, whose backward writes the later readers' buffer plus its
    depth gradients into a fresh one: the same gradients (run here eagerly, the traced ops' bodies as they
    are)."""
    blocks, x = _blocks(backend=kernel if kernel == "split" else "auto"), _input()
    monkeypatch.setattr(backends, "_auto", lambda *args: capture.capture_attention)
    monkeypatch.setattr(chain, "_traced", lambda *tensors: True)
    traced, fused, split = [], capture._fused_backward, split_ops.backward_add

    def fused_spy(*args, run_backward=None, **kwargs):
        traced.append(run_backward is not None)
        return fused(*args, run_backward=run_backward, **kwargs)

    def split_spy(*args, route=split_ops.EAGER):
        traced.append(route is split_ops.TRACED)
        return split(*args, route=route)

    monkeypatch.setattr(capture, "_fused_backward", fused_spy)
    monkeypatch.setattr(split_ops, "backward_add", split_spy)
    added = IntoSpy(monkeypatch)
    got = _gradients(blocks, x)
    assert added.calls == 0  # no backward added into the buffer in place
    assert traced == [True] * (len(blocks) - 1)  # each call that reads the stream: the traced body
    _plain(monkeypatch)
    _assert_same(got, _gradients(blocks, x), _truth(blocks, x))


@settings(max_examples=examples(6))  # the buffer ops' arithmetic; the kernels' against reference: test_split, test_triton
@given(
    shape=moda_shapes(max_kv_len=20, max_slots=9, max_kv_heads=2, head_dims=(8, 16)),
    kernel=st.sampled_from(["split", "fused"]),
    with_lse_grad=st.booleans(),
    data=st.data(),
)
def test_the_depth_kernels_add_to_or_write_the_buffer(shape, kernel, with_lse_grad, data):
    """``split_backward_into``, and ``capture_backward_into`` on the fused kernel: the buffer gets exactly what
    the backward op returns, added or written, for odd lengths, G of 1..8 (both split designs), L of 0..9,
    Tq < Tk under full, an lse gradient or none; slots the call does not reach keep what they held."""
    variant = data.draw(_split_variants(shape))
    inputs = make_inputs(shape, device=DEVICE, dtype=DTYPE, depth_entries=True)
    L = shape.slots
    opts = split_ops.call_options(inputs["q"], inputs["k"], L, variant, 0.25)
    records = split_ops.Inputs(inputs["q"], inputs["k"], inputs["v"], list(inputs["depth_k"]),
                               list(inputs["depth_v"]))  # fmt: skip
    name = "split" if kernel == "split" else "capture"
    forward, backward, into = [getattr(torch.ops.moda_flex, f"{name}_{op}") for op in ("forward", "backward",
                                                                                          "backward_into")]  # fmt: skip
    if name == "capture":  # its backward returns dq in two parts
        backward = functools.partial(_dq_summed, backward)
    with mock.patch.object(capture, "capturing", lambda device: False):  # capture's ops: the fused kernel
        _check_into(shape, records, opts, forward, backward, into, with_lse_grad)


def _dq_summed(op, *args):
    return capture.summed_dq(op(*args))


def _check_into(shape, records, opts, forward_op, backward_op, into_op, with_lse_grad):
    out, lse = forward_op(*records, *opts)
    grad_lse = torch.randn_like(lse) if with_lse_grad else None
    grads = split_ops.Grads(torch.randn_like(out), grad_lse, out, lse)
    dq, dk, dv, ddk, ddv = backward_op(*grads, *records, *opts)
    B, Hk, Tq, L, D = shape.batch, shape.kv_heads, shape.q_len, shape.slots, shape.head_dim
    held = torch.randn(2, B, Hk, Tq, L + 2, D, device=DEVICE, dtype=DTYPE)  # two slots more than the call reads
    for add in (True, False):
        buffer = held.clone()
        got = into_op(*grads, *records, *opts, buffer[..., :L, :], add)
        for g, e in zip(got, (dq, dk, dv)):
            torch.testing.assert_close(g, e, atol=0, rtol=0)
        expected = torch.stack([ddk, ddv]) + (held[..., :L, :] if add else 0)
        torch.testing.assert_close(buffer[..., :L, :], expected, **TOLERANCE)
        torch.testing.assert_close(buffer[..., L:, :], held[..., L:, :], atol=0, rtol=0)


def test_a_stream_carries_a_path_only_where_its_entries_get_gradients_through_it():
    k, v = torch.randn(2, 1, 2, 3, 4).unbind(0)
    assert DepthStream().append(k, v).gradients is None  # no entry needs a gradient
    k.requires_grad_()
    assert DepthStream(gradient_buffer=False).append(k, v).gradients is None
    stream = DepthStream().append(k, v).append(k * 2, v)  # eagerly, by default
    assert stream.gradients.shape == (2, 1, 2, 3, 2, 4)
    assert stream.gradients.untyped_storage().nbytes() == k.element_size()  # one element, expanded
    with torch.no_grad():
        assert stream.append(k, v).gradients is None
    before = DepthStream().append(k.detach(), v)  # an entry with no path: the path could not hand it back
    assert before.append(k, v).gradients is None


@pytest.mark.parametrize("gradient_buffer, eager, compiled", [(None, True, False), (True, True, True),
                                                              (False, False, False)])  # fmt: skip
def test_a_compiled_stream_buffers_gradients_only_when_asked(gradient_buffer, eager, compiled):
    """By default a stream compiled off CUDA (no traced ops) has its entries sum their own gradients; on CUDA
    test_traced_gpu.py checks the buffer by default."""
    k, v = torch.randn(2, 1, 2, 3, 4, requires_grad=True).unbind(0)

    def has_path(k, v):
        return k.new_tensor(DepthStream(gradient_buffer=gradient_buffer).append(k, v).gradients is not None)

    assert bool(has_path(k, v)) is eager
    torch._dynamo.reset()
    assert bool(torch.compile(has_path, backend="eager", fullgraph=True)(k, v)) is compiled


def test_gradient_buffer_takes_a_bool_or_none():
    with pytest.raises(ValueError, match="gradient_buffer must be True, False or None"):
        DepthStream(gradient_buffer="yes")


def test_a_stream_read_without_gradients_passes_its_path_through():
    shape = MoDAShape(1, 4, 2, 5, 5, 0, 8)
    q, k, v = (make_inputs(shape, device=DEVICE, dtype=DTYPE)[name] for name in ("q", "k", "v"))
    stream = DepthStream().append(k.requires_grad_(), v)
    with torch.no_grad():
        out, same = stream.attend(q, k, v, backend="split")
    assert same.gradients is stream.gradients and same.keys == stream.keys and same.reads == 1
    torch.testing.assert_close(out, moda_attention(q, k, v, *stream.read(), backend="split"))
