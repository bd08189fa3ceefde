"""benchmarks/bench_model.py's pieces: which part of a step each GPU kernel's time goes to, a row's summary and
its ratios by round, its name, its compile, a shape resized, and the host's calls profiled."""

from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

from bench_model import (
    SHAPES, Case, compiled, host_calls_profile, kernel_kind, resized, round_ratios, summary, time_split, time_steps,
)  # fmt: skip


@pytest.mark.parametrize(
    "name, kind",
    [
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "vendor attention"),
        ("void flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<64>>", "vendor attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0", "vendor attention"),
        ("forward_kernel", "fused moda"),
        ("dq_kernel", "fused moda"),
        ("dkdv_flat_0", "fused moda"),  # launched from a compiled graph (moda_flex.backends.triton.traced)
        ("_depth_backward_kernel", "split depth + merge"),
        ("_depth_forward_token_kernel", "split depth + merge"),
        ("_sanitize_kv_kernel", "split NaN passes"),
        ("depth_backward_flat", "split depth + merge"),  # the split path's flat wrappers (split/flat.py)
        ("depth_forward_flat_1", "split depth + merge"),
        ("sanitize_kv_flat", "split NaN passes"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTN", "matmul"),
        ("triton_poi_fused__to_copy_add_mul_0", "inductor"),
        ("triton_red_fused_add_sum_3", "inductor"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ],
)
def test_kernel_kind(name, kind):
    assert kernel_kind(name) == kind


def test_time_split_is_per_step_and_the_host_gap_is_what_kernels_leave():
    kernels = {"flash_fwd_kernel": 3000.0, "dq_kernel": 1500.0, "nvjet_x": 600.0, "triton_poi_fused_add_0": 300.0,
               "elementwise_kernel": 150.0}  # fmt: skip
    split = time_split(kernels, steps=3, step_ms=2.5)
    assert split == pytest.approx({"vendor attention": 1.0, "split depth + merge": 0.0, "split NaN passes": 0.0,
                                   "fused moda": 0.5, "matmul": 0.2, "inductor": 0.1, "other": 0.05,
                                   "host gap": 0.65})  # fmt: skip
    assert time_split(kernels, steps=3, step_ms=1.0)["host gap"] == 0.0  # the profiler's steps were slower


def test_a_rows_chunks_make_one_summary():
    """Rounds time a row in chunks: one median over all their steps, the highest peak, tables per step."""
    chunks = [dict(times=[0.010, 0.030], issued=[0.001, 0.003], peak_mib=5.0, tables=2, back_to_back=0.018),
              dict(times=[0.020], issued=[0.002], peak_mib=7.0, tables=1, back_to_back=0.016),
              dict(times=[0.020], issued=[0.002], peak_mib=6.0, tables=0, back_to_back=0.019)]  # fmt: skip
    assert summary(chunks) == pytest.approx(dict(ms=20.0, host_ms=2.0, peak_mib=7.0, tables=0.75, back_ms=18.0))


def test_steps_are_timed_each_waited_for_then_as_many_back_to_back():
    """The timed steps wait for the GPU one by one; the back-to-back ones once, after the last."""
    waits, clock, calls = [], [0.0], []

    def step():  # each step takes 10 ms of the host's clock and 5 ms more until the GPU is done
        calls.append(len(waits))
        clock[0] += 0.010

    def synchronize():
        waits.append(len(calls))
        clock[0] += 0.005

    with mock.patch.object(torch.cuda, "synchronize", synchronize), \
            mock.patch.object(torch.cuda, "reset_peak_memory_stats"), \
            mock.patch.object(torch.cuda, "max_memory_allocated", return_value=2**20), \
            mock.patch("bench_model.time.perf_counter", lambda: clock[0]):  # fmt: skip
        timed = time_steps(step, 4)
    assert waits == [1, 2, 3, 4, 8]
    assert timed["times"] == pytest.approx([0.015] * 4) and timed["issued"] == pytest.approx([0.010] * 4)
    assert timed["back_to_back"] == pytest.approx((4 * 0.010 + 0.005) / 4)


def test_round_ratios_pair_each_round_with_the_bases_same_round():
    base = [dict(times=[0.010, 0.012, 0.011]), dict(times=[0.020, 0.020])]
    row = [dict(times=[0.013, 0.014, 0.012]), dict(times=[0.024, 0.026])]
    assert round_ratios(row, base) == pytest.approx([13 / 11, 25 / 20])


def test_a_rows_name_says_what_differs_from_the_defaults():
    assert Case("attn", "compiled", "auto", "auto").name == "attn"
    assert Case("attn+ffn", "compiled", "buffer", "triton").name == "attn+ffn, buffer, triton"
    assert Case("attn", "compiled", "auto", "auto", "static").name == "attn, static launcher"


def test_rows_that_differ_by_launcher_each_compile_their_own_step():
    """Two models of one structure in one process (``--rounds``): the static launcher's row must not run the
    compiled step of the row before it."""
    torch._dynamo.reset()
    x = torch.randn(2, 4)
    before = counters["stats"]["unique_graphs"]
    for launcher in ("triton", "static"):
        compiled(torch.nn.Linear(4, 4), Case("attn", "compiled", "auto", "auto", launcher))(x)
    assert counters["stats"]["unique_graphs"] - before == 2
    torch._dynamo.reset()


def test_resized_replaces_only_what_it_is_given_and_leaves_the_shape_as_it_was():
    gpt2s = SHAPES["gpt2s"]
    small = resized(gpt2s, layers=4, batch=1, seq=64)
    assert small == dict(config=dict(gpt2s["config"], n_layer=4), batch=1, seq=64)
    assert resized(gpt2s, seq=256) == dict(gpt2s, seq=256)
    assert resized(gpt2s) == gpt2s and gpt2s["config"]["n_layer"] == 12


def test_the_host_calls_profile_counts_the_calls_below_python():
    """``--host-profile``'s second view: each aten op a step calls, by name, with its calls over the steps."""
    with mock.patch.object(torch.cuda, "synchronize"):  # no GPU here: nothing to wait for
        averages = host_calls_profile(lambda: torch.ones(8, 8) @ torch.ones(8, 8), 3)
    assert {e.key: e.count for e in averages}["aten::mm"] == 3
