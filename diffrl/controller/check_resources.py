"""`diffrl check`: rewards, memory and weight sync, through the run's own workers.

- `reward_rows`: each reward of `reward.functions` scores the sampler's pixels through the run's
  scoring path (`MultiReward`, `call_reward`): one finite score per sample; a remote (`http`)
  scorer within its `timeout`.
- `memory_rows`: one micro-batch of each phase at the preset's sizes (sampling at
  `rollout.micro_batch_size`, the old-log-prob recompute and the update at
  `actor.micro_batch_size`, with the optimizer step) on the run's worker; its peak memory against
  this device's.
- `weight_sync_rows` (separate placement): the replicas' weights against the trainer's, by
  sha256 digests of every state-dict tensor (LoRA adapters included), after the first (full) sync
  and again after one update and an adapter-only sync, through `Separate.sync_weights`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from diffrl.config.plan import RunPlan, resolve_plan
from diffrl.config.schema import Config
from diffrl.controller.check_report import CheckRow, fmt, row, skipped
from diffrl.rewards.multi import MultiReward, reward_specs
from diffrl.rewards.registry import base_name
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.transition import Rollout

#: A phase fits when its peak stays below this fraction of the device's memory.
MEMORY_HEADROOM = 0.9


def reward_rows(
    cfg: Config, rollout: Rollout, images: Sequence[Sequence[Any]] | None = None
) -> list[CheckRow]:
    """Each reward on the sampler's decoded samples, as `required` (so a failure shows its cause).
    `images`: the prompts' condition images (image-edit families), each sample's given to the
    rewards as its `sources`, as the run's reward workers get them."""
    if not cfg.reward.functions:
        return [skipped("reward", "reward.functions is empty (offline DPO trains without rewards)")]
    rows = []
    pixels, prompts, metadata = rollout.samples.pixels, rollout.sample_prompts(), rollout.sample_metadata()
    sources = None if images is None else [images[i] for i in rollout.samples.prompt_index_B.tolist()]
    batch = int(pixels.shape[0])
    for spec in reward_specs(cfg.reward.functions):
        name = f"reward {spec.name}"
        memory = _RewardMemory()
        try:
            loading = time.perf_counter()
            reward = MultiReward([replace(spec, required=True)])
            # a remote scorer's deadline for one attempt (`HttpReward.timeout`)
            deadline = reward.rewards[spec.name].timeout if base_name(spec.name) == "http" else None
            start = time.perf_counter()
            load_s = start - loading
            scores_B = reward(pixels, prompts, metadata, sources).scores[spec.name]
        except Exception as err:  # a reward's own failure is this check's finding, not a crash
            cause = err.__cause__ or err
            rows.append(
                row(
                    name,
                    f"raised {type(cause).__name__}",
                    f"{batch} finite scores",
                    False,
                    f"{cause} (reward.functions.{spec.name})",
                )
            )
            continue
        seconds = time.perf_counter() - start
        added_gb = memory.added_gb()
        del reward
        finite = bool(torch.isfinite(scores_B).all())
        ok = scores_B.shape == (batch,) and finite and (deadline is None or seconds <= deadline)
        within = f", <= {deadline:g} s" if deadline is not None else ""
        # what a heavy scorer (a VLM judge) costs: its speed, load time and GPU memory in this process
        cost = f"{batch / seconds:.1f} images/s" if seconds > 0 else ""
        if load_s >= 0.1:
            cost += f", loaded in {load_s:.1f} s"
        if added_gb is not None and added_gb >= 0.01:
            cost += f", +{added_gb:.2f} GB of GPU memory at its peak"
        rows.append(
            row(
                name,
                f"{scores_B.numel()} scores, {'finite' if finite else 'NOT finite'}, {seconds:.2f} s ({cost})",
                f"{batch} finite scores{within}",
                ok,
                f"reward.functions.{spec.name} returned {tuple(scores_B.shape)} scores for {batch} samples"
                + ("" if finite else " with non-finite values")
                + (
                    f" in {seconds:.1f} s, past its timeout of {deadline:g} s"
                    if deadline and seconds > deadline
                    else ""
                ),
            )
        )
    return rows


