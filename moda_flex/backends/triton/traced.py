"""The fused kernels as ops that ``torch.compile`` traces into its graph (:mod:`..traced`): no Python at run time.

Taken by :func:`.ops.triton_attention` under ``torch.compile`` for CUDA
tensors of static shapes (:func:`..traced.traceable`); the launches are the
generic path's (no tensor descriptors) with the default configurations.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from ..launcher import Fixed
from ..records import define_traced
from ..traced import launch_flat, slab_depth
from .kernels.flat import FLAT
from .launch import Grads, Inputs, Options, Route, backward, forward


def launch_traced(kernel, fixed: Fixed, device: torch.device, wrap=wrap_triton, **arguments) -> None:
    """Launch ``kernel``'s flat wrapper (:mod:`.kernels.flat`) as ``fixed`` says, through ``wrap``."""
    launch_flat(FLAT[kernel], fixed.grid, wrap, **fixed.arguments, **arguments)


def _generic(*tensors) -> bool:
    return False


TRACED = Route(slab_depth, launch_traced, _generic)


def _forward_body(inputs: Inputs, opts: Options):
    return forward(inputs, opts, route=TRACED)


def _backward_body(grads: Grads, inputs: Inputs, opts: Options):
    return backward(grads, inputs, opts, route=TRACED)


# The forward gives out and lse, the backward what launch.gradients describes; their autograd is the eager
# op's (.ops), which calls traced_backward.
traced_forward = define_traced("triton_traced_forward", Inputs, Options, returns=2, body=_forward_body)
traced_backward = define_traced("triton_traced_backward", Grads, Inputs, Options, returns=6, body=_backward_body)
