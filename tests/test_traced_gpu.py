"""On a GPU: under ``torch.compile`` both kernel backends' kernels are launched from the compiled graph
(moda_flex.backends.launch), and compute MoDA: output, lse and every gradient against the reference.

Skipped without CUDA. Run: ``pytest tests/test_traced_gpu.py``.
"""

import functools

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from moda_flex import moda_attention  # noqa: E402
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs  # noqa: E402


def _compiled(backend):
    """A backend callable for assert_matches_reference: moda_attention(backend=backend) under torch.compile."""
    compiled = torch.compile(functools.partial(moda_attention, backend=backend, return_lse=True), fullgraph=True)

    def run(q, k, v, depth_k, depth_v, variant, scale):
        return compiled(q, k, v, depth_k, depth_v, variant=variant, scale=scale)

    return run


@pytest.mark.parametrize(
    "shape, dtype, variant, entries, strided",
    [
        (MoDAShape(2, 6, 2, 70, 70, 5, 64), torch.bfloat16, "causal", True, False),  # G=3, a model's entries
        (MoDAShape(1, 8, 1, 33, 65, 9, 64), torch.bfloat16, "causal", False, True),  # G=8, Tq < Tk, strided slab
        (MoDAShape(1, 4, 4, 50, 50, 0, 128), torch.float16, "full", True, False),  # G=1, no depth, D=128
        (MoDAShape(2, 12, 3, 40, 40, 3, 32), torch.float16, "causal", True, False),  # G=4, D=32
    ],
)
@pytest.mark.parametrize("backend", ["triton", "split", "auto"])
def test_compiled_calls_match_the_reference(backend, shape, dtype, variant, entries, strided):
    if backend == "split" and shape.q_len != shape.kv_len and variant == "causal":
        pytest.skip("the split path's causal mask needs Tq == Tk")
    torch._dynamo.reset()
    inputs = make_inputs(shape, dtype=dtype, device="cuda", depth_entries=entries, strided_depth=strided, seed=2)
    assert_matches_reference(inputs, backend=_compiled(backend), variant=variant)


_FUSED = ("forward_kernel_flat", "dq_kernel_flat", "dkdv_kernel_flat")
_CAPTURE = ("moda_flex.capture_forward.default", "moda_flex.capture_backward.default")


@pytest.mark.parametrize(
    "backend, mode, kernels, opaque",
    [
        ("triton", "default", _FUSED,
         ("moda_flex.triton_forward.default", "moda_flex.triton_backward.default")),
        ("split", "default", ("_depth_forward_token_kernel_flat", "_depth_backward_token_kernel_flat"),
         ("moda_flex.split_forward.default", "moda_flex.split_backward.default")),
        ("auto", "default", _FUSED, _CAPTURE),
        ("auto", "reduce-overhead", _CAPTURE, _FUSED),  # a CUDA graph: the ops that choose at capture
    ],
)  # fmt: skip
def test_a_compiled_call_launches_the_kernels_from_its_graph(backend, mode, kernels, opaque):
    """The generated code launches the flat kernels itself and does not call the eager ops (the kernels of
    both backends take the entries as they lie); ``auto`` does so unless the graph runs as a
    CUDA graph, where it calls its opaque ops."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    inputs = make_inputs(MoDAShape(2, 6, 2, 64, 64, 4, 64), dtype=torch.bfloat16, device="cuda", depth_entries=True)
    leaves = [inputs["q"], inputs["k"], inputs["v"], *inputs["depth_k"], *inputs["depth_v"]]

    @torch.compile(fullgraph=True, mode=mode)
    def loss(q, k, v, depth_k, depth_v):
        return moda_attention(q, k, v, depth_k, depth_v, backend=backend).float().square().sum()

    def step():
        return torch.autograd.grad(loss(*leaves[:3], inputs["depth_k"], inputs["depth_v"]), leaves)

    _, code = run_and_get_code(step)
    code = "\n".join(code)
    for kernel in kernels:
        assert kernel in code, kernel
    assert not any(op in code for op in opaque)


def test_a_compiled_split_call_adds_only_its_own_kernels_to_sdpas():
    """Compiled, a split call (forward and backward) launches what the same step on SDPA launches plus its
    two depth kernels and the sum of dq's two parts, the vendor's and the depth kernel's (in a model it fuses
    into the rotation's backward; here the graph returns dq). Nothing copies the lse a kernel writes to and
    back (inductor does so for a view that a traced kernel writes), nothing fills an unread seed (inductor
    lowers a 0-dim ``empty`` as a fill)."""
    from torch._inductor.utils import run_and_get_code

    shape = MoDAShape(2, 6, 2, 64, 64, 4, 64)
    inputs = make_inputs(shape, dtype=torch.bfloat16, device="cuda", depth_entries=True)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    entries = [t for pair in zip(inputs["depth_k"], inputs["depth_v"]) for t in pair]

    def launches(loss, *leaves) -> int:
        torch._dynamo.reset()
        compiled = torch.compile(loss, fullgraph=True)
        _, code = run_and_get_code(lambda: torch.autograd.grad(compiled(*leaves), leaves))
        return "\n".join(code).count(".run(")

    def sdpa(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.float().square().sum()

    def alone(q, k, v, *entries):
        return moda_attention(q, k, v, list(entries[::2]), list(entries[1::2]), backend="split").float().square().sum()

    assert launches(alone, q, k, v, *entries) == launches(sdpa, q, k, v) + 3


def _compiled_model_matches_eager(**config) -> str:
    """A small GPT (``config`` on top of a 64-token, bf16-autocast one) compiled with ``fullgraph=True``: its
    loss and every gradient against eager's; returns the generated code."""
    from gpt import GPT, GPTConfig
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(n_kv_head=2, vocab_size=256, block_size=64, depth_kv="attn+ffn", **config)
    model = GPT(config).cuda()
    idx = torch.randint(0, config.vocab_size, (4, 64), device="cuda")

    def step(m):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = m(idx, idx)
        loss.backward()
        return loss.detach().float(), {n.removeprefix("_orig_mod."): p.grad.float() for n, p in m.named_parameters()}

    loss, grads = step(model)
    (compiled_loss, compiled_grads), code = run_and_get_code(step, torch.compile(model, fullgraph=True))
    torch.testing.assert_close(compiled_loss, loss, rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        assert (compiled_grads[name] - grad).norm() / grad.norm().clamp_min(1e-6) < 5e-2, name
    return "\n".join(code)


def test_a_checkpointed_model_compiles_and_matches_eager():
    """The traced ops inside a model's checkpointed blocks: one compiled graph, eager's gradients."""
    _compiled_model_matches_eager(n_embd=128, n_head=4, n_layer=3, backend="triton", checkpoint=True)
