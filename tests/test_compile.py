"""torch.compile: the example GPT and the triton op trace with fullgraph=True and match eager.

Most cases compile with ``backend="aot_eager"`` (the graph capture and
autograd that inductor also sees, without its slow codegen); one runs inductor.
"""

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from moda_flex import DepthStream, depth_bias, moda_attention, softcap
from moda_flex.nn import MoDAAttention
from moda_flex.testing import MoDAShape, make_inputs

from gpt import GPT, GPTConfig

from fused import TRITON, TRITON_DEVICE, needs_interpreter

CONFIG = GPTConfig(n_embd=32, n_head=4, n_kv_head=2, n_layer=3, vocab_size=64, block_size=16)
# Blocks of the depth_kv="attn+ffn" models: the second reads the first's two entries. A third block would add
# a third to every trace, and an inductor compile of three takes about a minute on a CPU without a cache.
TWO_BLOCKS = 2


def _model(**changes) -> GPT:
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, **changes))
    for p in model.parameters():  # away from the identity init of the norms
        p.data.add_(0.05 * torch.randn_like(p))
    return model


def _loss_and_grads(model, idx):
    model.zero_grad(set_to_none=True)
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters()}


def _assert_same_training_step(model, compiled, idx, tol):
    loss, grads = _loss_and_grads(model, idx)
    compiled_loss, compiled_grads = _loss_and_grads(compiled, idx)
    torch.testing.assert_close(compiled_loss, loss, rtol=tol, atol=tol)
    assert compiled_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=tol, atol=tol, msg=lambda m: f"grad of {name}: {m}")


# each norm with FFN entries (whose input the norm changes), one each without
@pytest.mark.parametrize("depth_kv, norm", [("none", "pre"), ("attn", "post"), ("attn+ffn", "pre"), ("attn+ffn", "post")])
def test_compiled_gpt_matches_eager(depth_kv, norm):
    torch._dynamo.reset()
    model = _model(depth_kv=depth_kv, norm=norm).double()
    idx = torch.randint(0, CONFIG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _assert_same_training_step(model, compiled, idx, tol=1e-10)


def test_inductor_compiled_gpt_matches_eager():
    torch._dynamo.reset()
    model = _model(depth_kv="attn+ffn", norm="post", n_layer=TWO_BLOCKS)
    idx = torch.randint(0, CONFIG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True)
    _assert_same_training_step(model, compiled, idx, tol=2e-5)


def test_compiled_checkpointed_gpt_matches_plain():
    torch._dynamo.reset()
    plain = _model(depth_kv="attn+ffn", norm="pre", n_layer=TWO_BLOCKS).double()
    checkpointed = _model(depth_kv="attn+ffn", norm="pre", n_layer=TWO_BLOCKS, checkpoint=True).double()
    checkpointed.load_state_dict(plain.state_dict())
    idx = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    _assert_same_training_step(plain, torch.compile(checkpointed, fullgraph=True, backend="aot_eager"), idx, 1e-10)


def test_compiled_decoding_matches_the_full_forward():
    torch._dynamo.reset()
    model = _model(depth_kv="attn+ffn", norm="post", n_layer=TWO_BLOCKS).double().eval()
    idx = torch.randint(0, CONFIG.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = model(idx)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
        # a slot to spare: a full cache's last step (one free slot, a size-1 dimension) would compile a third
        # graph; decoding into a cache's last slot is test_nn.py's and test_examples.py's, eagerly
        caches = [model_cache for model_cache in _caches(model, idx.shape[1] + 1)]
        pieces = [compiled(idx[:, :4], caches=caches)[0]]
        for t in range(4, idx.shape[1]):
            pieces.append(compiled(idx[:, t : t + 1], caches=caches)[0])
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)


def _caches(model, length):
    from moda_flex.nn import KVCache

    return [KVCache(length) for _ in model.blocks]


@needs_interpreter
def test_compiled_triton_op_reads_depth_entries():
    """The custom op takes depth as a list of entries under fullgraph compile, gradients included."""
    torch._dynamo.reset()
    shape = MoDAShape(batch=1, q_heads=4, kv_heads=2, q_len=9, kv_len=9, slots=3, head_dim=16)
    inputs = make_inputs(shape, depth_entries=True)

    def layer(q, k, v, depth_k, depth_v):
        stream = DepthStream()
        for dk, dv in zip(depth_k, depth_v):
            stream = stream.append(dk * 1.5, dv)
        depth_k, depth_v = stream.read()
        return moda_attention(q, k, v, depth_k, depth_v, backend="triton").sin().sum()

    leaves = [inputs["q"], inputs["k"], inputs["v"], *inputs["depth_k"], *inputs["depth_v"]]
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["depth_k"], inputs["depth_v"])
    eager = layer(*args)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(*args)
    compiled_grads = torch.autograd.grad(compiled, leaves)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compiled_layer_learns_a_depth_bias(backend):
    """A MoDAAttention with a learned depth bias and a softcap traces with fullgraph; its bias gets the same gradient."""
    if backend == "triton" and TRITON is None:
        pytest.skip("the triton backend cannot run here")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    torch._dynamo.reset()
    torch.manual_seed(0)
    bias = torch.nn.Parameter(0.1 * torch.randn(4, 2, device=device))  # (Hq, L)
    layer = MoDAAttention(32, 4, 2, score=depth_bias(bias) & softcap(3.0), backend=backend).to(device)
    x = torch.randn(1, 6, 32, device=device)
    depth = DepthStream(3)  # two entries read, one the layer appends
    for _ in range(2):
        depth = depth.append(torch.randn(1, 2, 6, 8, device=device), torch.randn(1, 2, 6, 8, device=device))

    def loss(x):
        return layer(x, depth)[0].square().sum()

    eager = torch.autograd.grad(loss(x), [bias, layer.q_proj.weight])
    compiled = torch.autograd.grad(
        torch.compile(loss, fullgraph=True, backend="aot_eager")(x), [bias, layer.q_proj.weight]
    )
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)
    assert eager[0].abs().sum() > 0


