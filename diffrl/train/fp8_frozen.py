"""A float8 linear layer for a frozen weight: the weight is cast to float8 once, not on every call.

torchao's float8 training linear (`diffrl.train.fp8_linear`) recasts its weight on every forward
and computes a weight-gradient GEMM in every backward, because in training the weight changes
after each step. The base of a LoRA run never changes: its float8 copies can be made once, and the
backward needs only the gradient to the input. `FrozenFloat8Linear` does that with PyTorch's own
`torch._scaled_mm` (no torchao):

- at `refresh()`: the weight W (N×K) cast to e4m3 twice, with one scale per output row (for the
  forward's y = x Wᵀ) and one per input column (for the backward's dx = dy W), kept as buffers
  that are not saved (`persistent=False`: checkpoints and state dicts hold the 16-bit weight);
- per call: each row of the input scaled into e4m3 (one fused kernel under `torch.compile`), one
  float8 GEMM, the output in the input's dtype, plus the bias; the backward casts each row of
  the output gradient the same way and runs one float8 GEMM to the input.

`recipe="tensorwise"` uses one scale per tensor instead of per row (cuBLAS's float8 kernel, which
needs no row scales; coarser for rows of very different magnitude).

The 16-bit weight stays a parameter with `nn.Linear`'s names, so LoRA injection, state dicts and
the export see an `nn.Linear`. Whoever changes that weight in place (a load) calls `refresh()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
_E4M3_MAX = torch.finfo(E4M3).max
_TINY = 1e-12  # an all-zero row keeps a finite scale
RECIPES = ("rowwise", "tensorwise")


def quantize(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (2-D) in e4m3 and its float32 scale (`x ≈ q * scale`): one per row (M×1), or one (1×1)."""
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax().reshape(1, 1)
    scale = amax.float().clamp(min=_TINY) / _E4M3_MAX
    q = (x.float() / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(E4M3)
    return q, scale


def _scaled_mm(a, a_scale, b_t, b_t_scale, out_dtype, bias=None):
    """a (M×K) @ b_tᵀ (+ bias) where b_t (N×K) is row-major: the second operand column-major, as
    `torch._scaled_mm` wants it; scales M×1 and (N×1)ᵀ, or two scalars. The bias is added after
    the GEMM, where compiled blocks fuse it into the next kernel: not every release's rowwise
    kernel takes one."""
    if a_scale.numel() == 1:
        a_scale, b_scale = a_scale.reshape(()), b_t_scale.reshape(())
    else:
        b_scale = b_t_scale.t()
    out = torch._scaled_mm(a, b_t.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
    return out if bias is None else out + bias


class _FrozenFloat8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_q, w_scale, wt_q, wt_scale, bias, rowwise):
        xq, xs = quantize(x, rowwise)
        ctx.save_for_backward(wt_q, wt_scale)
        ctx.rowwise = rowwise
        return _scaled_mm(xq, xs, w_q, w_scale, x.dtype, bias)

    @staticmethod
    def backward(ctx, grad):
        wt_q, wt_scale = ctx.saved_tensors
        gq, gs = quantize(grad.contiguous(), ctx.rowwise)
        return _scaled_mm(gq, gs, wt_q, wt_scale, grad.dtype), None, None, None, None, None, None


class FrozenFloat8Linear(torch.nn.Linear):
    """`nn.Linear` with a frozen weight whose GEMMs run in float8 from copies cast once (module
    docstring); `fp8=False` runs `nn.Linear`'s own forward on the same weight, bit for bit."""

    fp8: bool = True

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, recipe="rowwise"):
        if recipe not in RECIPES:
            raise ValueError(f"recipe={recipe!r}: one of {', '.join(RECIPES)}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        for name in ("w_q", "w_scale", "wt_q", "wt_scale"):
            self.register_buffer(name, None, persistent=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: str = "rowwise", enabled: bool = True):
        """`linear`'s weight and bias parameters (shared, not copied) in a `FrozenFloat8Linear`."""
        if linear.weight.requires_grad:
            raise ValueError(
                f"FrozenFloat8Linear needs a frozen weight, but this {linear.out_features}×"
                f"{linear.in_features} linear's weight requires grad (full fine-tuning trains it)"
            )
        with torch.device("meta"):
            module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe)
        module.weight = linear.weight
        module.bias = linear.bias
        module.fp8 = enabled
        module.train(linear.training)
        module.refresh()
        return module

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the current weight to the float8 copies the GEMMs use."""
        rowwise = self.recipe == "rowwise"
        w = self.weight.detach()
        self.w_q, self.w_scale = quantize(w, rowwise)
        self.wt_q, self.wt_scale = quantize(w.t().contiguous(), rowwise)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return F.linear(input, self.weight, self.bias)
        x = input.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(input.dtype)
        y = _FrozenFloat8Matmul.apply(
            x, self.w_q, self.w_scale, self.wt_q, self.wt_scale, bias, self.recipe == "rowwise"
        )
        return y.reshape(*input.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, fp8={self.fp8}"


__all__ = ["E4M3", "RECIPES", "FrozenFloat8Linear", "quantize"]
