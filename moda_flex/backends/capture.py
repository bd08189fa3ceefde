"""``auto``'s kernels for a model's calls on CUDA: the fused kernel, or the split path while a CUDA graph is captured.

At a model's shapes the two kernel backends trade places by how the step
runs (NVIDIA H200, the Table 6 step with depth KV, docs/speed.md "What `auto`
runs"). Compiled in the default mode the step is
bound by the host, and the fused kernel's fewer launches win (53.3 ms a step
against the split path's 80.7); under CUDA graphs the host's work is gone
and the split path's faster kernels win (30.1 ms against 34.5).

How a step runs is known only when its kernels launch:
``torch.compile(mode="reduce-overhead")`` traces the step once, runs it
(its warm-up) and then captures it. So the choice is made at launch, by
two ops: ``moda_flex::capture_forward`` returns out (B, Hq, Tq, D), laid
out as :func:`.layouts.new_out` says, and lse (B, Hq, Tq), which either
backward reads, and ``moda_flex::capture_backward`` chooses again (a graph
may capture a forward and not its backward). Both kernels compute the same
function: a backward given the other's out and lse computes its gradients
exactly.

A kernel's first launch may not happen during a capture: it compiles and
loads Triton's kernels and builds cuDNN's plan, work a capture does not
allow (tried on an H200: "operation failed due to a previous error during
capture"). So the first call of each layout that runs the fused kernel runs
the split path's forward and backward once as well, uncaptured, and drops
their results: a step's warm-up prepares its capture.

Compiled on CUDA with static shapes, the call is one traced op
(:mod:`.launch`), ``moda_flex::capture_traced_forward`` and its backward,
whose body inductor traces under the compile mode's settings: for a graph
that runs as a CUDA graph it holds the two ops above, otherwise the fused
kernel's launches themselves, which spare a host-bound step the opaque
ops' host time (:func:`graphs_captured`). Those launches hold no host
addresses either, so a CUDA graph captured by hand around a step compiled
in the default mode replays them correctly, on the fused kernel.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from ..depth import DepthKV, as_list, slot_count
from ..variants import Variant
from .launch import traceable
from .layouts import new_out, unit_last
from .records import define, define_traced_pair, unpack
from .split import ops as split_ops
from .split import sequence
from .split.ops import Grads, Inputs, Options
from .triton import ops as fused_ops
from .triton import launch as fused_launch
from .triton import traced as fused_traced


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of ``device`` is capturing a graph (never on another device)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def kernel_now(device: torch.device) -> str:
    """The kernel backend a call launched now on ``device`` runs: ``"split"`` while a graph is captured, else
    ``"triton"``."""
    return "split" if capturing(device) else "triton"


def fused_records(inputs: Inputs, opts: Options) -> tuple[fused_launch.Inputs, fused_launch.Options]:
    """A call of the split path's records as the fused kernel's: no window, documents or score."""
    fused_inputs = fused_launch.Inputs(*inputs, documents=None, bias=None)
    fused_opts = fused_launch.Options(scale=opts.scale, causal=opts.causal, window=0, depth_first=opts.depth_first,
                                      sequence=opts.sequence, softcap=0.0, bias_first=False)
    return fused_inputs, fused_opts


# The layouts (:func:`_layout_key`) whose split path has run uncaptured.
_PREPARED: set = set()


def _layout_key(inputs: Inputs, opts: Options) -> tuple:
    """What the split path's compiled kernels and cuDNN's plan depend on: the options, dtype, shapes, the
    strides of q, k, v and of the first depth entries (a model's entries share theirs); a few us a call."""
    q, k, v, depth_k, depth_v = inputs
    depth = (depth_k[0].stride(), depth_v[0].stride()) if depth_k else ()
    return (opts, q.dtype, len(depth_k), q.shape, k.shape, q.stride(), k.stride(), v.stride(), *depth)


def prepare_capture(inputs: Inputs, opts: Options) -> None:
    """Run the split path's forward and backward once, uncaptured, for each layout that meets the fused
    kernel on CUDA, so that a capture of the same call launches nothing for the first time."""
    if inputs.q.device.type == "cuda":
        _prepare(inputs, opts)


def _prepare(inputs: Inputs, opts: Options) -> None:
    key = _layout_key(inputs, opts)
    if key in _PREPARED:
        return
    with torch.no_grad():
        out, lse = split_ops._forward(*inputs, opts)
        grads = Grads(torch.zeros_like(out), None, out, lse)
        split_ops.backward_in_op_layouts(grads, inputs, opts)
    _PREPARED.add(key)


def _forward(inputs: Inputs, opts: Options) -> tuple[Tensor, Tensor]:
    """out (B, Hq, Tq, D) as :func:`_outputs` lays it out and lse (B, Hq, Tq) float32, by the kernel of
    :func:`kernel_now`."""
    if kernel_now(inputs.q.device) == "split":
        out, lse = split_ops._forward(*inputs, opts)
        return out, sequence.lse_view(lse)
    prepare_capture(inputs, opts)
    return fused_ops._run_forward(*fused_records(inputs, opts))


def _backward(grads: Grads, inputs: Inputs, opts: Options) -> tuple[Tensor, ...]:
    """dq in two parts (:func:`summed_dq` adds them), dk, dv, contiguous, and the depth gradients, two
    (B, Hk, Tq, L, D) tensors, from the forward's out and its lse (B, Hq, Tq), by the kernel of
    :func:`kernel_now`."""
    if kernel_now(inputs.q.device) == "split":
        return split_ops.backward_in_op_layouts(_split_grads(grads, opts), inputs, opts, dq_apart=True)
    dq, *rest = _fused_backward(grads, inputs, opts)
    return *split_ops.DqParts(dq, None).apart(), *rest


def summed_dq(results: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A backward op's results with dq's two parts added: traced, the sum joins the graph's use of dq."""
    dq, more, *rest = results
    return dq + more, *rest


def _split_grads(grads: Grads, opts: Options) -> Grads:
    """``grads`` with the lse in the layout of the split path's vendor op."""
    return grads._replace(lse=sequence.lse_layout(opts.kernel, grads.lse))


def _fused_backward(grads: Grads, inputs: Inputs, opts: Options,
                    run_backward: Optional[Callable] = None) -> tuple[Tensor, ...]:  # fmt: skip
    """The fused kernel's dq, dk, dv and depth gradients, by ``run_backward`` (:func:`.triton.launch.backward`'s
    arguments; the eager path's where None)."""
    grad_out = torch.zeros_like(grads.out) if grads.grad_out is None else unit_last(grads.grad_out)
    fused_inputs, fused_opts = fused_records(inputs, opts)
    fused_grads = fused_launch.Grads(grad_out, grads.grad_lse, grads.out, grads.lse, bias_grad=False)
    return (run_backward or fused_ops._run_backward)(fused_grads, fused_inputs, fused_opts)[:5]


# ---- torch.library ops -------------------------------------------------------------------------
# The split path's records, field by field; CUDA, and CPU under Triton's interpreter (the tests, which
# stand in for a capture).

def _outputs(inputs: Inputs, opts: Options) -> tuple[Tensor, Tensor]:
    """The forward op's results, unwritten (its fake): out in the layout of :func:`.layouts.new_out`, as
    either kernel writes it, and lse (B, Hq, Tq) float32."""
    q = inputs.q
    return new_out(q), q.new_empty(q.shape[:3], dtype=torch.float32)


define("capture_forward", Inputs, Options, returns=2, run=_forward, fake=_outputs)
define("capture_backward", Grads, Inputs, Options, returns=6, run=_backward,
       fake=functools.partial(split_ops.gradients_unwritten, dq_apart=True))  # fmt: skip


def _backward_by_op(grads: Grads, inputs: Inputs, opts: Options):
    return summed_dq(torch.ops.moda_flex.capture_backward(*grads, *inputs, *opts))


def _setup_context(ctx, inputs, output):
    split_ops._save(ctx, *unpack(inputs, Inputs, Options), output)


def _autograd_backward(ctx, grad_out, grad_lse, run_backward=_backward_by_op):
    grads = split_ops._gradients(ctx, grad_out, grad_lse, run_backward, backend="auto")
    return (*(grads or (None,) * len(Inputs._fields)), *(None,) * len(ctx.options))


torch.library.register_autograd("moda_flex::capture_forward", _autograd_backward, setup_context=_setup_context)


# ---- traced ops (moda_flex.backends.launch) ------------------------------------------------------

def graphs_captured() -> bool:
    """Whether the graph inductor compiles runs as a CUDA graph: its ``triton.cudagraphs`` setting, which
    ``mode="reduce-overhead"`` and ``"max-autotune"`` turn on. Inductor traces a traced op's body under the
    mode's settings; Dynamo's trace before it, which only infers the outputs' shapes, sees the defaults."""
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


def _traced_forward_body(inputs: Inputs, opts: Options):
    if graphs_captured():  # no host time to spare: the opaque op, which takes the split path while captured
        return torch.ops.moda_flex.capture_forward(*inputs, *opts)
    return fused_launch.forward(*fused_records(inputs, opts), route=fused_traced.TRACED)


def _traced_backward_body(grads: Grads, inputs: Inputs, opts: Options):
    if graphs_captured():
        return summed_dq(torch.ops.moda_flex.capture_backward(*grads, *inputs, *opts))
    return _fused_backward(grads, inputs, opts, run_backward=functools.partial(fused_launch.backward,
                                                                               route=fused_traced.TRACED))


# Their results are the opaque ops' (both kernels' layouts are alike); the autograd is theirs too.
traced_forward, traced_backward = define_traced_pair(
    "capture_traced", Inputs, Grads, Options, forward=_traced_forward_body, backward=_traced_backward_body,
    returns=5, autograd_backward=_autograd_backward, setup_context=_setup_context,
)


def capture_attention(q: Tensor, k: Tensor, v: Tensor, depth_k: DepthKV, depth_v: DepthKV, variant: Variant,
                      scale: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """MoDA on the fused kernel, or on the split path while a CUDA graph is captured, for a call both compute.

    Args:
        q: (B, Hq, Tq, D), float16 or bfloat16 (float32 on CPU, under the interpreter).
        k, v: (B, Hk, Tk, D); ``Tq == Tk`` for a causal mask.
        depth_k, depth_v: (B, Hk, Tq, L, D), any strides, or a sequence of L
            (B, Hk, Tq, D) entries, each given its own gradient.
        variant: a variant both kernels run (:func:`moda_flex.backends.split.unsupported_reason`).
        scale: logit scale.

    Returns:
        out (B, Hq, Tq, D) and lse (B, Hq, Tq) float32, natural log; both
        differentiable. Eagerly the call runs wholly on the kernel chosen
        when it is made; compiled, its forward and backward each choose when
        they launch, or, traced (CUDA, static shapes), when inductor
        compiles them (:func:`graphs_captured`).
    """
    compiling = torch.compiler.is_compiling()
    if not compiling and kernel_now(q.device) == "split":
        return split_ops.split_attention(q, k, v, depth_k, depth_v, variant, scale)
    depth_k, depth_v = as_list(depth_k), as_list(depth_v)
    opts = split_ops.call_options(q, k, slot_count(depth_k), variant, scale)
    inputs = Inputs(q, k, v, depth_k, depth_v)
    if compiling:
        if traceable(q, k, v, *depth_k, *depth_v):
            return traced_forward(*inputs, *opts)
        return torch.ops.moda_flex.capture_forward(*inputs, *opts)
    prepare_capture(inputs, opts)
    return fused_ops.triton_attention(q, k, v, depth_k, depth_v, variant, scale)
