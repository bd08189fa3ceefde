"""The fused kernels' launches that ``torch.compile`` traces into its graph (:mod:`..launch`): no Python at run time.

The route and the bodies of the traced ops ``moda_flex::triton_traced_forward``
/ ``_backward`` (defined in :mod:`.ops`), which :func:`.ops.triton_attention`
takes under ``torch.compile`` for CUDA tensors of static shapes
(:func:`..launch.traceable`); the launches are the generic path's (no tensor
descriptors) with the default configurations.
"""

from __future__ import annotations

from torch.library import wrap_triton

from .launch import Grads, Inputs, Options, Route, backward, forward


def _generic(*tensors) -> bool:
    return False


TRACED = Route(wrap_triton, _generic)


def forward_body(inputs: Inputs, opts: Options):
    """The traced forward op's body (:mod:`.ops`): out and lse."""
    return forward(inputs, opts, route=TRACED)


def backward_body(grads: Grads, inputs: Inputs, opts: Options):
    """The traced backward op's body (:mod:`.ops`): what :func:`.launch.gradients` describes."""
    return backward(grads, inputs, opts, route=TRACED)
