import pytest

from diffrl.algos import (
    FlowGRPOLoss,
    PolicyGradientSpec,
    algorithm,
    compute_flow_grpo_advantages,
    get_advantage_estimator,
    register_algorithm,
)
from diffrl.algos.registry import Registry


def test_unknown_name_lists_registered_and_suggests():
    reg = Registry("widget")
    reg.register("alpha")(1)
    reg.register("beta")(2)
    with pytest.raises(ValueError) as info:
        reg.get("alpah")
    msg = str(info.value)
    assert "'alpah'" in msg
    assert "widget" in msg
    assert "Did you mean 'alpha'?" in msg
    assert "alpha, beta" in msg


def test_unknown_name_without_close_match_has_no_suggestion():
    reg = Registry("widget")
    reg.register("alpha")(1)
    with pytest.raises(ValueError, match="Registered: alpha") as info:
        reg.get("zzzzzz")
    assert "Did you mean" not in str(info.value)


def test_empty_registry_and_unhashable_name_raise_value_error():
    with pytest.raises(ValueError, match=r"\(none\)"):
        Registry("widget").get("x")
    with pytest.raises(ValueError, match="unknown widget"):
        Registry("widget").get(["not", "hashable"])


def test_duplicate_registration_raises_and_keeps_the_first():
    reg = Registry("widget")
    reg.register("alpha")(1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("alpha")(2)
    assert reg.get("alpha") == 1
    assert reg.names() == ["alpha"]


def test_register_returns_object_unchanged():
    reg = Registry("widget")

    @reg.register("f")
    def f():
        return 42

    assert f() == 42
    assert reg.get("f") is f
    assert "f" in reg and len(reg) == 1


def test_builtins_are_registered_on_import():
    assert isinstance(algorithm("flow_grpo").loss(), FlowGRPOLoss)
    assert get_advantage_estimator("flow_grpo") is compute_flow_grpo_advantages


def test_global_getters_name_the_registered_ones():
    with pytest.raises(ValueError, match="Did you mean 'flow_grpo'") as info:
        algorithm("flow_grop")
    assert "flow_grpo" in str(info.value) and "dpo" in str(info.value)
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpo'"):
        get_advantage_estimator("grpo")


def test_kl_is_not_an_algorithm_and_says_what_to_do():
    with pytest.raises(ValueError, match=r"not a policy loss: .* set actor\.loss\.kl_coef"):
        algorithm("kl")


def test_global_duplicate_algorithm_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm(PolicyGradientSpec(name="flow_grpo", loss=object))

    assert algorithm("flow_grpo").loss is FlowGRPOLoss
