"""Backends with first derivatives only: a backward that builds a graph is refused, naming the one to use.

A backward pass under ``create_graph=True`` (a gradient penalty, some
meta-learning) builds a graph of the gradients, to differentiate them again.
A backend that computes its gradients outside autograd (kernels, FlexAttention)
would hand them back without one: second derivatives would be silently
missing or wrong. Its backward calls :func:`refuse_create_graph` first.
"""

from __future__ import annotations

import torch


def refuse_create_graph(backend: str) -> None:
    """Raise NotImplementedError, naming ``backend`` and ``backend='reference'``, if this backward builds a graph.

    Args:
        backend: the backend whose backward is running, e.g. ``"triton"``.
    """
    # Grad mode is on in a backward pass exactly under create_graph=True.
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"backend {backend!r} has no second derivative (backward with create_graph=True, e.g. a gradient "
            "penalty): use backend='reference', which has one"
        )
