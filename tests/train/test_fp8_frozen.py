"""FrozenFloat8Linear (diffrl.train.fp8_frozen): its forward and its gradient to the input against a
float64 reference built from the same e4m3 operands, the 16-bit path bit for bit `nn.Linear`'s,
and what it keeps of `nn.Linear` (names, state dict). `torch._scaled_mm` runs on a CPU (torch 2.13)."""

from __future__ import annotations

import pytest
import torch

from diffrl.train.fp8_frozen import E4M3, FrozenFloat8Linear, quantize

E4M3_MAX = 448.0


def reference_quantize(x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """x rounded to e4m3 on its own float32 scale (rows' or the tensor's amax mapped to 448), in
    float64. The division is float32's, as the scales `torch._scaled_mm` takes are float32: in
    float64 a quotient next to an e4m3 rounding boundary can round the other way."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = amax / E4M3_MAX
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).double() * scale.double()


def frozen_linear(
    recipe: str, bias: bool = True, seed: int = 0
) -> tuple[torch.nn.Linear, FrozenFloat8Linear]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(64, 48, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    return linear, FrozenFloat8Linear.from_linear(linear, recipe)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_forward_and_input_gradient_equal_the_float64_product_of_the_e4m3_operands(recipe):
    linear, layer = frozen_linear(recipe)
    rowwise = recipe == "rowwise"
    torch.manual_seed(1)
    # rows of very different size: a rowwise scale keeps the small rows' precision
    x = (torch.randn(3, 7, 64) * torch.logspace(-2, 2, 7)[:, None]).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(3, 7, 48, dtype=torch.bfloat16)
    out = layer(x)
    out.backward(grad)

    w = linear.weight.double()
    want = reference_quantize(x.detach().reshape(-1, 64), rowwise) @ reference_quantize(w, rowwise).T
    want = (want + linear.bias.double()).reshape(3, 7, 48)
    want_grad = reference_quantize(grad.reshape(-1, 48), rowwise) @ reference_quantize(w.T, rowwise).T
    assert out.dtype == torch.bfloat16 and out.shape == (3, 7, 48)
    # the product of the same e4m3 operands up to bf16 roundings (2^-8 each) of the sum and the bias
    x64 = x.detach().double().reshape(-1, 64)
    bound = (x64.abs() @ w.abs().T + linear.bias.double().abs()).reshape(3, 7, 48)
    assert torch.all((out.double() - want).abs() <= 2**-7 * bound)
    grad_bound = (grad.double().reshape(-1, 48).abs() @ w.abs()).reshape(3, 7, 64)
    assert torch.all((x.grad.double() - want_grad.reshape(3, 7, 64)).abs() <= 2**-7 * grad_bound)
    # and near the exact product, as float8's 3 mantissa bits allow
    exact = torch.nn.functional.linear(x.detach().double(), w, linear.bias.double())
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.06


def test_rowwise_keeps_small_rows_that_one_tensor_scale_flushes():
    linear, rowwise = frozen_linear("rowwise", bias=False)
    tensorwise = FrozenFloat8Linear.from_linear(linear, "tensorwise")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    x[1] *= 1e-6  # one row a millionth of the other
    exact = torch.nn.functional.linear(x.double(), linear.weight.double())
    with torch.no_grad():
        errors = [
            ((m(x)[1].double() - exact[1]).norm() / exact[1].norm()).item() for m in (rowwise, tensorwise)
        ]
    assert errors[0] < 0.06 and errors[1] > 0.5


def test_off_it_is_nn_linear_bit_for_bit_and_keeps_its_names():
    linear, layer = frozen_linear("rowwise", bias=False)
    layer.fp8 = False
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), linear(x))
    assert list(layer.state_dict()) == ["weight"]  # the float8 copies are not saved
    assert layer.weight is linear.weight


def test_refresh_follows_a_changed_weight():
    linear, layer = frozen_linear("rowwise")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.mul_(2)
        stale = layer(x)
        layer.refresh()
        fresh = layer(x)
        layer.fp8 = False
        want = layer(x)
    assert ((fresh - want).norm() / want.norm()).item() < 0.06
    assert ((stale - want).norm() / want.norm()).item() > 0.3


def test_a_trained_weight_is_refused():
    with pytest.raises(ValueError, match=r"frozen weight.*requires grad"):
        FrozenFloat8Linear.from_linear(torch.nn.Linear(32, 16))
    with pytest.raises(ValueError, match="recipe='blockwise'"):
        FrozenFloat8Linear(32, 16, recipe="blockwise")


def test_quantize_scales_map_each_rows_amax_to_e4m3s_largest():
    x = torch.tensor([[1.0, -3.0], [0.5, 0.25], [0.0, 0.0]])
    q, scale = quantize(x, rowwise=True)
    assert q.dtype == E4M3
    torch.testing.assert_close(scale.squeeze(1)[:2], torch.tensor([3.0, 0.5]) / E4M3_MAX)
    assert q[0, 1].float() == -E4M3_MAX and q[1, 0].float() == E4M3_MAX
    assert torch.all(q[2].float() == 0)  # an all-zero row stays zero, with a finite scale
