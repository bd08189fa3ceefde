"""A small GPT built from moda_flex.nn blocks: the baseline and MoDA differ in one config field.

    config.depth_kv = "none"       a plain GQA transformer (the baseline)
    config.depth_kv = "attn"       attention layers also write their K/V as depth
    config.depth_kv = "attn+ffn"   FFN layers write a projected K/V too (MoDA's default)

The forward pass starts an empty DepthStream and threads it through the
blocks: each block's attention reads what the blocks below wrote for the same
token, and the block returns the stream with its own entries appended.

Run as a script, it builds a model from flags (or loads a checkpoint written
by train_gpt.py), prints its size and samples from it:

    python examples/gpt.py                                       # an untrained MoDA GPT: its size, what it samples
    python examples/gpt.py --depth-kv none --n-layer 12          # the baseline of that shape
    python examples/gpt.py --ckpt out/pydoc-4x128/moda-pre.pt --prompt "class " --tokens 300
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import cli

from moda_flex.nn import DEPTH_KV, NORMS, Block, BlockConfig, DepthStream, KVCache, RotaryEmbedding


@dataclasses.dataclass
class GPTConfig(BlockConfig):
    """:class:`moda_flex.nn.BlockConfig` plus the model's vocabulary, context, depth and checkpointing.

    Attributes:
        checkpoint: recompute each block's activations in the backward pass
            (``torch.utils.checkpoint``) instead of storing them.
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 6
    checkpoint: bool = False

    @property
    def depth_slots(self) -> int:
        """Depth entries one forward pass writes: every block's, less the last FFN's (nothing reads it)."""
        return max(0, self.n_layer * self.depth_writes - (self.depth_kv == "attn+ffn"))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = None if config.rope else nn.Embedding(config.block_size, config.n_embd)
        # one table of the rotation's cos and sin for every layer (positions past block_size are computed)
        self.rotary = (RotaryEmbedding(config.head_dim, config.rope_base, config.block_size)
                       if config.rope else None)  # fmt: skip
        self.blocks = nn.ModuleList(
            [Block(config, ffn_depth=i < config.n_layer - 1, rotary=self.rotary) for i in range(config.n_layer)]
        )
        self.norm_f = nn.RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        # Residual-branch outputs get a smaller init, scaled by depth (GPT-2).
        for name, p in self.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: Tensor, targets: Optional[Tensor] = None, caches: Optional[list[KVCache]] = None
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Logits for every position, and the loss if ``targets`` is given.

        Args:
            idx: (B, T) token ids; with ``caches`` they continue the cached tokens.
            targets: (B, T) next-token ids, or None.
            caches: one :class:`KVCache` per block for decoding, or None.

        Returns:
            logits (B, T, vocab_size) and the mean cross-entropy (or None).
        """
        B, T = idx.shape
        start = caches[0].length if caches is not None else 0
        if start + T > self.config.block_size and self.wpe is not None:
            raise ValueError(f"positions up to {start + T} exceed block_size {self.config.block_size}")
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + T, device=idx.device))
        depth = DepthStream(capacity=self.config.depth_slots) if self.config.depth_writes else None
        for i, block in enumerate(self.blocks):
            cache = caches[i] if caches is not None else None
            if self.config.checkpoint and self.training and cache is None:
                x, depth = checkpoint(block, x, depth, use_reentrant=False)
            else:
                x, depth = block(x, depth, cache)
        logits = self.lm_head(self.norm_f(x))  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(B * T))
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Sample ``max_new_tokens`` tokens after (B, T) ``idx``; returns (B, T + max_new_tokens).

        With ``use_cache`` the prompt is run once and each new token attends to
        the cached sequence K/V of every layer plus its own depth entries; without
        it every step re-runs the whole sequence. Both give the same tokens.
        """
        caches = [KVCache(idx.shape[1] + max_new_tokens) for _ in self.blocks] if use_cache else None
        new = idx
        for _ in range(max_new_tokens):
            logits, _ = self(new if use_cache else idx, caches=caches)
            logits = logits[:, -1, :] / temperature  # (B, vocab_size)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            new = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat([idx, new], dim=1)
        return idx


