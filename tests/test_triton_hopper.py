"""The triton backend's Hopper path, forced on any device, against the float64 reference.

The path (sm90 tiles, tensor descriptors for the tiles of the unmasked
blocks) is chosen at launch; ``MODA_FLEX_TRITON_PATH``
forces it, and on CPU the Triton interpreter runs its descriptors. What the
interpreter cannot run, warp specialization and the TMA engine's reductions
(``DQ_ATOMIC=2``), is checked on a GPU by benchmarks/bench_hopper.py. The whole
of test_triton.py and test_scores.py also passes with
``MODA_FLEX_TRITON_PATH=hopper`` set.
"""

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.errors import PTXASError  # noqa: E402

from moda_flex import variants as v  # noqa: E402
from moda_flex.backends.triton import configs, triton_attention  # noqa: E402
from moda_flex.testing import MoDAShape, assert_matches_reference, make_inputs  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU the path takes 16-bit floats only; the interpreter runs them as float32 anyway.
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setenv(configs.PATH_ENV, "hopper")


def _recording(seen: list, **overrides):
    """A config hook that records each kernel's default launch and applies ``overrides`` to the dK/dV kernel."""

    def config(kernel, default):
        seen.append((kernel, default["TMA"]))
        return {**default, **overrides} if kernel == "dkdv" else default

    return config


# (shape, variant, dQ from its kernel (0) or from atomics (1)): both ways for the case with the most edges
CASES = [
    (MoDAShape(1, 8, 2, 37, 37, 5, 64), v.causal(), 1),  # G = 4: rows of 4 heads per token
    (MoDAShape(2, 6, 2, 21, 45, 3, 32), v.causal(), 0),  # G = 3: a padded head in every box, Tq < Tk
    (MoDAShape(2, 6, 2, 21, 45, 3, 32), v.causal(), 1),
    (MoDAShape(1, 4, 2, 40, 40, 2, 16), v.sliding_window(24), 0),  # unmasked blocks between the edges
    # one-token decode; Triton 3.6's ptxas crashes (error -11) compiling this dK/dV kernel for sm_90a (Triton
    # 3.9's compiles it): the path is opt-in, and so are atomic dQ sums
    pytest.param(MoDAShape(1, 4, 2, 1, 29, 3, 32), v.full(), 1,
                 marks=pytest.mark.xfail(DEVICE == "cuda", raises=PTXASError, strict=True,
                                         reason="ptxas crash (error -11) compiling the dK/dV kernel")),
]


@pytest.mark.parametrize("shape, variant, dq_atomic", CASES,
                         ids=lambda x: str(x) if isinstance(x, MoDAShape) else getattr(x, "name", f"dq_atomic{x}"))
def test_hopper_path_matches_reference(hopper, shape, variant, dq_atomic):
    """Output, lse and every gradient through the descriptors, with dQ from its kernel or from atomics."""
    seen = []

    def run(q, k, vv, depth_k, depth_v, variant, scale):
        return triton_attention(q, k, vv, depth_k, depth_v, variant, scale,
                                config=_recording(seen, DQ_ATOMIC=dq_atomic))  # fmt: skip

    inputs = make_inputs(shape, dtype=DTYPE, device=DEVICE, strided_depth=True, seed=2)
    assert_matches_reference(inputs, backend=run, variant=variant)
    assert sorted(seen) == [("dkdv", True), ("dq", True), ("fwd", True)]  # each kernel once, on the path


def test_auto_takes_the_hopper_path_on_hopper_for_large_calls_only(monkeypatch):
    monkeypatch.delenv(configs.PATH_ENV, raising=False)
    big = torch.zeros(1, 64, 4096, 64, device=DEVICE, dtype=torch.bfloat16)  # 2^30 scores
    assert not configs.hopper_path(big, big)  # opt-in: slower than generic with depth
    monkeypatch.setenv(configs.PATH_ENV, "auto")
    small = torch.zeros(1, 2, 8, 64, device=DEVICE, dtype=torch.bfloat16)
    on_hopper = big.is_cuda and torch.cuda.get_device_capability(big.device)[0] == 9
    assert not configs.hopper_path(small, small)
    assert configs.hopper_path(big, big) == on_hopper
    monkeypatch.setenv(configs.PATH_ENV, "generic")
    assert not configs.hopper_path(big, big)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(1, 2, 8, 48),  # D not a power of two: the kernels pad it
        lambda: torch.zeros(1, 2, 8, 256),  # D past 128
        lambda: torch.zeros(1, 2, 64, 8).transpose(-1, -2),  # head dim not contiguous
        lambda: torch.zeros(1, 2, 8, 65)[..., 1:],  # strides of 65 elements: not 16-byte aligned
    ],
)
def test_hopper_path_declines_what_descriptors_cannot_cover(hopper, make):
    t = make().to(DEVICE)
    assert not configs.hopper_path(t, t)


def test_unknown_path_is_named(monkeypatch):
    monkeypatch.setenv(configs.PATH_ENV, "sm90")
    with pytest.raises(ValueError, match="MODA_FLEX_TRITON_PATH='sm90'"):
        configs.hopper_path(torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16))
