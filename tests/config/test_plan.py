"""The run plan (diffrl.config.plan): each decision of representative configs against what the
documented rules say (docs/training.md "Parallelism", docs/async.md, docs/configuration.md), written
out by hand; the config is never changed; the plan is refused where a setting would do nothing."""

from __future__ import annotations

import copy
import json

import pytest

from diffrl.config import ConfigError, load_config
from diffrl.config.plan import REPLICATE_MAX_WEIGHT_SHARE, Machine, RunPlan, resolve_plan

GIB = 2**30
# An 80 GiB device with a model whose weights fit it (10 GiB) or do not (60 GiB, past 45%)
FITS = Machine(accelerator="cuda", device_bytes=80 * GIB, weight_bytes=10 * GIB)
TOO_BIG = Machine(accelerator="cuda", device_bytes=80 * GIB, weight_bytes=60 * GIB)
SEPARATE = ["trainer.placement=separate", "actor.loss.kl_coef=0.01"]
TWO = ["trainer.n_gpus_per_node=2"]


def plan_of(preset: str, overrides=(), machine: Machine | None = None, job: str = "train") -> RunPlan:
    return resolve_plan(load_config(preset, list(overrides), job=job), machine, job=job)


def test_one_cpu_worker_of_the_default_job():
    # DiffusionNFT (a direct-preference loss, no PPO ratio), one worker, colocated, synchronous
    plan = plan_of("default")
    assert plan == RunPlan(
        job="train",
        world_size=1,
        strategy="none",
        strategy_reason="one worker: nothing to replicate or shard",
        placement="colocated",
        replicas=0,
        staleness=0,
        old_log_probs="none",
        reference="none",
        attn_backend="native",
        compile=False,
        offload=(),
        weight_sync_backend=None,
    )
    assert plan.rollout_passes == () and not plan.reuses_rollout_log_probs


def test_one_worker_flow_grpo_reuses_the_rollouts_log_probs_or_recomputes_them():
    # colocated, every window step trained, micro-batches that split: the rollout's own log-probs
    reused = plan_of("tiny_sd3", ["rollout.micro_batch_size=4", "actor.micro_batch_size=4"])
    assert reused.old_log_probs == "rollout" and reused.reuses_rollout_log_probs
    assert plan_of("tiny_sd3", ["algorithm.old_log_probs=recompute"]).old_log_probs == "trainer"
    # KL to the reference: its pass runs on the trainer when colocated
    assert plan_of("tiny_sd3", ["actor.loss.kl_coef=0.01"]).reference == "trainer"


def test_two_workers_lora_replicate_and_full_fine_tuning_shards():
    lora = plan_of("tiny_sd3", TWO, FITS)
    assert (lora.world_size, lora.strategy) == (2, "ddp")
    assert "fits one device (10.0 GiB of weights on a 80.0 GiB device)" in lora.strategy_reason
    assert plan_of("tiny_sd3", TWO, TOO_BIG).strategy == "fsdp2"  # 75% > 45%: the frozen base is sharded
    assert plan_of("tiny_sd3", TWO).strategy == "ddp"  # sizes unknown: LoRA replicates
    full = plan_of("tiny_sd3", [*TWO, "model.lora.rank=0"], FITS)
    assert full.strategy == "fsdp2" and full.strategy_reason.startswith("full fine-tuning")
    # explicit settings stand; param_offload makes auto shard
    assert plan_of("tiny_sd3", [*TWO, "actor.strategy=fsdp2"], FITS).strategy == "fsdp2"
    offloaded = plan_of("tiny_sd3", [*TWO, "actor.param_offload=true"], FITS)
    assert (offloaded.strategy, offloaded.offload) == ("fsdp2", ("param",))
    # the threshold is the documented share of one device
    edge = Machine(device_bytes=100 * GIB, weight_bytes=int(REPLICATE_MAX_WEIGHT_SHARE * 100 * GIB))
    assert plan_of("tiny_sd3", TWO, edge).strategy == "ddp"


def test_separate_placement_runs_the_passes_without_gradient_on_the_replicas():
    plan = plan_of("tiny_sd3", SEPARATE)
    assert (plan.placement, plan.replicas, plan.staleness) == ("separate", 1, 0)
    assert (plan.old_log_probs, plan.reference) == ("replicas", "replicas")
    assert plan.rollout_passes == ("default", "reference")
    assert plan.weight_sync_backend == "gloo"  # CPU workers
    assert plan_of("tiny_sd3", SEPARATE, Machine(accelerator="cuda")).weight_sync_backend == "nccl"
    shared_gpu = [*SEPARATE, "trainer.gpus_per_worker=0.5", "rollout.gpus_per_replica=0.5"]
    assert plan_of("tiny_sd3", shared_gpu, Machine(accelerator="cuda")).weight_sync_backend == "gloo"
    trainer = plan_of("tiny_sd3", [*SEPARATE, "rollout.log_prob_passes=trainer"])
    assert (trainer.old_log_probs, trainer.reference, trainer.rollout_passes) == ("trainer", "trainer", ())


