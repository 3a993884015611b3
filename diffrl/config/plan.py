"""The run plan: every decision the settings leave to the run, made once (DESIGN.md, "The run plan").

`load_config` gives the user's settings; `resolve_plan(cfg, machine)` turns them, with the facts
of the machine and the model (`Machine`: the accelerator, one device's memory, the pipeline's
weight bytes, the model family's GPU training attention), into a frozen `RunPlan`:

    strategy        actor.strategy, `auto` resolved (`choose_strategy`: the world size, LoRA or
                    full fine-tuning, the weights against one device's memory)
    passes          where sampling, the old log-probs and the reference pass run: the rollout's
                    own log-probs reused, or recomputed on the trainer ranks or on the replicas
                    (separate placement, rollout.log_prob_passes: `rollout_passes`); the rule
                    for the old log-probs is `old_log_probs_source`
    staleness       K, the weight versions a trained batch may lag: 0 sync, 1 one_step_off,
                    trainer.max_staleness bounded
    attn_backend    model.attn_backend, `auto` resolved (the family's GPU training backend on a
                    GPU, torch's default `native` elsewhere)
    compile, offload, weight_sync_backend   as configured, `auto` resolved
    fp8             model.fp8 (checked against the machine: `check_fp8`)

The config is never changed: every worker and loop reads these decisions from the plan. A setting
that would have no effect under the plan is refused here (a ConfigError naming the fix), as the
config's own checks refuse the ones that need no plan. The run prints the plan (`lines`) as one
block after its first line and keeps it as RUN/plan.json (`to_dict`). Stdlib only, like the rest
of the config: the controller gathers the machine's facts (diffrl.controller.preflight.run_plan).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from diffrl.config.checks import ConfigError
from diffrl.config.registries import DIRECT_PREFERENCE, POLICY_GRADIENT, algorithm
from diffrl.config.sections.actor import ActorConfig

#: File of the run directory that keeps the plan of the run's latest start.
PLAN_FILE = "plan.json"

#: Replicate a LoRA run when the whole pipeline's weights take at most this share of one device's
#: memory: the rest holds the activations of sampling and training micro-batches. In bf16 on an
#: 80 GB card this replicates SD3.5 (about 16 GB with its text encoders) and FLUX.1 (34 GB with
#: T5-XXL), and shards Qwen-Image (57 GB) and Wan2.1-14B (39 GB with umT5-XXL).
REPLICATE_MAX_WEIGHT_SHARE = 0.45

STRATEGIES = ActorConfig.STRATEGIES

# The reason's tail for FSDP2 on one worker.
ONE_RANK = "one worker: FSDP2 on a one-rank group"
OFFLOADED = ", its parameters in host memory between uses"

# Where a pass runs (RunPlan.old_log_probs / .reference).
ROLLOUT = "rollout"  # the old log-probs are the rollout's own, computed while sampling
TRAINER = "trainer"
REPLICAS = "replicas"
NONE = "none"


@dataclass(frozen=True)
class Machine:
    """The facts a plan is resolved against, gathered before any worker starts. None: unknown
    (an engine or a test built without them); `choose_strategy` then decides without the sizes."""

    accelerator: str = "cpu"  # cuda when the workers get GPUs, else cpu
    device_bytes: int | None = None  # one device's memory (a CPU worker's share of the host's)
    weight_bytes: int | None = None  # the pipeline's weights in model.dtype (safetensors headers)
    # the model family's attention backend for training on a GPU (ModelAdapter.gpu_training_attn_backend)
    gpu_attn_backend: str | None = None


@dataclass(frozen=True)
class StrategyChoice:
    strategy: str  # ddp, fsdp2 or none
    reason: str

    def line(self) -> str:
        return f"parallelism: actor.strategy={self.strategy} ({self.reason})"


def choose_strategy(
    requested: str,
    *,
    world_size: int,
    lora: bool,
    sequence_parallel: bool = False,
    param_offload: bool = False,
    weight_bytes: int | None = None,
    device_bytes: int | None = None,
) -> StrategyChoice:
    """Resolve `actor.strategy` (the cheapest parallelism that fits; diffrl.train.parallel says
    what each does). `weight_bytes`: the pipeline's parameters in the model's dtype;
    `device_bytes`: one device's memory; None where unknown. `param_offload` (actor.param_offload)
    is FSDP2's CPU offload, so it makes any number of workers shard: one worker runs FSDP2 on a
    one-rank group of its own (diffrl.train.distributed.join_one_rank_group)."""
    if requested not in STRATEGIES:
        raise ValueError(f"actor.strategy={requested!r} is not one of {', '.join(STRATEGIES)}")
    if requested != "auto":
        if requested == "fsdp2" and world_size == 1:
            return StrategyChoice(requested, f"set by actor.strategy; {ONE_RANK}{OFFLOADED * param_offload}")
        return StrategyChoice(requested, "set by actor.strategy")
    if world_size == 1:
        if param_offload:
            return StrategyChoice(
                "fsdp2", f"actor.param_offload is FSDP2's CPU offload; {ONE_RANK}{OFFLOADED}"
            )
        return StrategyChoice("none", "one worker: nothing to replicate or shard")
    if not lora:
        return StrategyChoice(
            "fsdp2", "full fine-tuning: weights, gradients and AdamW state are sharded over the workers"
        )
    if sequence_parallel:
        return StrategyChoice("fsdp2", "sequence parallelism shards the model with FSDP2")
    if param_offload:
        return StrategyChoice("fsdp2", "actor.param_offload: FSDP2 keeps its shards in host memory")
    if weight_bytes is not None and device_bytes is not None:
        share = weight_bytes / device_bytes
        sizes = f"{_size(weight_bytes)} of weights on a {_size(device_bytes)} device"
        if share > REPLICATE_MAX_WEIGHT_SHARE:
            return StrategyChoice(
                "fsdp2",
                f"LoRA, but {sizes} ({share:.0%} > {REPLICATE_MAX_WEIGHT_SHARE:.0%}): the frozen base is sharded",
            )
        return StrategyChoice(
            "ddp",
            f"LoRA on a model that fits one device ({sizes}): each worker holds the frozen base, only "
            "the adapters' gradients are averaged",
        )
    return StrategyChoice(
        "ddp", "LoRA: each worker holds the frozen base, only the adapters' gradients are averaged"
    )


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class RunPlan:
    """Every decision of one run (module docstring). Frozen: nothing changes it once resolved."""

    job: str  # train, sft or eval
    world_size: int  # trainer workers (trainer.n_gpus_per_node × trainer.nnodes)
    strategy: str  # ddp, fsdp2 or none
    strategy_reason: str
    placement: str  # colocated or separate
    replicas: int  # rollout replicas (separate placement), 0 colocated
    staleness: int  # K: 0 sync, 1 one_step_off, trainer.max_staleness bounded
    old_log_probs: str  # rollout (reused), trainer, replicas, or none (no PPO ratio)
    reference: str  # where the reference pass runs: trainer, replicas, or none
    attn_backend: str  # the attention backend the workers train and sample with
    compile: bool  # torch.compile of the transformer blocks (model.compile)
    offload: tuple[str, ...]  # what lives in host memory: param (FSDP2's), optimizer, activation
    weight_sync_backend: str | None  # separate placement: nccl or gloo; None colocated
    fp8: str = "none"  # model.fp8: float8 GEMMs for none, the sampler's passes (sampling) or all passes

    @property
    def reuses_rollout_log_probs(self) -> bool:
        """Whether PPO's old log-probs are the rollout's own (`Config.reuses_rollout_log_probs`)."""
        return self.old_log_probs == ROLLOUT

    @property
    def rollout_passes(self) -> tuple[str, ...]:
        """The passes without gradient the rollout replicas run: `default` (the recomputed old
        log-probs) and `reference` (the KL reference's means), in that order, or none."""
        return tuple(
            name
            for name, where in (("default", self.old_log_probs), ("reference", self.reference))
            if where == REPLICAS
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as RUN/plan.json keeps it (tuples as lists)."""
        out = asdict(self)
        out["offload"] = list(self.offload)
        out["rollout_passes"] = list(self.rollout_passes)
        return out

    def lines(self) -> list[str]:
        """The block the run prints at start: one line per kind of decision."""
        workers = f"{self.world_size} worker{'s' if self.world_size > 1 else ''}"
        if self.placement == "separate":
            where = (
                f"separate: {workers} train, {self.replicas} replica{'s' if self.replicas > 1 else ''} sample"
            )
            where += f" (weight sync {self.weight_sync_backend})"
        else:
            where = f"colocated: {workers} sample and train"
        passes = {ROLLOUT: "the rollout's own", TRAINER: "recomputed on the trainer", NONE: "none"}
        passes[REPLICAS] = "recomputed on the replicas"
        return [
            f"plan: {where}; staleness K={self.staleness}",
            f"  parallelism: actor.strategy={self.strategy} ({self.strategy_reason})",
            f"  old log-probs: {passes[self.old_log_probs]}; reference pass: {self.reference}",
            f"  attention {self.attn_backend}, compile {'on' if self.compile else 'off'}, "
            f"offload {'+'.join(self.offload) or 'none'}"
            + (f", fp8 {self.fp8}" if self.fp8 != "none" else ""),
        ]


def staleness(cfg: Any) -> int:
    """K, the weight versions a trained batch may lag the weights its step starts from."""
    mode = cfg.trainer.async_mode
    return {"sync": 0, "one_step_off": 1}.get(mode, cfg.trainer.max_staleness)


def attention_backend(setting: str, accelerator: str, gpu_backend: str | None) -> str:
    """`model.attn_backend`: `auto` is the family's GPU training backend on a GPU
    (`gpu_training_attn_backend`: FLUX's flash attention, since torch's default picks cuDNN on
    H100/H200, whose backward failed FLUX's training) and torch's default (`native`) elsewhere."""
    if setting != "auto":
        return setting
    if accelerator == "cuda" and gpu_backend is not None:
        return gpu_backend
    return "native"


#: Parts of the attention backends' names that run CUDA kernels only (flash-attn, SageAttention,
#: xformers, and the `*_hub` kernels that `kernels` fetches from the Hugging Face Hub).
CUDA_ONLY_ATTENTION = ("flash", "sage", "xformers", "_hub")


def check_attention_backend(backend: str, accelerator: str = "cuda") -> None:
    """A ConfigError when diffusers cannot run attention backend `backend` here (its package is
    missing or too old: flash-attn, sage, kernels; a CUDA-only kernel on a run without a GPU; a
    `*_hub` kernel with the Hub switched off), found before any model loads rather than as a
    traceback from the first forward. diffusers' own requirement check decides the packages;
    torch's default (`native` and the `_native_*` variants) needs nothing."""
    if backend == "native" or backend.startswith("_native"):
        return
    if accelerator != "cuda" and any(part in backend for part in CUDA_ONLY_ATTENTION):
        raise ConfigError(
            f"model.attn_backend={backend!r} runs CUDA kernels only, and this run has no GPU "
            f"({accelerator}): set model.attn_backend=auto (torch's own attention)"
        )
    if backend.endswith("_hub") and os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in (
        "1",
        "true",
        "yes",
    ):
        raise ConfigError(
            f"model.attn_backend={backend!r} downloads its kernel from the Hugging Face Hub, and "
            "HF_HUB_OFFLINE is set: use the backend's local package (e.g. model.attn_backend=flash "
            "with flash-attn installed) or model.attn_backend=auto"
        )
    from diffusers.models import attention_dispatch

    check = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    if check is None:  # a diffusers without the check: its first forward will say
        return
    try:
        check(attention_dispatch.AttentionBackendName(backend))
    except RuntimeError as err:
        raise ConfigError(
            f"model.attn_backend={backend!r} cannot run on this machine: {err} Or set "
            "model.attn_backend=auto (torch's own attention, or the family's tested GPU backend)"
        ) from None


def weight_sync_backend(cfg: Any, accelerator: str) -> str:
    """`rollout.weight_sync.backend`, `auto` resolved: NCCL needs every member on its own GPU, so
    replicas that share a GPU with the trainer (a GPU share below 1) or CPU workers use gloo."""
    chosen = cfg.rollout.weight_sync.backend
    if chosen != "auto":
        return chosen
    own_gpus = cfg.trainer.gpus_per_worker >= 1 and cfg.rollout.gpus_per_replica >= 1
    return "nccl" if accelerator == "cuda" and own_gpus else "gloo"


def request_size(cfg: Any) -> int:
    """Samples in one replica request: whole prompt groups of one sampler micro-batch."""
    return max(1, cfg.rollout.micro_batch_size // cfg.rollout.n) * cfg.rollout.n


def replica_passes(cfg: Any, strategy: str) -> tuple[str, ...]:
    """The passes without gradient that the rollout replicas run (`rollout.log_prob_passes`):
    `default` (the recomputed old log-probs) and `reference` (the KL reference's means), or none:
    they then run on the trainer ranks.

    `auto` moves them when the replica computes bitwise what the trainer would: separate
    placement, policy-gradient training, requests that split into the trainer's micro-batches.
    The old log-probs move only when the trainer computes with the weights' own dtypes (one
    rank unsharded, or ddp): FSDP2's mixed precision (also on a one-rank group) casts the fp32 LoRA weights to the compute dtype,
    the replica does not; and, compiled, only with LoRA: the trainer recomputes them through
    its training graph, which a replica traces only with its trained adapter requiring grad
    (full fine-tuning would need every weight to). The reference pass (LoRA: the adapters
    disabled, the base weights in their own dtype on both sides) moves whenever LoRA is on; full
    fine-tuning keeps its frozen reference copy on the trainer only. With trainer.async_mode=bounded
    the old log-probs stay on the trainer: the replicas receive the weights the update starts from
    only after sampling the batches already in flight, so a pass there would stall the update."""
    choice = cfg.rollout.log_prob_passes
    if (
        choice == "trainer"
        or cfg.trainer.placement != "separate"
        or cfg.algorithm.trainer_type != POLICY_GRADIENT
    ):
        return ()
    if choice == "auto" and request_size(cfg) % cfg.actor.micro_batch_size:
        return ()
    passes = []
    # compiled, the trainer recomputes through its training graph, which a replica runs too
    # only with LoRA (workers.rollout_worker.computes_as_trained)
    unsharded = (cfg.world_size == 1 and strategy != "fsdp2") or strategy == "ddp"
    exact = unsharded and (not cfg.model.compile or cfg.model.lora.rank > 0)
    bounded = cfg.trainer.async_mode == "bounded"
    if not cfg.reuses_rollout_log_probs and not bounded and (choice == "rollout" or exact):
        passes.append("default")
    if cfg.actor.loss.kl_coef > 0 and cfg.model.lora.rank > 0:
        passes.append("reference")
    return tuple(passes)


def old_log_probs_source(cfg: Any, job: str = "train", passes: tuple[str, ...] = ()) -> str:
    """Where PPO's old log-probs come from: the one rule (RunPlan.old_log_probs).

    - `none`: no PPO ratio (a job other than RL training, or a loss of the forward process:
      NFT, AWM, DPO, which compute no old log-probs);
    - `rollout`: the rollout's own, computed by the sampler while it samples, when they are what
      the update's first forward computes bit for bit (`Config.reuses_rollout_log_probs`:
      algorithm.old_log_probs=rollout, or `auto` on a colocated run whose sampler slices its
      window steps as the trainer's micro-batches, no step subsets, no rollout correction, no
      batched replay, no merged LoRA);
    - `replicas`: recomputed by the rollout replicas right after sampling or after the sync of
      the weights the update starts from (separate placement, `replica_passes`: `default` among
      `passes`);
    - `trainer`: recomputed on the trainer ranks, with the weights the update starts from.

    Recomputed, both places run one function (diffrl.train.policies.window_log_probs) in the
    trainer's micro-batches. The sampler computes its window steps at the trainer's micro-batch
    only when the rollout's log-probs are reused (`rollout`)."""
    if job != "train" or cfg.algorithm.trainer_type != POLICY_GRADIENT:
        return NONE
    if cfg.reuses_rollout_log_probs:
        return ROLLOUT
    return REPLICAS if "default" in passes else TRAINER


def _reference(cfg: Any, job: str, on_replicas: bool) -> str:
    if job != "train":
        return NONE
    if on_replicas:
        return REPLICAS
    spec = algorithm(cfg.actor.loss.mode)
    always = cfg.algorithm.trainer_type == DIRECT_PREFERENCE and getattr(spec, "needs_reference", False)
    return TRAINER if cfg.actor.loss.kl_coef > 0 or always else NONE


def resolve_plan(cfg: Any, machine: Machine | None = None, *, job: str = "train") -> RunPlan:
    """The plan of `cfg` (a validated `Config`, not changed) on `machine` for `job` (train, sft or
    eval); a ConfigError for a setting that has no effect under it (`check_plan`)."""
    machine = machine or Machine()
    world, lora = cfg.world_size, cfg.model.lora.rank > 0
    actor = cfg.actor
    choice = choose_strategy(
        actor.strategy,
        world_size=world,
        lora=lora,
        sequence_parallel=actor.sequence_parallel_size > 1,
        param_offload=actor.param_offload,
        weight_bytes=machine.weight_bytes,
        device_bytes=machine.device_bytes,
    )
    rl = job == "train"
    separate = rl and cfg.trainer.placement == "separate"
    passes = replica_passes(cfg, choice.strategy) if rl else ()
    old = old_log_probs_source(cfg, job, passes)
    offload = tuple(
        name
        for name, on in (
            ("param", actor.param_offload),
            ("optimizer", actor.optimizer_offload),
            ("activation", actor.activation_offload),
        )
        if on
    )
    plan = RunPlan(
        job=job,
        world_size=world,
        strategy=choice.strategy,
        strategy_reason=choice.reason,
        placement="separate" if separate else "colocated",
        replicas=cfg.rollout.replicas if separate else 0,
        staleness=staleness(cfg) if rl else 0,
        old_log_probs=old,
        reference=_reference(cfg, job, "reference" in passes),
        attn_backend=attention_backend(cfg.model.attn_backend, machine.accelerator, machine.gpu_attn_backend),
        compile=cfg.model.compile,
        offload=offload,
        weight_sync_backend=weight_sync_backend(cfg, machine.accelerator) if separate else None,
        fp8=cfg.model.fp8,
    )
    check_attention_backend(plan.attn_backend, machine.accelerator)
    check_fp8(cfg, plan, machine.accelerator)
    if rl:
        check_plan(cfg, plan)
    return plan


#: The torchao release `model.fp8` is built and tested with: the latest on PyPI, built for torch
#: 2.11 and newer (its compiled extensions load on torch >= 2.11), which the GPU machines' 2.11 and
#: the CPU's 2.13 both run. pyproject.toml's `fp8` extra asks for it.
FP8_TORCHAO = "0.18.0"
FP8_INSTALL = f"pip install torchao=={FP8_TORCHAO} (or pip install 'diffrl[fp8]')"


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def torchao_problem(mode: str) -> str | None:
    """Why `model.fp8=mode` cannot run in this Python: torchao missing or older than
    `FP8_TORCHAO` (a sentence naming the install command), or None. Looks torchao up without
    importing it."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return f"model.fp8={mode} needs torchao, which is not installed: {FP8_INSTALL}, or set model.fp8=none"
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None  # a source checkout on the path: its version is unknown, take it as it is
    if _release(version) < _release(FP8_TORCHAO):
        return (
            f"model.fp8={mode} needs torchao {FP8_TORCHAO} or newer (the release built for torch >= 2.11), "
            f"but torchao {version} is installed: {FP8_INSTALL}, or set model.fp8=none"
        )
    return None


def check_fp8(cfg: Any, plan: RunPlan, accelerator: str) -> None:
    """`model.fp8` against the machine and the plan, before any worker starts: float8 GEMMs need
    a GPU (the worker checks its compute capability, diffrl.train.fp8.check_device), and torchao
    for full fine-tuning or FSDP2;
    sampling in float8 while the trainer computes in 16 bits makes the rollout's log-probs other
    than the trainer's, so they cannot serve as PPO's old ones."""
    mode = cfg.model.fp8
    if mode == "none":
        return
    if accelerator != "cuda":
        raise ConfigError(
            f"model.fp8={mode} runs float8 GEMMs on a GPU with float8 tensor cores (compute capability "
            f"8.9 or newer: L4, L40S, H100, H200, B200), but this run's workers have no GPU "
            f"(accelerator {accelerator}): set model.fp8=none"
        )
    # a frozen base casts once with torch's own float8 GEMM; torchao's training linear serves
    # trained weights (full fine-tuning) and sharded ones (diffrl.train.fp8)
    if cfg.model.lora.rank == 0 or plan.strategy == "fsdp2":
        problem = torchao_problem(mode)
        if problem:
            raise ConfigError(problem)
    if mode == "sampling" and plan.reuses_rollout_log_probs:
        raise ConfigError(
            "model.fp8=sampling with algorithm.old_log_probs=rollout: the sampler's float8 GEMMs give "
            "velocities other than the trainer's 16-bit ones, so the rollout's SDE log-probabilities are "
            "not the trainer's and PPO's ratio would start off 1. Set algorithm.old_log_probs=auto (it "
            "recomputes them as the update runs), or model.fp8=all (sampler and trainer both in float8)"
        )


def check_plan(cfg: Any, plan: RunPlan) -> None:
    """Settings of an RL run that would do nothing, or compute the wrong thing, under `plan`."""
    lora = cfg.model.lora
    if not lora.merge_inference:
        return
    if lora.rank <= 0:
        raise ConfigError(
            "model.lora.merge_inference=true needs LoRA adapters to merge, but model.lora.rank=0 (full "
            "fine-tuning samples with the trained weights as they are): set model.lora.merge_inference=false"
        )
    if plan.reuses_rollout_log_probs:
        raise ConfigError(
            "model.lora.merge_inference=true with algorithm.old_log_probs=rollout: merged weights give "
            "velocities that differ from the trained adapter's in the last bits, so the rollout's SDE "
            "log-probabilities are not the trainer's, and PPO's ratio would start off 1 (a clip range "
            "of 1e-4 sees that). Set algorithm.old_log_probs=auto (it recomputes them with the adapter, "
            "as the update runs it), or model.lora.merge_inference=false"
        )
    if cfg.algorithm.trainer_type != DIRECT_PREFERENCE and plan.placement == "separate":
        raise ConfigError(
            "model.lora.merge_inference=true with a policy-gradient loss and trainer.placement=separate: "
            "the replicas' passes without gradient (rollout.log_prob_passes) must run the adapter as the "
            "trainer's update does, which merged weights do not. Set model.lora.merge_inference=false, "
            "or trainer.placement=colocated"
        )
    if plan.strategy == "fsdp2":
        over = f"over {plan.world_size} workers" if plan.world_size > 1 else "on a one-rank group"
        fix = (
            "actor.strategy=ddp (replicated weights)"
            if plan.world_size > 1
            else "actor.strategy=auto or none"
        )
        if cfg.actor.param_offload:
            fix = "actor.param_offload=false with " + fix
        raise ConfigError(
            f"model.lora.merge_inference=true needs unsharded weights, but actor.strategy=fsdp2 shards them "
            f"{over}: set {fix}, or model.lora.merge_inference=false"
        )


__all__ = [
    "FP8_TORCHAO",
    "PLAN_FILE",
    "REPLICATE_MAX_WEIGHT_SHARE",
    "STRATEGIES",
    "Machine",
    "RunPlan",
    "StrategyChoice",
    "attention_backend",
    "check_attention_backend",
    "check_fp8",
    "choose_strategy",
    "old_log_probs_source",
    "replica_passes",
    "request_size",
    "resolve_plan",
    "staleness",
    "torchao_problem",
    "weight_sync_backend",
]
