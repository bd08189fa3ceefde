"""benchmarks/host_calls.py's comparison of two profiles: which functions MoDA's step calls more, and which
kernels it launches more or fewer of, per layer."""

import pytest

from host_calls import GENERATED, growth, kernel_family, launch_growth, named


def test_growth_counts_extra_calls_a_layer_and_ranks_them_by_extra_time():
    base = {("a.py", 1, "f"): (10.0, 1e-5), ("b.py", 2, "g"): (4.0, 4e-6)}
    moda = {("a.py", 1, "f"): (14.0, 2.8e-5), ("b.py", 2, "g"): (4.0, 4e-6), ("c.py", 3, "h"): (2.0, 1e-4)}
    rows = growth(base, moda, layers=2)
    # h: 2 new calls of 50 us, 50 us a layer; f: 4 more calls, its own time 28 us a step against 10, 9 us a layer;
    # g: no more calls, not listed
    assert [row[0][2] for row in rows] == ["h", "f"]
    assert rows[0][1:] == pytest.approx((1.0, 50.0, 50.0))
    assert rows[1][1:] == pytest.approx((2.0, 2.0, 9.0))


def test_growth_lists_generated_code_that_takes_longer_with_as_many_calls():
    """A graph's wrapper (``call``) runs once a step in both models: its own time is what grew."""
    base = {(GENERATED, 0, "call"): (2.0, 3e-4)}
    moda = {(GENERATED, 0, "call"): (2.0, 5e-4), ("a.py", 1, "f"): (1.0, 1e-6)}
    rows = growth(base, moda, layers=4)
    assert rows[0][0] == (GENERATED, 0, "call") and rows[0][1:] == pytest.approx((0.0, 250.0, 50.0))


def test_named_gives_a_builtin_as_it_is_and_a_function_by_its_file():
    assert named(("~", 0, "<method 'data_ptr' of 'torch._C.TensorBase' objects>")).startswith("<method")
    assert named(("/x/torch/_inductor/runtime/triton_heuristics.py", 9, "run")) == "runtime/triton_heuristics.py:9(run)"
    assert named((GENERATED, 0, "call")) == f"{GENERATED}: call"


def test_kernel_family_drops_the_number_inductor_gives_a_generated_kernel_only():
    assert kernel_family("triton_poi_fused__to_copy_12") == "triton_poi_fused__to_copy"
    assert kernel_family("triton_per_fused__fused_rms_norm_3") == "triton_per_fused__fused_rms_norm"
    assert kernel_family("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_kernel0_0") == (
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_kernel0_0")  # fmt: skip
    assert kernel_family("depth_forward_flat") == "depth_forward_flat"


def test_launch_growth_gives_each_changed_kernel_a_layer_the_largest_change_first():
    base = {"cudnn_fprop": 4.0, "mm": 20.0, "memset": 8.0}
    moda = {"mm": 28.0, "memset": 8.0, "forward_flat": 3.0, "cudnn_fprop": 1.0}
    rows = launch_growth(base, moda, layers=4)
    # mm +8 over 4 layers, cudnn -3, forward_flat +3 (ties by name), memset unchanged: not listed
    assert rows == [("mm", 2.0), ("cudnn_fprop", -0.75), ("forward_flat", 0.75)]