def test_separate_two_rank_auto_follows_the_resolved_strategy():
    # the decision that used to differ before and after the strategy was written into the config:
    # auto LoRA on 2 ranks is ddp (the trainer computes in the weights' own dtypes), so the old
    # log-probs move to the replicas; sharded (weights too big), FSDP2 casts, and they stay
    assert plan_of("tiny_sd3", [*SEPARATE, *TWO], FITS).rollout_passes == ("default", "reference")
    too_big = plan_of("tiny_sd3", [*SEPARATE, *TWO], TOO_BIG)
    assert (too_big.strategy, too_big.old_log_probs, too_big.rollout_passes) == (
        "fsdp2",
        "trainer",
        ("reference",),
    )


def test_one_step_off_and_bounded_staleness():
    one_step_off = plan_of("tiny_sd3", [*SEPARATE, "trainer.async_mode=one_step_off"])
    assert one_step_off.staleness == 1 and one_step_off.rollout_passes == ("default", "reference")
    bounded = plan_of("tiny_sd3", [*SEPARATE, "trainer.async_mode=bounded", "trainer.max_staleness=3"])
    # bounded: the replicas get the update's starting weights too late: old log-probs on the trainer
    assert (bounded.staleness, bounded.old_log_probs, bounded.reference) == (3, "trainer", "replicas")
    assert plan_of("tiny_sd3", [*SEPARATE, "trainer.async_mode=bounded"]).staleness == 2  # the default K


def test_attention_compile_and_offload():
    cuda = Machine(accelerator="cuda", gpu_attn_backend="_native_flash")
    assert plan_of("tiny_sd3", [], cuda).attn_backend == "_native_flash"  # auto: the family's on a GPU
    assert plan_of("tiny_sd3", [], Machine(gpu_attn_backend="_native_flash")).attn_backend == "native"
    assert plan_of("tiny_sd3", ["model.attn_backend=native"], cuda).attn_backend == "native"
    plan = plan_of(
        "tiny_sd3", ["model.compile=true", "actor.optimizer_offload=true", "actor.activation_offload=true"]
    )
    assert plan.compile and plan.offload == ("optimizer", "activation")


def test_an_attention_backend_this_machine_cannot_run_is_refused_before_any_model_loads(monkeypatch):
    """Issue 51, probe 4: model.attn_backend=flash without flash-attn passed the config and failed
    in the first forward with a traceback. diffusers' own requirement check decides, here with its
    package-found flags set both ways."""
    from diffusers.models import attention_dispatch

    gpu = Machine(accelerator="cuda")
    for flag, backend in [("_CAN_USE_FLASH_ATTN", "flash"), ("_CAN_USE_SAGE_ATTN", "sage")]:
        monkeypatch.setattr(attention_dispatch, flag, False)
        with pytest.raises(
            ConfigError, match=rf"model.attn_backend='{backend}' cannot run on this machine: .*auto"
        ):
            plan_of("tiny_sd3", [f"model.attn_backend={backend}"], gpu)
        monkeypatch.setattr(attention_dispatch, flag, True)
        assert plan_of("tiny_sd3", [f"model.attn_backend={backend}"], gpu).attn_backend == backend
    assert plan_of("tiny_sd3", ["model.attn_backend=_native_math"]).attn_backend == "_native_math"


@pytest.mark.parametrize("backend", ["flash", "flash_hub", "sage", "xformers"])
def test_a_cuda_only_attention_backend_is_refused_on_a_run_without_a_gpu(backend):
    """Issue 51 re-probe: with `kernels` installed, model.attn_backend=flash_hub passed on a CPU
    run and failed after the model loaded (the kernel fetched from the Hub, a network traceback)."""
    with pytest.raises(ConfigError, match=rf"attn_backend='{backend}' runs CUDA kernels only.*auto"):
        plan_of("tiny_sd3", [f"model.attn_backend={backend}"])


