import os, torch, dataclasses
from torch._inductor.utils import run_and_get_code
from gpt import GPT, GPTConfig
cfg = GPTConfig(n_embd=384, n_head=6, n_kv_head=2, n_layer=4, vocab_size=256, block_size=512, depth_kv="attn", norm="post")
model = GPT(cfg).cuda()
idx = torch.randint(0, 256, (4, 512), device="cuda")
compiled = torch.compile(model, fullgraph=True)
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = compiled(idx, idx)
    loss.backward()
_, codes = run_and_get_code(step)
for i, c in enumerate(codes):
    open(os.path.join(os.environ["OUT"], f"code{i}.py"), "w").write(c)
print([len(c) for c in codes])
