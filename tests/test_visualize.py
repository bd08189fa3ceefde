"""Mask pictures: the dense matrix, the text rendering and the PNG."""

import sys

import pytest
import torch

from moda_flex import causal, chunk_depth, depth_only, depth_window, document, full, sliding_window
from moda_flex.variants import Variant
from moda_flex.visualize import MAX_CELLS, dense_mask, main, mask_text, plot_mask


def test_causal_mask_is_bottom_right_aligned_with_own_depth():
    mask = dense_mask(causal(), q_len=3, kv_len=5, slots=2)
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0, 1, 1],
            [1, 1, 1, 1, 0, 1, 1],
            [1, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_folded_rows_repeat_each_token_per_group():
    unfolded = dense_mask(sliding_window(2), q_len=4, kv_len=6, slots=3)
    folded = dense_mask(sliding_window(2), q_len=4, kv_len=6, slots=3, groups=3, folded=True)
    assert folded.shape == (12, 9)
    assert torch.equal(folded, unfolded.repeat_interleave(3, dim=0))


def test_folded_rows_pass_the_query_head_to_the_predicates():
    # Odd query heads see nothing of the sequence: the head index must be h = kv_head * G + r % G.
    even_heads = Variant("even_heads", lambda b, h, q_pos, k_pos: (h % 2 == 0) & (k_pos <= q_pos))
    folded = dense_mask(even_heads, q_len=2, kv_len=3, groups=2, folded=True, kv_head=1)
    assert folded[:, :3].any(dim=1).tolist() == [True, False, True, False]
    assert not dense_mask(even_heads, q_len=2, kv_len=3, head=3).any()


def test_chunk_depth_packs_the_depth_of_every_token():
    mask = dense_mask(chunk_depth(2), q_len=3, kv_len=4, slots=2)
    # Positions 1, 2, 3: chunks {0, 1}, {2, 3}; token t's slots are columns 4 + 2t, 5 + 2t.
    expected_depth = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[:, 4:], expected_depth)
    with pytest.raises(ValueError, match="packed=False"):
        dense_mask(chunk_depth(2), q_len=3, kv_len=4, slots=2, packed=False)
    packed_causal = dense_mask(causal(), q_len=3, kv_len=4, slots=2, packed=True)
    assert torch.equal(packed_causal[:, 4:], torch.eye(3, dtype=torch.bool).repeat_interleave(2, dim=1))


def test_document_uses_the_batch_row():
    ids = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    row0 = dense_mask(causal() & document(ids), q_len=4, kv_len=4, batch=0)
    row1 = dense_mask(causal() & document(ids), q_len=4, kv_len=4, batch=1)
    assert row0[3].tolist() == [False, False, True, True]
    assert row1[3].tolist() == [False, True, True, True]


def test_text_marks_cells_and_the_boundary():
    text = mask_text(depth_window(1), q_len=3, kv_len=5, slots=2)
    lines = text.splitlines()
    assert lines[0].startswith("depth_window(1): Tq=3 Tk=5 L=2 G=1")
    assert lines[1].split() == ["p", "01234|01"]
    assert [line.split()[1] for line in lines[2:]] == ["███··|·█", "████·|·█", "█████|·█"]
    assert [line.split()[0] for line in lines[2:]] == ["2", "3", "4"]


def test_text_of_folded_rows_labels_row_and_position():
    lines = mask_text(full(), q_len=2, kv_len=2, slots=1, groups=2, folded=True).splitlines()
    assert "folded rows" in lines[0]
    assert [line.split()[:2] for line in lines[2:]] == [["0", "0"], ["1", "0"], ["2", "1"], ["3", "1"]]
    assert all(line.split()[2] == "██|█" for line in lines[2:])


def test_text_cell_count_matches_the_mask():
    kwargs = dict(q_len=5, kv_len=7, slots=2, groups=2, folded=True)
    text = mask_text(chunk_depth(3), **kwargs)
    assert "depth of every query token" in text
    assert text.count("█") - 1 == int(dense_mask(chunk_depth(3), **kwargs).sum())  # minus the legend


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(q_len=0, kv_len=3), "q_len"),
        (dict(q_len=4, kv_len=3), "q_len"),
        (dict(q_len=2, kv_len=3, slots=-1), "slots"),
        (dict(q_len=2, kv_len=3, groups=0), "groups"),
        (dict(q_len=2, kv_len=3, head=-1), "head"),
        (dict(q_len=1024, kv_len=1024, slots=4), str(MAX_CELLS)),
    ],
)
def test_bad_sizes_raise(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        dense_mask(causal(), **kwargs)


def test_png_has_the_dashed_boundary(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "mask.png"
    figure = plot_mask(depth_only(), q_len=3, kv_len=5, slots=2, path=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = figure.axes[0]
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and list(dashed[0].get_xdata()) == [4.5, 4.5]
    image = ax.get_images()[0].get_array()
    assert image.shape == (3, 7) and image[:, :5].sum() == 0 and image[:, 5:].all()


def test_png_draws_into_a_given_axes():
    matplotlib_figure = pytest.importorskip("matplotlib.figure")
    figure = matplotlib_figure.Figure()
    ax = figure.subplots()
    assert plot_mask(causal(), q_len=2, kv_len=2, ax=ax) is figure


def test_png_without_matplotlib_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_mask(causal(), q_len=2, kv_len=2)


def test_command_line_prints_every_builtin(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    main(["--q-len", "3", "--kv-len", "6", "--slots", "2", "--png", str(tmp_path)])
    out = capsys.readouterr().out
    for name in ("causal:", "full:", "sliding_window(2):", "depth_window(1):", "chunk_depth(2):", "depth_only:",
                 "(causal & document):"):
        assert name in out
    assert len(list(tmp_path.glob("*.png"))) == 7
