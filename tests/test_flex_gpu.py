"""FlexAttention backend on CUDA: compiled bf16 against the fp32 reference at the paper's shape."""

import pytest
import torch

from moda_flex import moda_attention
from moda_flex.backends.flex import DESIGNS, function

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("variant", ["causal", "full"])
def test_flex_bf16_matches_fp32_reference_at_paper_shape(variant, design, monkeypatch):
    monkeypatch.setattr(function, "DESIGN", design)
    torch.manual_seed(0)
    B, Hq, Hk, T, L, D = 1, 64, 8, 4096, 64, 64
    dev = "cuda"
    q = torch.randn(B, Hq, T, D, device=dev)
    k = torch.randn(B, Hk, T, D, device=dev)
    v = torch.randn(B, Hk, T, D, device=dev)
    depth_k = torch.randn(B, Hk, T, L, D, device=dev)
    depth_v = torch.randn(B, Hk, T, L, D, device=dev)
    grad_out = torch.randn(B, Hq, T, D, device=dev)

    def run(backend, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v, depth_k, depth_v)]
        out, lse = moda_attention(*inputs, variant=variant, backend=backend, return_lse=True)
        grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
        return out, lse, grads

    out, lse, grads = run("flex", torch.bfloat16)
    ref_out, ref_lse, ref_grads = run("reference", torch.float32)
    assert not out.isnan().any()
    errors = {"out": _rel(out, ref_out), "lse (max abs)": (lse - ref_lse).abs().max().item()}
    errors.update({f"grad {n}": _rel(g, rg) for n, g, rg in zip(("q", "k", "v", "depth_k", "depth_v"), grads, ref_grads)})
    print(f"\nflex ({design}) bf16 vs fp32 reference, {variant}, T={T} G={Hq // Hk} L={L} D={D}:",
          ", ".join(f"{name} {err:.2e}" for name, err in errors.items()))
    assert errors.pop("out") < 2e-2
    assert errors.pop("lse (max abs)") < 5e-2
    for name, err in errors.items():
        assert err < 3e-2, name


def test_compiled_flex_follows_changing_lengths():
    """One compiled flex_attention serves several lengths (dynamic after the first change)."""
    for T in (1000, 1500, 2100, 3000):
        inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in
                  [(1, 8, T, 64), (1, 2, T, 64), (1, 2, T, 64), (1, 2, T, 8, 64), (1, 2, T, 8, 64)]]
        out = moda_attention(*inputs, backend="flex")
        ref = moda_attention(*[t.float() for t in inputs], backend="reference")
        assert _rel(out, ref) < 2e-2, T


@pytest.mark.parametrize("score_name", ["depth_bias", "alibi", "softcap & depth_bias"])
def test_compiled_flex_learns_score_tensors(score_name):
    """Learned score tensors on compiled FlexAttention (read through stacked copies): every gradient, the tensor's too."""
    from moda_flex import alibi, depth_bias, softcap

    torch._dynamo.reset()
    torch.manual_seed(0)
    B, Hq, Hk, T, L, D = 2, 6, 2, 700, 12, 64
    param = torch.rand(Hq, L, device="cuda") if "depth_bias" in score_name else torch.rand(Hq, device="cuda") / 8
    make = {"depth_bias": depth_bias, "alibi": alibi, "softcap & depth_bias": lambda p: softcap(20.0) & depth_bias(p)}
    shapes = [(B, Hq, T, D), (B, Hk, T, D), (B, Hk, T, D), (B, Hk, T, L, D), (B, Hk, T, L, D)]
    inputs = [torch.randn(shape, device="cuda") for shape in shapes]
    grad_out = torch.randn(B, Hq, T, D, device="cuda")

    def run(backend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in inputs] + [param.clone().requires_grad_()]
        out = moda_attention(*leaves[:5], score=make[score_name](leaves[5]), backend=backend)
        return out, torch.autograd.grad(out, leaves, grad_out.to(dtype))

    out, grads = run("flex", torch.bfloat16)
    ref_out, ref_grads = run("reference", torch.float32)
    assert _rel(out, ref_out) < 2e-2
    for name, g, rg in zip(("q", "k", "v", "depth_k", "depth_v", score_name), grads, ref_grads):
        assert _rel(g, rg) < 3e-2, name


