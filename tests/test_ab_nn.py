"""benchmarks/ab_nn.py's loading of another checkout's layers: its blocks, as a module of this package, build
and run the example GPT in place of this checkout's, and the GPT builds its own again afterwards."""

from pathlib import Path

import gpt
import torch

import moda_flex.nn
from ab_nn import blocks_of, kernel_moves, load_nn


def test_another_checkouts_blocks_build_the_example_gpt_and_compute_as_its_source_says(tmp_path):
    source = Path(moda_flex.nn.__file__).read_text()
    # a change that can be seen in the output: the other checkout's blocks double their input
    other = tmp_path / "nn.py"
    line = "        start = cache.length if cache is not None else 0\n"
    other.write_text(source.replace(line, line + "        x = 2 * x\n"))
    old = load_nn(str(other))
    assert old.Block is not moda_flex.nn.Block
    assert old.moda_attention is moda_flex.nn.moda_attention  # its imports are this checkout's modules

    config = gpt.GPTConfig(n_layer=2, n_embd=16, n_head=2, n_kv_head=1, block_size=8, vocab_size=32)
    tokens = torch.randint(0, 32, (2, 8))
    outputs = {}
    for name, module in (("new", moda_flex.nn), ("old", old)):
        with blocks_of(module):
            torch.manual_seed(0)
            model = gpt.GPT(config)
        assert all(type(block) is module.Block for block in model.blocks)
        outputs[name] = model(tokens)[0]
    assert gpt.Block is moda_flex.nn.Block
    assert not torch.allclose(outputs["new"], outputs["old"])


def test_kernel_moves_lists_the_kernels_that_moved_most_first_then_all():
    old = {"gemm": (100.0, 4.0), "triton_poi_fused_add": (10.0, 2.0), "gone": (5.0, 1.0)}
    new = {"gemm": (101.0, 4.0), "triton_poi_fused_add": (30.0, 3.0), "fresh": (8.0, 1.0)}
    rows = kernel_moves(new, old, 2)
    assert rows == [
        "| triton_poi_fused_add | 10.0 | 30.0 | +20.0 | 2 -> 3 |",
        "| fresh | 0.0 | 8.0 | +8.0 | 0 -> 1 |",
        "| all | 115.0 | 139.0 | +24.0 | 7 -> 8 |",
    ]