class _RewardMemory:
    """The CUDA memory a reward adds to this process, from its load to the end of its scoring: the
    peak allocated since it was made, less what was allocated before (None without CUDA, where a
    reward on the CPU shares the process's memory with everything else)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def added_gb(self) -> float | None:
        if not self.cuda:
            return None
        return (torch.cuda.max_memory_allocated() - self.before) / 1e9


def _advantages(cfg: Config, batch: int) -> torch.Tensor:
    """Advantages for the check's one update: standard normal, from a generator of the run's seed
    (the global RNG is left alone)."""
    return torch.randn(batch, generator=torch.Generator().manual_seed(cfg.trainer.seed))


def _capacity(device: torch.device) -> int | None:
    from diffrl.train.parallel import device_memory_bytes

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return device_memory_bytes(1)


def _peak_gb(metrics: dict[str, float], device: torch.device) -> float:
    """The phase's peak from `memory_metrics`: CUDA's reserved memory since the last call, or on
    the CPU the process's peak resident memory so far (an upper bound of the phase's)."""
    if device.type == "cuda":
        return metrics["perf/max_memory_reserved_gb"]
    return metrics["perf/max_rss_gb"]


def measure_phase(
    name: str,
    key: str,
    size: int,
    device: torch.device,
    memory: Callable[[], dict],
    run: Callable[[], Any],
    also: str = "",
) -> tuple[CheckRow, Any]:
    """Run one phase between two `memory` readings; its row, and what `run` returned (None when it
    ran out of memory). `also`: another fix, appended to the row's note when it fails."""
    capacity = _capacity(device)
    memory()  # resets CUDA's peaks
    try:
        result = run()
    except torch.OutOfMemoryError:
        return (
            row(
                f"memory: {name}",
                "out of memory",
                "fits",
                False,
                f"one micro-batch of {size} ran out of memory on {device}: set {key}={max(1, size // 2)} "
                "(or, for the update, model.gradient_checkpointing=true, actor.optimizer_offload=true or "
                "actor.param_offload=true: FSDP2's CPU offload, on one worker too)"
                f"{also}",
            ),
            None,
        )
    peak = _peak_gb(memory(), device)
    what = "peak" if device.type == "cuda" else "peak RSS"
    if capacity is None:
        return row(f"memory: {name}", f"{what} {fmt(peak)} GB", "device size unknown", True), result
    limit = MEMORY_HEADROOM * capacity / 2**30
    return (
        row(
            f"memory: {name}",
            f"{what} {fmt(peak)} GB of {fmt(capacity / 2**30)} GB",
            f"<= {fmt(limit)} GB",
            peak <= limit,
            f"one micro-batch of {size} peaks at {fmt(peak)} GB, past {MEMORY_HEADROOM:.0%} of {device}'s "
            f"{fmt(capacity / 2**30)} GB: set {key}={max(1, size // 2)}{also}",
        ),
        result,
    )