# (T, G, L, D, dtype), Hk = 2: lengths 77 to 2049, G 1 to 8, L 0 to 64, D 64 to 256, bf16 then fp16:
# more kinds than dynamo's recompile limit allows one function.
SWEEP = [
    (77, 1, 0, 64, torch.bfloat16), (300, 2, 8, 64, torch.bfloat16), (513, 4, 16, 128, torch.bfloat16),
    (1000, 8, 64, 64, torch.bfloat16), (2049, 8, 32, 64, torch.bfloat16), (129, 3, 1, 256, torch.bfloat16),
    (77, 1, 0, 64, torch.float16), (640, 2, 8, 128, torch.float16), (1025, 4, 64, 64, torch.float16),
    (2049, 8, 16, 64, torch.float16), (300, 6, 2, 256, torch.float16), (1500, 8, 64, 64, torch.float16),
]  # fmt: skip


def _call(T, G, L, D, dtype, seed=0):
    """fwd + bwd of one flex call (B=1, Hk=2) and of the float32 reference: out and the gradients."""
    torch.manual_seed(seed)
    shapes = [(1, 2 * G, T, D), (1, 2, T, D), (1, 2, T, D), (1, 2, T, L, D), (1, 2, T, L, D)]
    inputs = [torch.randn(shape, device="cuda") for shape in shapes]
    grad_out = torch.randn(1, 2 * G, T, D, device="cuda")
    results = []
    for backend, cast in (("flex", dtype), ("reference", torch.float32)):
        leaves = [t.to(cast).requires_grad_() for t in inputs]
        out = moda_attention(*leaves, backend=backend)
        results.append((out, torch.autograd.grad(out, leaves[:3], grad_out.to(cast))))
    return results


def test_a_sweep_of_calls_stays_compiled():
    """A dozen kinds of call in one process, then the call that ran out of memory once dynamo fell back to eager."""
    torch._dynamo.reset()
    for T, G, L, D, dtype in SWEEP:
        (out, grads), (ref, ref_grads) = _call(T, G, L, D, dtype)
        assert _rel(out, ref) < 2e-2, (T, G, L, D, dtype)
        for name, g, rg in zip("qkv", grads, ref_grads):
            assert _rel(g, rg) < 3e-2, (name, T, G, L, D, dtype)
    # Eager FlexAttention would ask for 65 GiB of scores here.
    shapes = [(1, 16, 4096, 64), (1, 2, 4096, 64), (1, 2, 4096, 64), (1, 2, 4096, 64, 64), (1, 2, 4096, 64, 64)]
    leaves = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for shape in shapes]
    torch.cuda.reset_peak_memory_stats()
    moda_attention(*leaves, backend="flex").sum().backward()
    assert torch.cuda.max_memory_allocated() < 8 * 2**30


def test_a_decode_loop_compiles_nothing_per_token():
    """Prefill, then 300 one-token steps over a growing cache: the second half, across a block boundary, compiles nothing.

    The first half may add a graph where a length meets a block boundary for
    the first time.
    """
    from torch._dynamo.utils import counters  # dynamo's own tally of compiled graphs

    torch._dynamo.reset()
    torch.manual_seed(0)
    B, Hq, Hk, D, L, prompt, steps = 1, 32, 4, 64, 16, 256, 300
    k_cache, v_cache = (torch.randn(B, Hk, prompt + steps, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def depth(T):
        return [torch.randn(B, Hk, T, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    with torch.no_grad():
        q = torch.randn(B, Hq, prompt, D, device="cuda", dtype=torch.bfloat16)
        moda_attention(q, k_cache[:, :, :prompt], v_cache[:, :, :prompt], *depth(prompt), backend="flex")
        for step in range(steps):
            kv_len = prompt + step + 1
            args = [torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16), k_cache[:, :, :kv_len],
                    v_cache[:, :, :kv_len], *depth(1)]  # fmt: skip
            out = moda_attention(*args, backend="flex")
            if step == steps // 2:
                graphs = counters["stats"]["unique_graphs"]
            if step % 100 == 0:
                assert _rel(out, moda_attention(*[t.float() for t in args], backend="reference")) < 2e-2, step
    assert counters["stats"]["unique_graphs"] == graphs
