"""Backends with first derivatives only: a backward that builds a graph is refused, naming the one to use.

A backward pass under ``create_graph=True`` (a gradient penalty, some
meta-learning) builds a graph of the gradients, to differentiate them again.
A backend that computes its gradients outside autograd (kernels, FlexAttention)
would hand them back without one: second derivatives would be silently
missing or wrong. Its backward calls :func:`refuse_create_graph` first.

PyTorch's fused SDPA kernels, on which ``auto`` runs a call without depth,
build a graph whose node fails only when differentiated, without saying what
to do: :func:`explain_sdpa` makes that failure name ``backend='reference'``.
"""

from __future__ import annotations

import torch


def _second_derivative_error(backend: str) -> NotImplementedError:
    return NotImplementedError(
        f"backend {backend!r} has no second derivative (backward with create_graph=True, e.g. a gradient "
        "penalty): use backend='reference', which has one"
    )


def refuse_create_graph(backend: str) -> None:
    """Raise NotImplementedError, naming ``backend`` and ``backend='reference'``, if this backward builds a graph.

    Args:
        backend: the backend whose backward is running, e.g. ``"triton"``.
    """
    # Grad mode is on in a backward pass exactly under create_graph=True.
    if torch.is_grad_enabled():
        raise _second_derivative_error(backend)


def explain_sdpa(out: torch.Tensor) -> None:
    """Make differentiating the gradients of the SDPA call that gave ``out`` fail with our error.

    Only the fused kernels' nodes lack a second derivative (the math path is
    plain ops). The gradients pass a node that is the identity, so a backward
    under ``create_graph=True`` still gives first derivatives; differentiating
    them raises. Under ``torch.compile`` AOTAutograd refuses double backward itself.
    """
    node = None if torch.compiler.is_compiling() else out.grad_fn
    if node is not None and node.name().startswith("ScaledDotProduct"):
        node.register_hook(_mark_sdpa_gradients)


def _mark_sdpa_gradients(grad_inputs: tuple, grad_outputs: tuple):
    if not torch.is_grad_enabled():  # a plain backward: nothing to mark
        return None
    return tuple(None if g is None else _FirstOrderOnly.apply(g) for g in grad_inputs)


class _FirstOrderOnly(torch.autograd.Function):
    """The identity, whose backward refuses: the gradients of a kernel that has no second derivative."""

    @staticmethod
    def forward(ctx, grad):
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, _):
        raise _second_derivative_error("auto")
