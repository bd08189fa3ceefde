"""benchmarks/suite.py: its model reads and writes depth as the recipe says, its table's arithmetic, and a run
end to end on CPU at a tiny size (its help and the error without CUDA: test_examples.py, with every command line)."""

import dataclasses
import math

import pytest
import torch

import suite
from suite import BASE, GPT, SHAPES, Row, depth_reads, floor_bytes, model_lines, shrunk


def test_the_shapes_are_the_suites():
    s = SHAPES["gpt2s-mha"]
    assert (s.layers, s.width, s.heads, s.kv_heads, s.head_dim, s.norm, s.batch, s.seq) == (
        12, 768, 12, 12, 64, "pre", 12, 1024)  # fmt: skip
    assert SHAPES["table6"].norm == "post" and SHAPES["llama"].arms == ("attn",)
    assert all(s.width == s.heads * s.head_dim for s in SHAPES.values())


def test_depth_reads_count_every_earlier_entry_and_the_floor_moves_each_six_times():
    table6 = SHAPES["table6"]
    assert [depth_reads(table6, arm) for arm in (BASE, "attn", "attn+ffn")] == [0, 24 * 23 // 2, 24 * 23]
    gpt2s = SHAPES["gpt2s-mha"]
    assert floor_bytes(gpt2s, "attn") == 6 * 66 * 12 * 12 * 1024 * 64 * 2  # K and V: read, read, written


@pytest.mark.parametrize("arm, read", [("attn", [None, 1, 2]), ("attn+ffn", [None, 2, 4])])
def test_each_attention_layer_reads_the_entries_written_before_it(arm, read, monkeypatch):
    seen = []

    def recording(q, k, v, depth_k, depth_v):
        seen.append(None if depth_k is None else len(depth_k))
        assert depth_k is None or all(entry.shape == k.shape for entry in depth_k + depth_v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    monkeypatch.setattr(suite, "moda_attention", recording)
    shape = dataclasses.replace(shrunk(SHAPES["table6" if arm == "attn+ffn" else "llama"]), layers=3)
    idx = torch.randint(0, shape.vocab, (shape.batch, shape.seq))
    GPT(shape, arm)(idx, idx)
    assert seen == read


@pytest.mark.parametrize("name", ["table6", "gpt2s-mha"])
def test_with_no_depth_entry_moda_is_the_baseline(name):
    """A one-layer MoDA model reads no depth: its loss is the baseline's, post-norm and pre-norm."""
    shape = dataclasses.replace(shrunk(SHAPES[name]), layers=1)
    idx = torch.randint(0, shape.vocab, (shape.batch, shape.seq))
    torch.manual_seed(0)
    base = GPT(shape, BASE)
    torch.manual_seed(0)
    moda = GPT(shape, "attn")
    torch.testing.assert_close(moda(idx, idx), base(idx, idx))


def test_a_rows_ratios_are_taken_round_by_round_and_its_floor_from_the_bases_median():
    shape = SHAPES["table6"]
    base = Row(shape, BASE, "default", compile_s=50.0, peak_bytes=2 * 2**30, rounds_ms=[10.0, 12.0, 11.0])
    attn = Row(shape, "attn", "default", compile_s=100.0, peak_bytes=3 * 2**30, rounds_ms=[12.0, 15.0, 11.0])
    broken = Row(shape, "attn+ffn", "default", error="RuntimeError: out of memory")
    bandwidth = floor_bytes(shape, "attn") / 1e-3  # the entries' bytes take 1 ms
    lines = model_lines([base, attn, broken], bandwidth)
    cells = [cell.strip() for cell in lines[1].split("|")[1:-1]]
    assert cells == ["table6", "default", "attn", "12.0 (11.0-15.0)", "1.20 (1.00-1.25)", "3.00", "1.50", "100",
                     "2.00", "12.0", "1.00"]  # fmt: skip
    assert lines[0].split("|")[10].strip() == "11.0"  # the baseline's floor is itself
    assert "failed: RuntimeError: out of memory" in lines[2]


def test_the_suite_runs_end_to_end_on_cpu(capsys):
    suite.main(["--cpu-smoke", "--shapes", "table6,gpt2s-mha", "--rounds", "2", "--steps", "1", "--warmup", "1",
                "--kernel-lengths", "16"])  # fmt: skip
    out = capsys.readouterr().out
    assert f"moda_flex {suite.moda_flex.__file__}" in out
    table = out[out.rindex("| shape |"):].splitlines()[2:]
    assert [tuple(c.strip() for c in line.split("|")[1:4]) for line in table] == [
        ("table6", "eager", BASE), ("table6", "eager", "attn"), ("table6", "eager", "attn+ffn"),
        ("gpt2s-mha", "eager", BASE), ("gpt2s-mha", "eager", "attn"), ("gpt2s-mha", "eager", "attn+ffn"),
    ]  # fmt: skip
    assert not any("failed" in line for line in table)
    (kernel,) = [line for line in out.splitlines() if line.startswith("| 16 |")][-1:]
    assert math.isfinite(float(kernel.split("|")[4].split()[0]))  # auto / SDPA


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shapes", "table6,gpt3"], "argument --shapes: 'gpt3' is not one of table6, gpt2s-mha, llama, long"),
        (["--kernel-lengths", "1024,0"], "argument --kernel-lengths: lengths must be >= 1"),
        (["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    ],
)
def test_bad_options_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        suite.main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