def memory_rows(
    cfg: Config,
    worker: Any,
    prompts: Sequence[str],
    images: Sequence[Any] | None = None,
    *,
    plan: RunPlan | None = None,
) -> list[CheckRow]:
    """Peak memory of one micro-batch of each phase, at the preset's sizes, on `worker` (a
    HybridWorker: the sampler and the engine of a colocated run); `images`: the prompts'
    condition images (image-edit families); `plan`: the run's (its strategy; resolved without the
    machine's facts when not given)."""
    strategy = (plan or resolve_plan(cfg)).strategy
    if cfg.world_size > 1 and strategy == "fsdp2":
        return [
            skipped(
                "memory",
                f"actor.strategy=fsdp2 shards the model over {cfg.world_size} workers; this process holds it "
                "whole, so its peak would not be a worker's (the run logs perf/max_memory_* each step)",
            )
        ]
    device = worker.engine.adapter.device
    n, sample_micro, train_micro = cfg.rollout.n, cfg.rollout.micro_batch_size, cfg.actor.micro_batch_size
    # enough samples for one micro-batch of each phase (the sampler runs rollout.micro_batch_size at a time)
    groups = max(1, -(-max(sample_micro, train_micro) // n))
    batch_prompts = [prompts[i % len(prompts)] for i in range(groups)]
    batch_images = None if images is None else [images[i % len(images)] for i in range(groups)]
    seed = cfg.rollout_seed
    rows = []
    sample_row, rollout = measure_phase(
        "sampling",
        "rollout.micro_batch_size",
        sample_micro,
        device,
        worker.report.memory,
        lambda: worker.rollout.sample(batch_prompts, seed=seed, step=1, images=batch_images),
    )
    rows.append(sample_row)
    if rollout is None:
        return rows
    from diffrl.algos import DIRECT_PREFERENCE, SAMPLES, algorithm

    micro = rollout.select(slice(0, train_micro)).compact()
    advantages_B = _advantages(cfg, len(micro))
    replay = cfg.actor.replay_steps_per_forward
    # batched replay: a forward of the update and of the recompute holds `replay` window steps
    replay_fix = (
        f"; or actor.replay_steps_per_forward={max(1, replay // 2)}: each of these forwards evaluates "
        f"{replay} window steps of the micro-batch at once ({replay} x {len(micro)} samples)"
        if replay > 1
        else ""
    )
    if cfg.algorithm.trainer_type == DIRECT_PREFERENCE:
        if getattr(algorithm(cfg.actor.loss.mode), "trains_on", None) != SAMPLES:
            rows.append(
                skipped(
                    "memory: update",
                    f"actor.loss.mode={cfg.actor.loss.mode} trains on preference pairs, which the check does not "
                    "build yet (the sampling phase is measured)",
                )
            )
            return rows
        from diffrl.train.preference import CleanBatch

        samples = micro.samples
        clean = CleanBatch(
            latents=samples.final_latents,
            cond=micro.sample_cond(),
            advantages_B=advantages_B,
            sample_index_B=samples.sample_index_B,
        )

        def update() -> dict:  # the forward-process loss of NFT / AWM on one micro-batch
            worker.forward_process_backward([clean], seed=seed, step=1, epoch=0)
            return worker.optim_step()

    else:
        if not cfg.reuses_rollout_log_probs or cfg.actor.loss.kl_coef > 0:
            recompute_row, _ = measure_phase(
                "log-prob recompute",
                "actor.micro_batch_size",
                len(micro),
                device,
                worker.report.memory,
                lambda: worker.staging.log_probs(micro),
                also=replay_fix,
            )
            rows.append(recompute_row)
        ref_means = None
        if cfg.actor.loss.kl_coef > 0:
            # the update's KL term needs the reference policy's SDE means, as the run's ref pass
            # computes them (the pass itself costs what the recompute row above measured)
            from diffrl.train.engine import REFERENCE

            ref_means = worker.staging.log_probs(micro, REFERENCE)[1]
        targets = TrainingTargets(advantages_B=advantages_B, ref_means=ref_means, batch_size=[len(micro)])

        def update() -> dict:  # forward and backward over every window step, then AdamW's step
            worker.staging.forward_backward([PolicyGradientBatch(micro, targets)])
            return worker.optim_step()

    update_row, _ = measure_phase(
        "update", "actor.micro_batch_size", len(micro), device, worker.report.memory, update, also=replay_fix
    )
    rows.append(update_row)
    return rows


def _compare_digests(
    check: str, trainer: dict[str, str], replicas: list[dict[str, str]], fix: str
) -> CheckRow:
    lora = sum(1 for k in trainer if "lora" in k)
    differ = sorted(
        {k for d in replicas for k in trainer if d.get(k) != trainer[k]}
        | {k for d in replicas for k in d if k not in trainer}
    )
    return row(
        check,
        f"{len(trainer) - len(differ)}/{len(trainer)} tensors equal ({lora} LoRA) on {len(replicas)} replica(s)",
        "every tensor equal",
        not differ,
        f"{len(differ)} tensor(s) differ between the trainer and a replica, e.g. {differ[:3]}: {fix}",
    )


class _Unscored:
    """The reward sink of the check's rollout on a replica: sampling hands each decoded micro-batch
    to `submit`; the weight-sync rows need no scores (the reward rows score the ODE samples)."""

    def submit(self, pixels: Any, prompts: Any, metadata: Any, sources: Any = None) -> None:
        return None


def weight_sync_rows(
    cfg: Config, placement: Any, records: Sequence[Any]
) -> tuple[list[CheckRow], torch.Tensor, torch.Tensor]:
    """Replicas against the trainer after a full sync, then after one update and a second sync
    (adapters only with LoRA), all through the run's own verbs: `sync_weights`, a replica's
    `sample_and_score`, the trainer's `stage`, `staged_log_probs`, `stage_targets`,
    `staged_forward_backward`, `optim_step`. Returns the rows, and the replica's sampled and the
    trainer's recomputed log-probs [B, W] of the same rollout (with the synced weights)."""
    from diffrl.controller.sharding import prompt_shard

    timeout = cfg.trainer.worker_timeout_s
    fix = (
        "the weight sync did not deliver them (rollout.weight_sync settings, the replicas' LoRA layout); "
        "the replicas would sample with other weights than the trainer trains"
    )
    rows = []
    placement.sync_weights(0)
    trainer = placement.trainer.call("weights.digest")[0]
    replicas = placement.replicas.call("weight_digest")
    rows.append(_compare_digests("weights: replicas = trainer (full sync)", trainer, replicas, fix))
    shard = prompt_shard(records, ["check"] * len(records), 0, cfg.rollout.pipeline.negative_prompt)
    summary, part = placement.replicas.submit(
        0, "sample_and_score", shard, seed=cfg.rollout_seed, step=0, rewards=_Unscored()
    ).result(timeout)
    batch = len(summary)
    placement.trainer.call("stage", [part])
    recomputed, _ = placement.trainer.call("staged_log_probs", slice(0, batch))[0]
    # One update, so the trainer's weights differ from what every replica loaded itself.
    targets = TrainingTargets(advantages_B=_advantages(cfg, batch), batch_size=[batch])
    placement.trainer.call("stage_targets", targets, {})
    placement.trainer.call("staged_forward_backward", [torch.arange(batch)])
    placement.trainer.call("optim_step")
    updated = placement.trainer.call("weights.digest")[0]
    placement.sync_weights(1)
    after = placement.replicas.call("weight_digest")
    changed = sum(1 for k in updated if updated[k] != trainer.get(k))
    sync_kind = "adapters only" if cfg.model.lora.rank > 0 else "full"
    check = f"weights: replicas = trainer (update + {sync_kind} sync)"
    if changed == 0:
        rows.append(
            row(
                check,
                "the update changed no tensor",
                "an update changes the weights",
                False,
                "the trainer's update changed nothing, so the sync cannot be verified: check actor.optim.lr",
            )
        )
    else:
        rows.append(_compare_digests(check, updated, after, fix))
    return rows, summary.log_probs_BW, recomputed
