"""Fake kernels for aten ops that capture could not trace otherwise, registered when zerocc is imported.

Capture traces on fake tensors (``zerocc/tracing.py``), so an op's fake
(meta) kernel decides what can be traced, while its real kernel decides what
eager PyTorch runs. Two kinds of op need help here:

- Ops with no fake kernel because their output shape depends on their input
  values (CTC loss: its log alpha is 2 x the longest target + 1 wide). Their
  fake kernel returns that size as an unbacked symbol, as ``nonzero`` does in
  torch: the graph then holds one program for every batch.
- Ops whose meta kernel lays its output out otherwise than the CPU kernel does (batch norm: see
  ``ZeroccFakeTensorMode``): the trace would record ops that are right for the meta layout only.
- Ops whose meta kernel refuses what the CPU kernel runs. ``aten._grouped_mm``
  (the grouped GEMM of transformers' mixture-of-experts layers) is one: its
  meta kernel implements the CUDA kernel's checks and demands bf16, while the
  CPU kernel multiplies float32, bfloat16 and float16. The kernel here states
  what the CPU kernel accepts and returns. It applies only to the fake modes
  zerocc makes (``tracing.make_fake_mode`` marks them with
  ``mark_zerocc_fake_mode``), so other users of fake tensors in the same
  process (``torch.compile``) see PyTorch's behaviour unchanged; every other
  case falls through to PyTorch's own kernel. It serves the meta device as well:
  ``zerocc.plan`` of a model built there plans what the CPU step runs.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import _disable_current_modes
from torch._higher_order_ops.utils import registered_hop_fake_fns
from torch._prims_common import compute_elementwise_output_strides, make_contiguous_strides_for, suggest_memory_format
from torch._subclasses.fake_impls import op_implementations_dict
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, _BypassDispatchCache
from torch.utils import _pytree as pytree

from . import ops  # noqa: F401  (defines zerocc::batch_norm_with_stats)
from .errors import CaptureError, user_frame_here

aten = torch.ops.aten

# Attribute set on the fake modes these kernels serve.
_ZEROCC_FAKE_MODE = "_zerocc_fake_mode"

# Dtypes aten._grouped_mm's CPU kernel multiplies (it names them when it refuses float64).
_GROUPED_MM_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def mark_zerocc_fake_mode(fake_mode) -> None:
    """Let the kernels in this module serve ``fake_mode``."""
    setattr(fake_mode, _ZEROCC_FAKE_MODE, True)


def _grouped_mm_cpu(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The result aten._grouped_mm's CPU kernel returns, with the checks it makes.

    Shapes: 2-D x 3-D (tokens sorted by group x one matrix per group, the
    forward of a mixture of experts), 3-D x 2-D, 2-D x 2-D (groups along the
    contraction: the gradient of the per-group matrices) and 3-D x 3-D
    (a batched matmul, no offsets). The result is contiguous. Rows past
    ``offs[-1]`` are left unwritten by the kernel; transformers' offsets
    always end at the row count.
    """
    # on the meta device too: zerocc.plan traces a model built there as the CPU step would run it (the meta
    # kernel's bf16-only check refused every float32 mixture of experts)
    if not getattr(fake_mode, _ZEROCC_FAKE_MODE, False) or mat_a.device.type not in ("cpu", "meta"):
        return NotImplemented
    torch._check(mat_a.dtype == mat_b.dtype,
                 lambda: f"expected m1 and m2 to have the same dtype, but got: {mat_a.dtype} != {mat_b.dtype}")
    torch._check(mat_a.dtype in _GROUPED_MM_CPU_DTYPES,
                 lambda: f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {mat_a.dtype}")
    torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                 lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    torch._check(bias is None, lambda: "Bias not supported yet")
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                 lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and mat_b.dim()={mat_b.dim()}")
    a_is_2d, b_is_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a_is_2d and b_is_2d):
        torch._check(mat_a.size(-1) == mat_b.size(-2), lambda: "contraction dimension of mat_a and mat_b must match")
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        _check_strides(name, mat)
    if a_is_2d or b_is_2d:
        torch._check(offs is not None, lambda: "Offsets tensor not provided, but is needed for 2D multiplicands")
        torch._check(offs.dim() == 1 and offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    else:
        torch._check(offs is None, lambda: "Offsets tensor provided, but is not needed for 3D/3D multiplicand layouts.")
    if a_is_2d and b_is_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_is_2d:
        torch._check(offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_is_2d:
        torch._check(offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    with fake_mode:
        return torch.empty(size, dtype=mat_a.dtype, device=mat_a.device)


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """Row- or column-major in the last two dimensions, the leading stride a multiple of 16 bytes."""
    last = mat.dim() - 1
    alignment = 16 // mat.element_size()
    stride = mat.stride()
    if stride[last - 1] == 1 and stride[last] >= max(1, mat.shape[last - 1]):
        leading = stride[last]
    elif stride[last] == 1 and stride[last - 1] >= max(1, mat.shape[last]):
        leading = stride[last - 1]
    else:
        torch._check(False, lambda: f"Invalid strides/sizes, got {stride} for strides and {mat.shape} for sizes")
        return
    torch._check(leading % alignment == 0, lambda: f"{name}: strides should be multiple of 16 bytes")


def register() -> None:
    """Install the kernels (idempotent); they serve only marked fake modes."""
    op_implementations_dict.setdefault(aten._grouped_mm.default, _grouped_mm_cpu)



@torch.library.register_fake("aten::_ctc_loss.Tensor")
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """CTC loss (``F.ctc_loss``): per-sequence losses and log alpha of (batch, time, 2 x longest target + 1)."""
    time, batch = log_probs.shape[0], log_probs.shape[1]   # ctc_loss unsqueezes unbatched input before this op
    states = torch.library.get_ctx().new_dynamic_size()   # 2 * max(target_lengths) + 1: read from the data
    return log_probs.new_empty((batch,)), log_probs.new_empty((batch, time, states))


@torch.library.register_fake("aten::_ctc_loss_backward.Tensor")
def _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank,
                       zero_infinity=False):
    """The gradient of CTC loss with respect to ``log_probs``: its shape."""
    return torch.empty_like(log_probs)


# Batch norms, by the position of the input whose layout the CPU kernel gives its first output
# (``at::empty_like(input, input.suggest_memory_format())``): the normalized input, or its gradient.
_BATCH_NORM_INPUT = {
    aten.native_batch_norm.default: 0,
    aten._native_batch_norm_legit_no_training.default: 0,
    aten.native_batch_norm_backward.default: 1,
    torch.ops.zerocc.batch_norm_with_stats.default: 0,
}


# Ops with one output that the CPU kernel lays out in the memory format the input at this position suggests
# (channels-last in, channels-last out), where their meta kernels return a contiguous tensor: found by running
# vision layers forward and backward on channels-last inputs, beside their fake results (MaxUnpool2d after a
# channels-last convolution: a `.flatten(1)` after it traced as a view, which the compiled step could not take).
_CPU_INPUT_LAYOUT = {
    aten.max_unpool2d.default: 0,
    aten.channel_shuffle.default: 0,
    aten.reflection_pad3d.default: 0,
    aten.replication_pad3d.default: 0,
    aten.reflection_pad2d_backward.default: 1,
    aten.replication_pad2d_backward.default: 1,
    aten.reflection_pad3d_backward.default: 1,
    aten.replication_pad3d_backward.default: 1,
}


# Elementwise ops whose Python decomposition (what fake and meta tensors run) lays its result out otherwise than the
# CPU kernel when the inputs' layouts differ (a gradient arriving transposed): TensorIterator's layout of these
# arguments, in this order, or a contiguous result. Found by comparing every layout of two or three inputs.
_CONTIGUOUS = ()
_CPU_ELEMENTWISE_LAYOUT = {
    aten.softplus_backward.default: (0, 1),
    aten.elu_backward.default: (0, 5),
    aten.hardtanh_backward.default: (0, 1),
    aten.hardsigmoid_backward.default: (0, 1),
    aten.hardswish_backward.default: (0, 1),
    aten.logit_backward.default: (0, 1),
    aten.copysign.Tensor: (0, 1),
    aten.xlogy.Tensor: (0, 1),
    aten.binary_cross_entropy_backward.default: (1, 0, 2, 3),
    aten.mse_loss_backward.default: _CONTIGUOUS,
    aten.smooth_l1_loss_backward.default: _CONTIGUOUS,
    aten.huber_loss_backward.default: _CONTIGUOUS,
}


# op namespaces that are PyTorch's or zerocc's own; an op of any other (torch.library.custom_op, a C++ extension's
# TORCH_LIBRARY) is a user's custom op
OWN_NAMESPACES = frozenset({"aten", "prim", "prims", "zerocc", "_c10d_functional", "c10d", "c10d_functional", "profiler",
                             "rngprims", "debugprims"})


def users_op(target) -> bool:
    """Whether ``target`` (an op overload, or its packet: ``torch.ops.mylib.op``) is a user's custom op
    (``torch.library.custom_op``, a C++ extension's op)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0] not in OWN_NAMESPACES
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in OWN_NAMESPACES


# Subtractions whose fake result is made by the matching addition when alpha is symbolic (``_dispatch_impl``).
_SUB_AS_ADD = {aten.sub.Tensor: aten.add.Tensor, aten.sub_.Tensor: aten.add_.Tensor, aten.sub.out: aten.add.out}


class ZeroccFakeTensorMode(FakeTensorMode):
    """The fake mode capture traces in: ops on CPU lay out their outputs as their CPU kernels do.

    Batch norms: their meta kernels keep the strides of the input (or of the incoming gradient); the CPU kernels
    return a contiguous tensor unless the input is channels-last. On a transposed input (``bn(x.transpose(1, 2))``,
    a BatchNorm1d over a sequence's features) the trace then saw a contiguous result after transposing back, and
    recorded ``F.linear``'s view of it where eager meets a strided tensor and copies: the compiled step failed
    with "view size is not compatible with input tensor's size and stride". The elementwise ops of
    ``_CPU_ELEMENTWISE_LAYOUT`` likewise: Qwen3-Next's ``softplus(a + dt_bias)``, whose gradient arrives
    transposed, failed so without memory pools, and with them (which place each result in the layout traced)
    summed the gradient of ``dt_bias`` in another order than eager, off by an ulp. These ops bypass torch's
    fake tensor cache, which every fake mode of the process shares: other fake modes keep PyTorch's layouts.
    The ops of ``_CPU_INPUT_LAYOUT`` keep a channels-last input's layout on the CPU, as batch norms do.
    """

    def _cache_key(self, state, func, args, kwargs):
        if func in _BATCH_NORM_INPUT or func in _CPU_ELEMENTWISE_LAYOUT or func in _CPU_INPUT_LAYOUT:
            raise _BypassDispatchCache("zerocc: laid out as its CPU kernel")
        return super()._cache_key(state, func, args, kwargs)

    # Higher-order ops (flex_attention, torch.cond, while_loop, a custom op's ``auto_functionalized`` in the
    # functionalizing replay) find their fake rule by the mode's exact class, and had none for this subclass: the
    # trace of a model calling one failed with torch's "no rule registered for HigherOrderOperator". Told that this
    # mode takes them, torch hands each here: FakeTensorMode's dispatch runs the ones registered with
    # ``register_fake``, FakeTensorMode's ``py_impl`` rule (which would send those back here) runs the others.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator) and func not in registered_hop_fake_fns:
            rule = func.python_key_table.get(FakeTensorMode)
            if rule is None:
                raise NotImplementedError(f"the higher-order op {func.name()} has no rule for fake tensors")
            return rule(self, *args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs or {})

    # model_recomputation's check of the random generators' states, while the step is traced (else None): it sees
    # each op tagged as seeded here, where every op passes anyway
    draw_observer = None

    def dispatch(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            raise _eager_collective_error(func)
        if self.draw_observer is not None and torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):   # a HOP has none
            return self.draw_observer.draw(func, args, kwargs or {}, lambda: super(ZeroccFakeTensorMode, self).dispatch(
                func, types, args, kwargs or {}))
        if func is aten._local_scalar_dense.default:   # .item(), .tolist() of values computed from the batch alone
            recorder = getattr(self.shape_env, "recorder", None)   # are read on the real batch and guarded
            value = recorder.read(args[0]) if recorder is not None else None   # (zerocc/data_guards.py)
            if value is not None:
                return value
        return super().dispatch(func, types, args, kwargs or {})

    def _dispatch_impl(self, func, types, args, kwargs):
        """An op on constant tensors and a symbolic scalar is not folded into a constant.

        Torch folds an op whose tensor inputs are all constants (``torch.tensor(1.0)``: NAdam's ``mu_product``, made
        by its first step) by running it on their real values, where a symbolic scalar becomes its hint, or nan
        without one (a setting the step reads each step, such as beta1): NAdam's first update then divided by
        ``1 - mu_product`` as the constant nan, and every parameter became nan. Such an input's constant is set
        aside for the op (dropped, with its aliases, when the op writes into it), so the result is a plain fake.
        """
        leaves = pytree.arg_tree_leaves(*args, **kwargs)
        if not any(isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) for leaf in leaves):
            return self._laid_out_as_on_cpu(func, types, args, kwargs)
        if func in _SUB_AS_ADD and isinstance(kwargs.get("alpha"), (torch.SymInt, torch.SymFloat)):
            # ``p.sub_(update, alpha=lr)`` with the step's symbolic lr: torch's fake kernel (its reference
            # ``torch._refs.sub``) branches on ``alpha != 1``; the result is ``add``'s with ``-alpha`` (ATen's sub
            # kernel is its add kernel given -alpha), and the graph keeps the op the optimizer called
            func, kwargs = _SUB_AS_ADD[func], {**kwargs, "alpha": -kwargs["alpha"]}
        constants = [(leaf, leaf.constant) for leaf in leaves if isinstance(leaf, FakeTensor) and leaf.constant is not None]
        writes = isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable
        for tensor, constant in constants:
            if writes:
                self.fake_tensor_converter.invalidate_constant_aliases(constant)
            tensor.constant = None
        try:
            return self._laid_out_as_on_cpu(func, types, args, kwargs)
        finally:
            if not writes:
                for tensor, constant in constants:
                    tensor.constant = constant

    def _laid_out_as_on_cpu(self, func, types, args, kwargs):
        result = super()._dispatch_impl(func, types, args, kwargs)
        if func in _CPU_ELEMENTWISE_LAYOUT and result.device.type == "cpu":
            order = _CPU_ELEMENTWISE_LAYOUT[func]
            inputs = [args[i] for i in order if i < len(args) and isinstance(args[i], torch.Tensor)]
            strides = compute_elementwise_output_strides(*inputs) if order else make_contiguous_strides_for(result.shape)
            if tuple(result.stride()) == tuple(strides):
                return result
            with self:
                return torch.empty_strided(result.shape, strides, dtype=result.dtype, device=result.device)
        position = _BATCH_NORM_INPUT.get(func, _CPU_INPUT_LAYOUT.get(func))
        if position is None or args[position].device.type != "cpu":
            return result
        input = args[position]
        if func in _BATCH_NORM_INPUT:   # several outputs, the first laid out as the input
            layout = torch.contiguous_format if input.is_contiguous() else suggest_memory_format(input)
            first, *rest = result
            with self:
                return (torch.empty_like(first, memory_format=layout), *rest)
        with self:   # ``input.suggest_memory_format()``: channels-last where its strides are, a size-1 channel included
            return torch.empty_like(result, memory_format=suggest_memory_format(input))


# the fix for the eager collectives whose counterpart is not a gather (the default's): a barrier has none, and
# the message listing gathers for it sent the user looking for one
_EAGER_COLLECTIVE_FIX = {
    "barrier": "remove it from the step: the step's own collectives keep the ranks together; a barrier your loop "
               "needs goes between calls to the step (dist.barrier() there runs as eager).",
    "broadcast_": "use the traceable functional collective, which the program runs and waits on: "
                  "torch.distributed._functional_collectives.broadcast(x, src, group) (returns the result).",
    "allreduce_": "use the traceable functional collective, which the program runs and waits on: "
                  "torch.distributed._functional_collectives.all_reduce(x, 'sum', group) (returns the result; its "
                  "gradient is summed over the ranks, as torch.distributed.nn.functional.all_reduce's is).",
}


def _eager_collective_error(func) -> CaptureError:
    """A ``torch.distributed`` collective called in the step (CLIP's negatives gathered by ``dist.all_gather``)."""
    fix = _EAGER_COLLECTIVE_FIX.get(func._opname, (
        "use the traceable functional collectives, which the program runs and waits on: "
        "torch.distributed._functional_collectives.all_gather_single_autograd(x, 0, group) (gradients flow back "
        "to each rank's slice, as torch.distributed.nn.all_gather's do) or all_gather_single(x.detach(), 0, group) "
        "(dist.all_gather's: no gradient), all_reduce(x, 'sum', group)."))
    return CaptureError(
        f"the step calls a torch.distributed collective ({func}) at {user_frame_here() or '(no user frame found)'}\n"
        "  why: torch.distributed's eager collectives (dist.all_gather, dist.all_reduce, torch.distributed.nn's "
        "differentiable ones built on them) run on the process group outside the program: the compiled step would "
        "read their results without waiting for them, and train on what the output tensors held before.\n"
        f"  fix: {fix}")


@contextlib.contextmanager
def attention_as_on_cpu():
    """``F.scaled_dot_product_attention`` on the meta device traced as on the CPU: its fused kernel, not the math.

    PyTorch picks an attention kernel by the query's device, and for ``meta`` it takes the math composite,
    which keeps the batch x heads x seq x seq weights for backward, where the CPU (and the GPU's flash and
    memory-efficient kernels) keep a logsumexp per row: a plan of a model built on the meta device
    (``zerocc.plan``) overstated its peak by the attention weights. Within the block a call on meta tensors
    that the CPU would run fused (its own choice, asked on empty CPU tensors of the same layout) runs
    ``_scaled_dot_product_flash_attention_for_cpu``; a boolean mask, dropout, or any other case keeps
    PyTorch's choice.
    """
    original = torch.nn.functional.scaled_dot_product_attention

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        if query.device.type == "meta" and _cpu_runs_it_fused(query, key, value, attn_mask, dropout_p, is_causal,
                                                               scale, enable_gqa):
            return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                    attn_mask=attn_mask, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _cpu_runs_it_fused(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    if attn_mask is not None and not attn_mask.is_floating_point():
        return False   # the composite rewrites a boolean mask before its kernel: keep PyTorch's own path
    tensors = (query, key, value, attn_mask)
    if any(t is not None and not all(isinstance(n, int) for n in (*t.shape, *t.stride())) for t in tensors):
        return False
    with _disable_current_modes():
        empty = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in tensors]
        choice = aten._fused_sdp_choice(*empty[:3], empty[3], dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return choice == int(SDPBackend.FLASH_ATTENTION)