def load_checkpoint(path: str, device="cpu", backend: Optional[str] = None) -> GPT:
    """A GPT in eval mode from a checkpoint written by train_gpt.py (read with ``weights_only=True``).

    ``backend`` replaces the one it was trained with (a model trained on a GPU's
    ``triton`` runs on a CPU with ``auto``); None keeps it.
    """
    checkpoint = torch.load(path, map_location=device, weights_only=True)
    config = checkpoint["config"] if backend is None else {**checkpoint["config"], "backend": backend}
    model = GPT(GPTConfig(**config)).to(device)
    model.load_state_dict(checkpoint["model"])
    return model.eval()


def printable(data: bytes) -> str:
    """Sampled bytes as text a terminal can show: invalid UTF-8 and control characters become ``?`` and ``·``."""
    text = data.decode("utf-8", errors="replace").replace("\ufffd", "?")
    return "".join(c if c.isprintable() or c in "\n\t" else "·" for c in text)


def describe(model: GPT) -> str:
    """One line: the shape, the depth K/V and the parameter count of ``model``."""
    c = model.config
    depth = f"{c.depth_slots} depth entries per token" if c.depth_kv != "none" else "no depth K/V (baseline)"
    return (
        f"GPT: {c.n_layer} layers, width {c.n_embd}, {c.n_head} query / {c.n_kv_head} KV heads, norm={c.norm}, "
        f"depth_kv={c.depth_kv} ({depth}), context {c.block_size}: {model.num_params():,} parameters"
    )


def main(argv=None) -> str:
    """Build or load a model, print its size and a sample; returns the sample."""
    defaults = GPTConfig()
    p = cli.parser(__doc__)
    p.add_argument("--ckpt", help="a checkpoint written by train_gpt.py (default: a new, untrained model "
                   "from the shape flags, which a checkpoint overrides; --backend applies to both)")  # fmt: skip
    cli.add_model_shape(p, n_layer=defaults.n_layer, n_embd=defaults.n_embd, n_head=defaults.n_head,
                        n_kv_head=defaults.n_kv_head, block_size=defaults.block_size)  # fmt: skip
    p.add_argument("--depth-kv", choices=DEPTH_KV, default=defaults.depth_kv,
                   help="which layers write depth K/V: none (the baseline), attn, attn+ffn")  # fmt: skip
    p.add_argument("--norm", choices=NORMS, default=defaults.norm, help="pre- or post-norm blocks")
    cli.add_backend(p)
    p.add_argument("--prompt", default="The ", help="text the sample continues")
    p.add_argument("--tokens", type=cli.at_least(0), default=120, help="bytes to sample (0: none)")
    p.add_argument("--temperature", type=cli.positive_float, default=0.8, help="sampling temperature")
    p.add_argument("--top-k", type=cli.at_least(1), default=50, help="sample among the k likeliest bytes")
    p.add_argument("--seed", type=int, default=1337, help="seed of the initial weights and the sampling")
    cli.add_device(p)
    args = p.parse_args(argv)
    device = cli.check_device(p, args.device)
    if not args.prompt and args.tokens > 0:
        p.error("--prompt: sampling needs at least one byte to continue")
    torch.manual_seed(args.seed)
    if args.ckpt is not None:
        if not Path(args.ckpt).is_file():
            p.error(f"--ckpt {args.ckpt}: no such file")
        model = load_checkpoint(args.ckpt, device, args.backend)
    else:
        try:
            config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, n_kv_head=args.n_kv_head,
                               depth_kv=args.depth_kv, norm=args.norm, block_size=args.block_size,
                               backend=args.backend)  # fmt: skip
        except ValueError as error:
            p.error(str(error))
        model = GPT(config).to(device).eval()
    c = model.config
    cli.check_backend(p, c.backend, device, n_head=c.n_head, n_kv_head=c.n_kv_head, head_dim=c.n_embd // c.n_head,
                      slots=c.depth_slots)  # fmt: skip
    print(describe(model))
    if args.ckpt is None:
        print("untrained: the weights are random, so the sample is noise (mostly the prompt's last byte again, "
              "shown in quotes); --ckpt loads a model trained by examples/train_gpt.py")  # fmt: skip
    if args.tokens <= 0:
        return ""
    prompt = torch.tensor([list(args.prompt.encode("utf-8"))], device=device)  # (1, T)
    if prompt.shape[1] + args.tokens > model.config.block_size and model.wpe is not None:
        p.error(f"--prompt and --tokens need {prompt.shape[1] + args.tokens} positions; the model has "
                f"{model.config.block_size}")  # fmt: skip
    out = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k)
    sample = printable(bytes(out[0].tolist()))
    print(sample if args.ckpt else repr(sample))
    return sample


if __name__ == "__main__":
    main()
