"""The backend registry: the names, the auto policy, and every built-in on every backend against the reference."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moda_flex
from moda_flex import backends, causal, chunk_depth, depth_bias, depth_only, document, full, moda_attention
from moda_flex import sliding_window
from moda_flex.backends.reference import reference_attention
from moda_flex.nn import MoDAAttention
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs, moda_shapes, variants
from moda_flex.variants import BUILTINS

from budget import examples
from fused import FUSED_KINDS, TRITON, needs_triton
from own_variant import user_variant

ROOT = pathlib.Path(__file__).resolve().parents[1]




def _choose(name="auto", *, q_len=5, kv_len=5, slots=0, variant=None, return_lse=False, batch=1):
    q, k = torch.zeros(batch, 2, q_len, 8), torch.zeros(batch, 1, kv_len, 8)
    return backends.choose(name, q, k, slots, variant or causal(), return_lse=return_lse)


# --- the auto policy ---------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        dict(variant=causal()),
        dict(variant=full(), q_len=3),
        dict(variant=causal() & full()),
        dict(variant=moda_flex.depth_window(2)),  # with no depth slot, the depth window changes nothing
    ],
    ids=["causal", "full-chunk", "causal-and-full", "depth-window-no-slots"],
)
def test_auto_hands_plain_calls_without_depth_to_sdpa(call):
    assert _choose(**call) is backends.sdpa_attention


@pytest.mark.parametrize(
    "call",
    [
        dict(slots=1),
        dict(return_lse=True),
        dict(q_len=3),  # SDPA aligns the causal mask top-left
        dict(variant=sliding_window(2)),
        dict(variant=depth_only()),
        dict(variant=causal() & document(torch.zeros(5, dtype=torch.long))),
        dict(variant=causal() & depth_bias(torch.zeros(0))),
        dict(variant=user_variant()),
    ],
    ids=["depth", "lse", "chunked-prefill", "window", "depth-only", "documents", "score", "no-structure"],
)
def test_auto_keeps_other_cpu_calls_on_the_reference(call):
    assert _choose(**call) is reference_attention


@pytest.mark.parametrize("name", backends.NAMES)
def test_a_call_with_no_output_element_runs_on_the_reference(name):
    if name == "triton" and TRITON is None:
        pytest.skip("the triton backend cannot run here")
    assert _choose(name, batch=0, slots=2) is reference_attention


def test_an_unknown_name_is_refused():
    names = r"\('auto', 'reference', 'flex', 'triton', 'split'\)"
    with pytest.raises(ValueError, match=rf"backend must be one of {names}, got 'cuda'"):
        _choose("cuda")


@settings(max_examples=examples(15))
@given(shape=moda_shapes(max_slots=0), plain=st.sampled_from(["causal", "full"]))
def test_the_sdpa_path_computes_moda(shape, plain):
    """Output and gradients of auto's SDPA path equal the reference's, with Tq == Tk for causal."""
    if plain == "causal":
        shape = MoDAShape(shape.batch, shape.q_heads, shape.kv_heads, shape.kv_len, shape.kv_len, 0, shape.head_dim)
    inputs = make_inputs(shape, dtype=torch.float64)
    assert_matches_reference(inputs, backend=_without_lse("auto"), variant=plain)


def _without_lse(name):
    """A backend for assert_matches_reference that calls moda_attention without asking for the lse."""

    def run(q, k, v, depth_k, depth_v, variant, scale):
        out = moda_attention(q, k, v, depth_k, depth_v, variant=variant, scale=scale, backend=name)
        _, lse = reference_attention(q, k, v, depth_k, depth_v, variant, scale)  # the lse SDPA does not give
        return out, lse

    run.__name__ = f"{name} without lse"
    return run


def test_layers_follow_the_same_policy(monkeypatch):
    """The layer has no path of its own: without depth it reaches SDPA through the registry, with depth not."""
    calls = []
    sdpa = backends.sdpa_attention

    def counted(*args):
        calls.append(args[5].name)
        return sdpa(*args)

    monkeypatch.setattr(backends, "sdpa_attention", counted)
    attn = MoDAAttention(16, 4, 2)
    x = torch.randn(1, 6, 16)
    _, stream = attn(x, moda_flex.DepthStream())
    assert calls == ["causal"]
    attn(x, stream)  # one depth entry: not SDPA
    assert calls == ["causal"]


# --- triton by name --------------------------------------------------------------------


@needs_triton
def test_the_triton_check_runs_once(monkeypatch):
    checks = []
    check = TRITON.unsupported_reason
    monkeypatch.setattr(TRITON, "unsupported_reason", lambda *args: checks.append(1) or check(*args))
    assert _choose("triton") is TRITON.triton_attention
    assert len(checks) == 1


@needs_triton
def test_the_kernel_backends_read_depth_entries():
    from moda_flex.backends import capture, split

    assert backends.kernel_name(TRITON.triton_attention) == "triton"
    assert backends.kernel_name(split.split_attention) == "split"
    assert backends.kernel_name(capture.capture_attention) == "capture"
    kernels = (TRITON.triton_attention, split.split_attention, capture.capture_attention)
    assert all(backends.reads_depth_entries(run) for run in kernels)
    assert not any(backends.reads_depth_entries(run) for run in (reference_attention, backends.sdpa_attention))

    def split_attention(*args):  # a kernel's name, in a module that is not the kernel's
        raise AssertionError("not called")

    assert backends.kernel_name(split_attention) is None


@needs_triton
@pytest.mark.parametrize(
    "variant", [chunk_depth(2), user_variant(), causal() | sliding_window(2)], ids=lambda x: x.name
)
def test_triton_refuses_unsupported_variants_by_name(variant):
    inputs = make_inputs(MoDAShape(batch=1, q_heads=2, kv_heads=1, q_len=3, kv_len=5, slots=2, head_dim=16))
    with pytest.raises(NotImplementedError, match=re.escape(f"variant {variant.name!r}")):
        moda_attention(*inputs.values(), variant=variant, backend="triton")


@needs_triton
def test_triton_refuses_documents_split_into_runs_and_auto_computes_them():
    variant = causal() & document(torch.tensor([0, 0, 1, 1, 0]))
    inputs = make_inputs(MoDAShape(batch=1, q_heads=2, kv_heads=1, q_len=3, kv_len=5, slots=2, head_dim=16))
    assert "contiguous run" in TRITON.unsupported_reason(inputs["q"], variant)
    with pytest.raises(NotImplementedError, match="contiguous run"):
        moda_attention(**inputs, variant=variant, backend="triton")
    assert_matches_reference(inputs, backend="auto", variant=variant)


def test_runs_on_cpu_without_triton():
    """triton has no wheel off Linux: everything but backend='triton' works without it, which says why."""
    code = """
