"""A MoDA GPT trains under every torch.compile mode on a GPU, with eager's loss and gradients.

``mode="reduce-overhead"`` replays the step as CUDA graphs: every kernel of a
MoDA layer must read its tensors through the addresses the graph captured.
"""

import dataclasses

import pytest
import torch

from gpt import GPT, GPTConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = GPTConfig(n_embd=128, n_head=4, n_kv_head=2, n_layer=3, vocab_size=256, block_size=64)


def _step(model, idx):
    """Loss and gradients of one bf16-autocast step."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    return loss.detach().float(), {n.removeprefix("_orig_mod."): p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("depth_kv", ["attn", "attn+ffn"])
# triton and split: what auto takes for short and long calls; auto: at these short calls, the fused kernel in the
# warm-up and the split path in the captured graph (moda_flex.backends.capture)
@pytest.mark.parametrize("backend", ["triton", "split", "auto"])
def test_compiled_modes_match_eager(backend, depth_kv, mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, depth_kv=depth_kv, backend=backend)).cuda()
    idx = torch.randint(0, CONFIG.vocab_size, (4, 64), device="cuda")
    loss, grads = _step(model, idx)
    compiled = torch.compile(model, mode=None if mode == "default" else mode, fullgraph=True)
    for _ in range(3):  # CUDA graphs: warm-up, record, then replays
        torch.compiler.cudagraph_mark_step_begin()
        compiled_loss, compiled_grads = _step(compiled, idx)
    torch.testing.assert_close(compiled_loss, loss, rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        scale = grad.norm().clamp_min(1e-6)
        assert (compiled_grads[name] - grad).norm() / scale < 5e-2, name