def test_a_hub_attention_kernel_is_refused_with_the_hub_switched_off(monkeypatch):
    from diffusers.models import attention_dispatch

    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN", True)
    monkeypatch.setattr(attention_dispatch, "_check_attention_backend_requirements", lambda backend: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        plan_of("tiny_sd3", ["model.attn_backend=flash_hub"], Machine(accelerator="cuda"))


def test_supervised_and_eval_jobs_plan_no_passes():
    sft = plan_of("shapes_sft", job="sft")
    assert (sft.job, sft.strategy, sft.old_log_probs, sft.reference, sft.staleness) == (
        "sft",
        "none",
        "none",
        "none",
        0,
    )


def test_merged_lora_is_refused_where_the_plan_shards():
    merged = [*TWO, "model.lora.merge_inference=true", "algorithm.trainer_type=direct_preference"]
    merged += ["actor.loss.mode=awm"]
    assert plan_of("tiny_sd3", merged, FITS).strategy == "ddp"  # replicated: merging is fine
    with pytest.raises(
        ConfigError, match=r"needs unsharded weights, but actor\.strategy=fsdp2 shards them over 2"
    ):
        plan_of("tiny_sd3", merged, TOO_BIG)  # auto shards this one: merging would do the wrong thing


def test_one_worker_shards_on_a_one_rank_group_for_param_offload():
    # actor.param_offload is FSDP2's CPU offload: auto shards one worker too (a one-rank group)
    offloaded = plan_of("tiny_sd3", ["actor.param_offload=true"], FITS)
    assert (offloaded.world_size, offloaded.strategy, offloaded.offload) == (1, "fsdp2", ("param",))
    assert offloaded.strategy_reason == (
        "actor.param_offload is FSDP2's CPU offload; one worker: FSDP2 on a one-rank group, its "
        "parameters in host memory between uses"
    )
    assert "actor.strategy=fsdp2 (actor.param_offload" in offloaded.lines()[1]
    assert "offload param" in offloaded.lines()[3]
    explicit = plan_of("tiny_sd3", ["actor.strategy=fsdp2"])
    assert explicit.strategy_reason == "set by actor.strategy; one worker: FSDP2 on a one-rank group"
    assert plan_of("tiny_sd3").strategy == "none"  # without them one worker shares nothing
    # sharded, the trainer's mixed precision is not a replica's: its old log-probs stay on the trainer
    separate = plan_of("tiny_sd3", [*SEPARATE, "actor.strategy=fsdp2", "algorithm.old_log_probs=recompute"])
    assert (separate.old_log_probs, separate.reference) == ("trainer", "replicas")
    unsharded = plan_of("tiny_sd3", [*SEPARATE, "algorithm.old_log_probs=recompute"])
    assert unsharded.old_log_probs == "replicas"
    # merged LoRA needs unsharded weights, also on a one-rank group
    merged = ["model.lora.merge_inference=true", "algorithm.trainer_type=direct_preference"]
    merged += ["actor.loss.mode=awm", "actor.param_offload=true"]
    with pytest.raises(
        ConfigError,
        match=r"shards them on a one-rank group: set actor\.param_offload=false with actor\.strategy=auto or none",
    ):
        plan_of("tiny_sd3", merged)


def test_a_setting_that_would_do_nothing_is_refused_with_the_fix():
    for strategy in ("ddp", "none"):
        with pytest.raises(
            ConfigError,
            match=rf"actor\.param_offload=True is invalid: does nothing with actor\.strategy={strategy}: "
            r".*actor\.strategy=fsdp2",
        ):
            load_config("tiny_sd3", ["actor.param_offload=true", f"actor.strategy={strategy}"])


@pytest.mark.parametrize(
    "overrides",
    [[], [*SEPARATE, *TWO], [*TWO, "model.lora.rank=0"], [*SEPARATE, "trainer.async_mode=bounded"]],
    ids=["one_worker", "separate_two_ranks", "full_two_workers", "bounded"],
)
def test_resolving_the_plan_leaves_the_config_as_loaded(overrides):
    cfg = load_config("tiny_sd3", overrides)
    loaded = copy.deepcopy(cfg)
    resolve_plan(cfg, TOO_BIG)
    assert cfg == loaded and cfg.actor.strategy == "auto"


def test_plan_json_round_trips():
    plan = plan_of("tiny_sd3", [*SEPARATE, "trainer.async_mode=one_step_off"])
    kept = json.loads(json.dumps(plan.to_dict()))
    assert kept["rollout_passes"] == ["default", "reference"] and kept["staleness"] == 1
    assert (
        RunPlan(**{k: tuple(v) if k == "offload" else v for k, v in kept.items() if k != "rollout_passes"})
        == plan
    )
