"""Mask pictures: the dense matrix, the text rendering and the PNG."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moda_flex import causal, chunk_depth, depth_only, depth_window, document, full, sliding_window
from moda_flex.variants import Variant
from moda_flex.visualize import FULL, MAX_CELLS, PARTIAL, SKIPPED, MaskView, load_variant, main

ROOT = Path(__file__).resolve().parents[1]


def test_causal_mask_is_bottom_right_aligned_with_own_depth():
    mask = MaskView(causal(), q_len=3, kv_len=5, slots=2).dense()
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
    unfolded = MaskView(sliding_window(2), q_len=4, kv_len=6, slots=3).dense()
    folded = MaskView(sliding_window(2), q_len=4, kv_len=6, slots=3, groups=3, folded=True).dense()
    assert folded.shape == (12, 9)
    assert torch.equal(folded, unfolded.repeat_interleave(3, dim=0))


def test_folded_rows_pass_the_query_head_to_the_predicates():
    # Odd query heads see nothing of the sequence: the head index must be h = kv_head * G + r % G.
    even_heads = Variant("even_heads", lambda b, h, q_pos, k_pos: (h % 2 == 0) & (k_pos <= q_pos))
    folded = MaskView(even_heads, q_len=2, kv_len=3, groups=2, folded=True, kv_head=1).dense()
    assert folded[:, :3].any(dim=1).tolist() == [True, False, True, False]
    assert not MaskView(even_heads, q_len=2, kv_len=3, head=3).dense().any()


def test_chunk_depth_packs_the_depth_of_every_token():
    mask = MaskView(chunk_depth(2), q_len=3, kv_len=4, slots=2).dense()
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
        MaskView(chunk_depth(2), q_len=3, kv_len=4, slots=2, packed=False).dense()
    packed_causal = MaskView(causal(), q_len=3, kv_len=4, slots=2, packed=True).dense()
    assert torch.equal(packed_causal[:, 4:], torch.eye(3, dtype=torch.bool).repeat_interleave(2, dim=1))


def test_document_uses_the_batch_row():
    ids = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    row0 = MaskView(causal() & document(ids), q_len=4, kv_len=4, batch=0).dense()
    row1 = MaskView(causal() & document(ids), q_len=4, kv_len=4, batch=1).dense()
    assert row0[3].tolist() == [False, False, True, True]
    assert row1[3].tolist() == [False, True, True, True]


def test_text_marks_cells_and_the_boundary():
    text = MaskView(depth_window(1), q_len=3, kv_len=5, slots=2).text()
    lines = text.splitlines()
    assert lines[0].startswith("depth_window(1): Tq=3 Tk=5 L=2 G=1")
    assert lines[2].split() == ["p", "01234|01"]
    assert [line.split()[1] for line in lines[3:]] == ["███··|·█", "████·|·█", "█████|·█"]
    assert [line.split()[0] for line in lines[3:]] == ["2", "3", "4"]


def test_text_says_why_the_rows_start_late():
    lines = MaskView(chunk_depth(3), q_len=6, kv_len=9, slots=3).text().splitlines()
    assert lines[1] == "Tq < Tk, bottom-right aligned: query i sits at position Tk - Tq + i = 3 + i, so rows start at 3"
    assert lines[3].split()[0] == "3"
    # With Tq == Tk the rows start at 0 and nothing needs saying.
    assert MaskView(causal(), q_len=3, kv_len=3, slots=1).text().splitlines()[1].split() == ["p", "012|0"]


def test_text_of_folded_rows_labels_token_and_head():
    lines = MaskView(full(), q_len=2, kv_len=2, slots=1, groups=2, folded=True, kv_head=1).text().splitlines()
    assert "rows: query token p and head h (the 2 heads of KV head 1 folded)" in lines[0]
    assert lines[1].split() == ["p", "h", "01|0"]
    assert [line.split()[:2] for line in lines[2:]] == [["0", "2"], ["0", "3"], ["1", "2"], ["1", "3"]]
    assert all(line.split()[2] == "██|█" for line in lines[2:])


def test_text_cell_count_matches_the_mask():
    kwargs = dict(q_len=5, kv_len=7, slots=2, groups=2, folded=True)
    text = MaskView(chunk_depth(3), **kwargs).text()
    assert "depth of every query token" in text
    assert text.count("█") - 1 == int(MaskView(chunk_depth(3), **kwargs).dense().sum())  # minus the legend


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
        MaskView(causal(), **kwargs).dense()


def test_png_has_the_dashed_boundary(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "mask.png"
    figure = MaskView(depth_only(), q_len=3, kv_len=5, slots=2).plot(path=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = figure.axes[0]
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and list(dashed[0].get_xdata()) == [4.5, 4.5]
    image = ax.get_images()[0].get_array()
    assert image.shape == (3, 7) and image[:, :5].sum() == 0 and image[:, 5:].all()


def _labels(ticks) -> list:
    return [t.get_text() for t in ticks]


def test_png_labels_like_the_text(tmp_path):
    pytest.importorskip("matplotlib")
    figure = MaskView(causal(), q_len=3, kv_len=5, slots=2).plot()
    ax = figure.axes[0]
    figure.canvas.draw()  # tick labels are formatted at drawing time
    assert _labels(ax.get_xticklabels()) == ["0", "1", "2", "3", "4", "0", "1"]  # slots from 0
    assert _labels(ax.get_yticklabels()) == ["token 2", "token 3", "token 4"]  # absolute positions, in words
    assert ax.get_ylabel() == "query token (its position), head 0"
    assert _labels(ax.child_axes[0].get_xticklabels()) == ["sequence keys", "depth of the\nrow's own token"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["visible", "masked"]


def test_png_says_why_the_rows_start_late():
    pytest.importorskip("matplotlib")
    title = MaskView(chunk_depth(3), q_len=6, kv_len=9, slots=3).plot().axes[0].get_title()
    assert title.splitlines() == [
        "chunk_depth(3): Tq=6 Tk=9 L=3 G=1",
        "Tq < Tk, bottom-right aligned: query i sits at position Tk - Tq + i = 3 + i, so rows start at 3",
    ]
    assert MaskView(causal(), q_len=3, kv_len=3).plot().axes[0].get_title() == "causal: Tq=3 Tk=3 L=0 G=1"


def test_png_of_folded_rows_names_token_and_head_and_each_depth_group():
    pytest.importorskip("matplotlib")
    figure = MaskView(causal(), q_len=2, kv_len=3, slots=3, groups=2, folded=True, kv_head=1, packed=True).plot()
    ax = figure.axes[0]
    figure.canvas.draw()
    assert _labels(ax.get_yticklabels()) == ["token 1, head 2", "token 1, head 3", "token 2, head 2", "token 2, head 3"]
    assert ax.get_ylabel() == "query token and head\n(the 2 heads of KV head 1, folded)"
    # packed depth: slots from 0 for each token, the token named above its group, a dotted line between groups
    assert _labels(ax.get_xticklabels())[3:] == ["0", "1", "2", "0", "1", "2"]
    top = ax.child_axes[0]
    assert _labels(top.get_xticklabels()) == ["sequence keys", "depth of\ntoken 1", "depth of\ntoken 2"]
    assert list(top.get_xticks()) == [1.0, 4.0, 7.0]  # the groups' centres
    assert [list(line.get_xdata()) for line in ax.get_lines() if line.get_linestyle() == ":"] == [[5.5, 5.5]]


def test_png_draws_into_a_given_axes():
    matplotlib_figure = pytest.importorskip("matplotlib.figure")
    figure = matplotlib_figure.Figure()
    ax = figure.subplots()
    assert MaskView(causal(), q_len=2, kv_len=2).plot(ax=ax) is figure


def test_png_without_matplotlib_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        MaskView(causal(), q_len=2, kv_len=2).plot()


def test_command_line_prints_every_builtin(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    main(["--q-len", "3", "--kv-len", "6", "--slots", "2", "--png", str(tmp_path)])
    out = capsys.readouterr().out
    for name in ("causal:", "full:", "sliding_window(2):", "depth_window(1):", "chunk_depth(2):", "depth_only:",
                 "(causal & document):"):
        assert name in out
    written = sorted(tmp_path.glob("*.png"))
    assert len(written) == 7
    assert sorted(line.split()[1] for line in out.splitlines() if line.startswith("wrote ")) == sorted(
        str(path) for path in written
    )


def test_command_line_help_says_which_names_take_a_demo_argument(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "a built-in: causal, full, depth_only (the names moda_attention(variant=...) accepts)" in help_text
    assert "sliding_window (a third of the keys; in a call moda_flex.sliding_window(window))" in help_text
    assert "depth_window (half the depth slots; in a call moda_flex.depth_window(slots))" in help_text


def test_command_line_selects_builtins_by_name(capsys):
    main(["sliding_window", "causal", "--q-len", "3", "--kv-len", "4", "--slots", "1"])
    titles = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if ": Tq=" in line]
    assert titles == ["sliding_window(1)", "causal"]


def test_command_line_loads_module_attribute(capsys):
    example = ROOT / "examples" / "custom_variant.py"
    main([f"{example}:attention_slots_only", "moda_flex.variants:depth_only", "--q-len", "2", "--kv-len", "2"])
    out = capsys.readouterr().out
    assert "attention_slots_only: Tq=2" in out and "depth_only: Tq=2" in out
    assert load_variant("moda_flex.variants:causal").name == "causal"


def test_a_module_loaded_by_path_imports_its_siblings(tmp_path):
    (tmp_path / "sibling_helper_of_masks.py").write_text("WINDOW = 3\n")
    (tmp_path / "my_masks.py").write_text(
        "import sibling_helper_of_masks\nfrom moda_flex import sliding_window\n"
        "window = sliding_window(sibling_helper_of_masks.WINDOW)\n"
    )
    path_before = list(sys.path)
    assert load_variant(f"{tmp_path / 'my_masks.py'}:window").name == "sliding_window(3)"
    assert sys.path == path_before


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuch", "not a built-in"),
        ("no_such_module_here:x", "cannot import"),
        ("moda_flex.variants:nothing", "has no attribute"),
        ("moda_flex.variants:sliding_window", "takes arguments"),
        ("moda_flex.visualize:MAX_CELLS", "not a moda_flex Variant"),
    ],
)
def test_command_line_names_a_bad_variant(spec, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([spec])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_command_line_without_matplotlib_prints_text_and_exits_0(tmp_path):
    # The import of matplotlib fails in the child, as where it is not installed.
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from moda_flex.visualize import main\n"
        f"main(['causal', 'full', '--png', {str(tmp_path)!r}])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "causal: Tq=6" in result.stdout and "full: Tq=6" in result.stdout
    assert "PNGs need matplotlib" in result.stdout
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "variant",
    [causal(), full(), sliding_window(70), chunk_depth(50), depth_window(2),
     causal() & document(torch.arange(200) * 3 // 200)],
    ids=lambda v: v.name,
)  # fmt: skip
def test_block_grid_agrees_with_the_elements(variant):
    # 200 tokens, G=2: 400 folded rows (4 row blocks); 256 padded key columns + 200 * 3 depth columns.
    T, G, L, B = 200, 2, 3, 128
    grid = MaskView(variant, q_len=T, kv_len=T, slots=L, groups=G).blocks()
    elements = MaskView(variant, q_len=T, kv_len=T, slots=L, groups=G, folded=True, packed=True).dense()
    padded = torch.zeros(4 * B, 256 + T * L + (-(T * L) % B), dtype=torch.bool)
    padded[: T * G, :T] = elements[:, :T]
    padded[: T * G, 256 : 256 + T * L] = elements[:, T:]
    blocks = padded.view(4, B, -1, B).transpose(1, 2)  # (row blocks, column blocks, B, B)
    assert grid.shape == blocks.shape[:2]
    any_visible, all_visible = blocks.any(-1).any(-1), blocks[:T * G // B].all(-1).all(-1)
    assert not (any_visible & (grid == SKIPPED)).any()  # nothing visible is skipped
    assert all_visible.ge(grid[: T * G // B] == FULL).all()  # a full block has every element visible
    assert (grid == PARTIAL).any()


def test_block_grid_of_causal_moda_is_a_depth_band():
    grid = MaskView(causal(), q_len=512, kv_len=512, slots=16, groups=8).blocks()
    assert grid.shape == (32, 4 + 64)
    # A row block holds 128 / 8 = 16 tokens, whose 16 * 16 depth slots are two column blocks.
    for row in range(32):
        assert (grid[row, 4:] != SKIPPED).nonzero().flatten().tolist() == [2 * row, 2 * row + 1]
    assert (grid[:, :4] == FULL).sum() == sum(range(4)) * 8  # sequence blocks wholly below the diagonal
    text = MaskView(causal(), q_len=512, kv_len=512, slots=16, groups=8).blocks_text()
    assert text.splitlines()[1] == "   0  ▒···|▒▒" + "·" * 62


def test_block_png_has_a_legend_and_the_boundary(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "blocks.png"
    figure = MaskView(causal(), q_len=256, kv_len=256, slots=4, groups=4).plot_blocks(path=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = figure.axes[0]
    assert [t.get_text().split(":")[0] for t in ax.get_legend().get_texts()] == ["full", "partial", "skipped"]
    assert [list(line.get_xdata()) for line in ax.get_lines() if line.get_linestyle() == "--"] == [[1.5, 1.5]]