def test_flex_call_with_a_score_traces_with_fullgraph():
    """flex's per-call score checks and its first-order guard trace with Dynamo (as in a compiled model on CUDA).

    On CPU the compiled FlexAttention runs inference only, hence no_grad.
    """
    from moda_flex import alibi, causal
    from moda_flex.backends.flex.function import flex_moda
    from moda_flex.backends.reference import reference_attention

    torch._dynamo.reset()
    inputs = make_inputs(MoDAShape(1, 4, 2, 6, 9, 3, 8))
    variant = causal() & alibi(torch.rand(4)) & depth_bias(torch.rand(4, 3))

    def call(*tensors):
        return flex_moda(*tensors, variant, 8**-0.5, compiled=True, return_lse=False)

    with torch.no_grad():
        out = torch.compile(call, fullgraph=True, backend="eager")(*inputs.values())
        want, _ = reference_attention(*inputs.values(), variant, 8**-0.5)
    torch.testing.assert_close(out, want)


@needs_interpreter
def test_a_split_model_compiles_in_a_process_that_never_imported_the_fused_kernels():
    """``backend="split"`` alone: the first read of a stream asks which kernel a backend is, and reading the
    stream into its gradient buffer then imports the fused kernels' module. Asking by which modules were
    loaded made dynamo guard on that one's absence, which failed in the same frame ("Guard failed on the same
    frame it was created")."""
    code = """
import sys
import torch
from moda_flex import DepthStream
from moda_flex.nn import Block, BlockConfig

torch.manual_seed(0)
config = BlockConfig(n_embd=32, n_head=4, n_kv_head=2, depth_kv="attn+ffn", backend="split")
blocks = torch.nn.ModuleList(Block(config) for _ in range(2))
x = torch.randn(1, 3, 32)

def run(x):
    depth = DepthStream()
    for block in blocks:
        x, depth = block(x, depth)
    return x

assert "moda_flex.backends.triton" not in sys.modules
compiled = torch.compile(run, fullgraph=True, backend="aot_eager")(x)
torch.testing.assert_close(compiled, run(x))
"""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