import sys
sys.modules["triton"] = None  # import triton now fails, as where it is not installed
import torch
from moda_flex import moda_attention, causal
from moda_flex.testing import MoDAShape, make_inputs

inputs = make_inputs(MoDAShape(1, 2, 1, 3, 5, 2, 16))
for backend in ("auto", "reference", "flex"):
    moda_attention(**inputs, backend=backend).sum().backward()
try:
    moda_attention(**inputs, backend="triton")
except NotImplementedError as error:
    assert "needs the triton package" in str(error), error
else:
    raise AssertionError("backend='triton' ran without triton")
assert "moda_flex.backends.triton" not in sys.modules
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_triton_is_a_linux_only_extra():
    """The CPU install is torch and numpy; triton comes with the ``triton`` and ``test`` extras, on Linux only."""
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as file:
        project = tomllib.load(file)["project"]
    assert project["dependencies"] == ["torch>=2.11", "numpy"]
    for extra in ("triton", "test"):
        triton = [d for d in project["optional-dependencies"][extra] if d.split(";")[0].strip() == "triton"]
        assert len(triton) == 1 and triton[0].split(";")[1].strip().replace('"', "'") == "platform_system == 'Linux'"


# --- every built-in on every backend against the reference --------------------------

FLEX_SHAPES = moda_shapes(max_batch=2, max_groups=3, max_kv_heads=2, max_kv_len=40, max_slots=6, head_dims=(8, 16))


@pytest.mark.parametrize("kind", BUILTINS)
@settings(max_examples=examples(8))
@given(shape=FLEX_SHAPES, strided=st.booleans(), data=st.data())
def test_every_builtin_on_flex_matches_reference(kind, shape, strided, data):
    variant = data.draw(variants(shape, kinds=(kind,), max_terms=1))
    assert_matches_reference(make_inputs(shape, strided_depth=strided), backend="flex", variant=variant)


@needs_triton
@pytest.mark.parametrize("kind", FUSED_KINDS)
@settings(max_examples=examples(2))
@given(
    shape=moda_shapes(max_batch=2, max_groups=2, max_kv_heads=2, max_kv_len=20, max_slots=4, head_dims=(16,)),
    data=st.data(),
)
def test_every_builtin_on_triton_matches_reference(kind, shape, data):
    variant = data.draw(variants(shape, kinds=(kind,), max_terms=1))
    inputs = make_inputs(shape, strided_depth=True)
    assert TRITON.unsupported_reason(inputs["q"], variant) is None, variant.name
    assert_matches_reference(inputs, backend="triton", variant=variant)


def test_a_second_derivative_through_sdpa_names_the_backend_that_has_one():
    """auto runs a call without depth on PyTorch's SDPA, whose fused kernels have no second derivative."""
    inputs = make_inputs(MoDAShape(batch=1, q_heads=2, kv_heads=1, q_len=6, kv_len=6, slots=0, head_dim=16))
    out = moda_attention(inputs["q"], inputs["k"], inputs["v"])
    (grad,) = torch.autograd.grad(out.square().sum(), inputs["q"], create_graph=True)  # first order still works
    with pytest.raises(NotImplementedError, match="backend 'auto' has no second derivative.*backend='reference'"):
        grad.square().sum().backward()
    reference = moda_attention(inputs["q"], inputs["k"], inputs["v"], backend="reference")
    (grad,) = torch.autograd.grad(reference.square().sum(), inputs["q"], create_graph=True)
    grad.square().sum().backward()  # the reference has one
