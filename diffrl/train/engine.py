"""The training engine: one model adapter's transformer, its LoRA adapters, optimizer and updates.

Every algorithm's backward passes go through one routine, `accumulate`: a list of gradient terms
(a forward returning a loss, and the term's share of the optimizer step's mean), backward each,
gradient sync only after the last. The policy-gradient terms are built here from
`PolicyGradientBatch` micro-batches (rollout slices with the controller's training targets):

    for each micro-batch, for each trained window step j:
        recompute velocity -> SDE mean, std, log-prob of the stored x_{j+1}   (transition.evaluate_step)
        loss = registered loss (+ kl_coef · KL to the reference)
        backward(loss / (micro-batches × window steps))
    optim_step(): clip, skip if the gradient norm is not finite, AdamW, LR schedule

With `actor.replay_steps_per_forward` = k > 1 a micro-batch's steps run k at a time, as one
forward of k·B rows and one backward (batched replay: diffrl.train.replay).

The forward-process losses (NFT, AWM, DPO: diffrl.train.preference) and supervised flow matching
(`flow_matching_backward`) build their own terms.

Policies (diffrl.train.policies): LoRA "default" (trained), optional "old" (a frozen copy refreshed
by copy or EMA, for DiffusionNFT-style methods), and the reference = all adapters disabled. With
`model.lora.rank = 0` the whole transformer trains and the reference, when KL needs it, is a frozen
copy. `log_probs` is the one log-prob pass (`policies.window_log_probs`), which replicas run too.

The same engine runs on one CPU, one GPU, or over a process group (one engine per rank, each on its
own micro-batches): replicated (`actor.strategy=ddp`: gradients averaged across ranks right before
each optimizer step) or sharded with FSDP2 (FSDP averages them), also on one worker (a one-rank
group); diffrl.train.parallel.

Memory (diffrl.train.offload; docs/performance.md, "Memory: offload options"): `to(device, model=, optimizer=, grad=)`
moves the transformer, the AdamW state and the gradients between host and accelerator by hand;
`actor.optimizer_offload` keeps the AdamW state in host memory except during `optimizer.step()`;
`actor.activation_offload` keeps what autograd saves for backward in pinned host memory
(`torch.autograd.graph.save_on_cpu`) during the training forwards; `actor.param_offload` is
FSDP2's own CPU offload (diffrl.train.fsdp), on any number of workers.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path

import torch

from diffrl.algos import KLLoss, PolicyGradientSpec, algorithm
from diffrl.algos.flow_matching import flow_matching_loss, interpolate
from diffrl.config.plan import choose_strategy
from diffrl.config.schema import ActorConfig, ModelConfig
from diffrl.models.base import ModelAdapter
from diffrl.sde import StepOut
from diffrl.train import offload, parallel, policies
from diffrl.train.batch import PolicyGradientBatch
from diffrl.train.lora import inject_lora, merged_adapter
from diffrl.train.optim import adamw, lr_lambda
from diffrl.train.parallel import average_gradients
from diffrl.train.policies import OLD, POLICY, REFERENCE, use_policy, window_log_probs
from diffrl.train.replay import StepPart, loss_inputs, replay_plan, weighted_mean
from diffrl.train.terms import NUM_TRAIN_TIMESTEPS, FlowMatchingBatch, GradientTerm
from diffrl.transition import Rollout, evaluate_step, evaluate_steps


class TrainEngine:
    """Policy updates for one model adapter (see the module docstring)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        model_cfg: ModelConfig,
        actor_cfg: ActorConfig,
        *,
        total_optim_steps: int,
        with_old: bool = False,
        with_reference: bool | None = None,
        seed: int = 0,
        strategy: str | None = None,
    ):
        """`strategy`: the run plan's (diffrl.config.plan.RunPlan.strategy: ddp, fsdp2 or none); an
        engine built without one (a test, a benchmark, an export) takes actor.strategy, `auto`
        resolved by the plan's rule for this process group's size."""
        self.adapter = adapter
        self.model_cfg = model_cfg
        self.cfg = actor_cfg
        spec = algorithm(actor_cfg.loss.mode)
        self.loss_fn = spec.loss()
        self.kl_fn = KLLoss() if actor_cfg.loss.kl_coef > 0 else None
        self.needs_old_mean = isinstance(spec, PolicyGradientSpec) and spec.needs_old_mean
        self.lora = model_cfg.lora.rank > 0
        self.optim_steps = 0
        self.skipped_steps = 0
        # The accelerator this engine trains on ("device" in `to`); the CPU for a CPU run.
        self.device = torch.device(adapter.device)
        transformer = adapter.transformer
        transformer.train()

        self.reference = None
        if self.lora:
            # the trained adapter's weights come out fp32: AdamW's master weights
            inject_lora(adapter, model_cfg.lora, [POLICY, OLD] if with_old else [POLICY], seed=seed)
            if with_old:
                self.copy_adapter(POLICY, OLD)
        else:
            if with_old:
                raise ValueError("an `old` policy needs LoRA adapters: set model.lora.rank > 0")
            transformer.requires_grad_(True)
            if with_reference if with_reference is not None else actor_cfg.loss.kl_coef > 0:
                # A frozen copy of the base weights, on the same device.
                self.reference = copy.deepcopy(transformer).requires_grad_(False).eval()
        if model_cfg.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        if strategy is None:
            in_group = torch.distributed.is_initialized()
            strategy = choose_strategy(
                actor_cfg.strategy,
                world_size=torch.distributed.get_world_size() if in_group else 1,
                lora=self.lora,
                sequence_parallel=actor_cfg.sequence_parallel_size > 1,
                param_offload=actor_cfg.param_offload,
            ).strategy
        self.strategy = strategy
        if model_cfg.fp8 != "none":  # after LoRA (only base layers convert), before sharding and compile
            from diffrl.train import fp8

            fp8.prepare(
                adapter,
                model_cfg.fp8,
                scaling=model_cfg.fp8_scaling,
                # sharded, a frozen layer casts per call: whole float8 copies would sit on every rank
                cast_once=strategy != "fsdp2",
                reference=self.reference,
            )
        # ddp: every rank holds the whole model and averages the gradients before each optimizer
        # step; fsdp2: sharded over the group, or a one-rank group of this process on one worker
        shared = parallel.prepare(adapter, strategy, param_offload=actor_cfg.param_offload)
        self._replicated, self._keep_gathered = shared.replicated, shared.keep_gathered
        # A sampler sharing this module computes its SDE window steps on slices of this size, as
        # the trainer re-evaluates them (TrajectorySampler._trained_slices).
        adapter.train_micro_batch_size = actor_cfg.micro_batch_size
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters: check model.lora.target_modules")
        self.optimizer, self.scheduler = adamw(self.params, actor_cfg.optim, total_optim_steps)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.adapter.transformer

    # ------------------------------------------------------------------------------ policies
    def use_policy(self, name: str) -> AbstractContextManager[None]:
        """Run the adapter's transformer as policy `name`: default, old, or reference
        (`diffrl.train.policies.use_policy`)."""
        return use_policy(self.adapter, name, lora=self.lora, reference=self.reference)

    @contextmanager
    def inference_policy(self, name: str) -> Iterator[None]:
        """`use_policy(name)` for forward passes without gradients: with
        model.lora.merge_inference the trained or old adapter runs merged into the weights. A
        sharded model that stays gathered through the pass is resharded at its end."""
        if self.lora and self.model_cfg.lora.merge_inference and name in (POLICY, OLD):
            policy = merged_adapter(self.adapter, name)
        else:
            policy = self.use_policy(name)
        with self._resharded_after(), policy:
            yield

    def _resharded_after(self) -> AbstractContextManager[None]:
        from diffrl.train.fsdp import resharded_after

        return resharded_after(self.transformer, enabled=self._keep_gathered)

    def copy_adapter(self, src: str = POLICY, dst: str = OLD) -> None:
        """dst ← src on every LoRA tensor."""
        policies.copy_adapter(self.transformer, src, dst)

    def ema_adapter(self, decay: float, src: str = POLICY, dst: str = OLD) -> None:
        """dst ← decay·dst + (1 − decay)·src on every LoRA tensor (decay 0 = copy)."""
        policies.ema_adapter(self.transformer, decay, src, dst)

    def adapters_equal(self, a: str = POLICY, b: str = OLD) -> bool:
        """Whether adapters `a` and `b` hold identical weights on every rank (`policies.adapters_equal`)."""
        return self.lora and policies.adapters_equal(self.transformer, a, b, self.device)

    # ------------------------------------------------------------------------------ updates
    def accumulate(
        self,
        terms: Sequence[GradientTerm],
        *,
        metrics_divisor: float = 1.0,
        padding: Callable[[], tuple[torch.Tensor, dict[str, float]]] | None = None,
    ) -> dict[str, float]:
        """Accumulate the gradient of one worker's share of an optimizer step: every algorithm's
        backward passes go through here.

        The gradient is Σ grad_scale · ∇loss over the terms; under FSDP2 it is reduced across ranks
        only after the last backward. Returns Σ metric_weight · metric / metrics_divisor for the
        loss and each metric a term reports (terms with metric_weight None are not counted).

        Under FSDP2 every forward and backward is a collective (all-gathers, the last backward's
        reduce-scatter), so all ranks must run as many terms: a rank with fewer would wait for its
        peers until the process group times out. The ranks therefore agree on the largest count
        (one all-reduce of one integer) and each pads its list with `padding` (default: its first
        term's forward) at grad_scale 0 and metric_weight None: a forward and backward over real
        data, so every collective happens, adding an exact zero to the gradient and nothing to
        the metrics.

        With `actor.activation_offload` each forward runs under `save_on_cpu`: what autograd saves
        for backward goes to pinned host memory and comes back when backward needs it.
        """
        terms = self._pad_to_peers(terms, padding)
        sums: dict[str, float] = defaultdict(float)
        # on the device to the end: reading the loss after each backward would stall the next forward
        loss_sum: torch.Tensor | None = None
        for index, term in enumerate(terms):
            self._sync_gradients(index == len(terms) - 1)
            with offload.saved_tensors_offload(self.cfg.activation_offload):
                loss, metrics = term.forward()
            (loss * term.grad_scale).backward()
            if term.metric_weight is None:
                continue
            weighted = loss.detach().double() * term.metric_weight  # the host's float64 math, in order
            loss_sum = (0.0 if loss_sum is None else loss_sum) + weighted  # 0.0 + -0.0 is 0.0, as before
            for key, value in metrics.items():
                sums[key] += value * term.metric_weight
        if loss_sum is not None:
            sums = {"loss": float(loss_sum), **sums}  # first, as the metrics have always listed it
        return {key: value / metrics_divisor for key, value in sums.items()}

    def forward_backward(
        self, micro_batches: Sequence[PolicyGradientBatch], window_steps: Sequence[int] | None = None
    ) -> dict[str, float]:
        """Accumulate the policy-gradient loss of one mini-batch; returns its metrics, weighted as the
        gradient is (the mean over micro-batches of the mean over their (sample, trained step) pairs)
        and averaged over ranks.

        Each micro-batch is a rollout slice with its training targets (`PolicyGradientBatch`): the
        advantages; old log-probs default to the rollout's own (same weights, same math), or the
        recomputed ones; old SDE means (GRPO-Guard, Flow-DPPO) likewise default to the rollout's
        `means`; KL needs `ref_means`. `weights_BW` (rollout correction) multiplies each sample's
        term. `train_mask_BW` (DanceGRPO's per-sample step subsets) restricts each window step to
        the samples that train it: every sample then trains K of the W steps, and the gradient is
        normalised by K, so its scale does not depend on the fraction. Ranks whose masks give them
        fewer (micro-batch, step) terms pad up to their peers' count (`accumulate`), so FSDP2's
        collectives pair up. `window_steps` selects the trained steps (all by default).
        """
        if not micro_batches:
            raise ValueError("forward_backward needs at least one micro-batch")
        steps = list(range(micro_batches[0].window_size)) if window_steps is None else list(window_steps)
        if not steps:
            raise ValueError("no window steps to train: the rollouts were sampled without an SDE window")
        if self.kl_fn is not None and any(mb.targets.ref_means is None for mb in micro_batches):
            raise ValueError("KL is on (actor.loss.kl_coef > 0) but the micro-batch has no ref_means")
        plan = replay_plan(micro_batches, steps, self.cfg.replay_steps_per_forward)
        terms = []
        for forward in plan:
            if len(forward.parts) == 1:
                part = forward.parts[0]
                loss = partial(self._step_loss, part.batch, part.step)
            else:
                loss = partial(self._steps_loss, forward.parts)
            # metrics weighted as the gradient is: the mean over (sample, trained step) pairs
            terms.append(GradientTerm(loss, forward.share, metric_weight=forward.share))
        # With step subsets (DanceGRPO) ranks can have different numbers of terms: a peer with more
        # gets padding, the smallest real computation there is (one sample at a step it trains).
        first = plan[0].parts[0]
        padding = partial(self._step_loss, first.batch.select(slice(0, 1)), first.step)
        metrics = self.accumulate(terms, metrics_divisor=sum(t.metric_weight for t in terms), padding=padding)
        return self._reduce(metrics)

    def _step_loss(self, mb: PolicyGradientBatch, j: int) -> tuple[torch.Tensor, dict]:
        """The policy loss (+ KL) of window step j on micro-batch `mb`, averaged over its samples."""
        return self._policy_loss(mb, j, evaluate_step(self.adapter, mb.rollout, j))

    def _steps_loss(self, parts: Sequence[StepPart]) -> tuple[torch.Tensor, dict]:
        """The share-weighted mean of several parts' `_step_loss`, from one transformer forward
        (batched replay, diffrl.train.replay)."""
        outs = evaluate_steps(self.adapter, [(part.batch.rollout, part.step) for part in parts])
        results = [
            self._policy_loss(part.batch, part.step, out) for part, out in zip(parts, outs, strict=True)
        ]
        return weighted_mean(results, [part.share for part in parts])

    def _policy_loss(self, mb: PolicyGradientBatch, j: int, out: StepOut) -> tuple[torch.Tensor, dict]:
        """The registered loss (+ kl_coef · KL) of window step j of `mb`, from its re-evaluated step."""
        loss_cfg = self.cfg.loss
        inputs = loss_inputs(
            mb, j, out.log_prob_B.device, old_mean=self.needs_old_mean, ref_mean=self.kl_fn is not None
        )
        loss, metrics = self.loss_fn.compute(inputs, out, loss_cfg)
        if self.kl_fn is not None:
            kl, kl_metrics = self.kl_fn.compute(inputs, out, loss_cfg)
            loss = loss + loss_cfg.kl_coef * kl
            metrics = {**metrics, **kl_metrics}
        return loss, metrics

    def flow_matching_backward(
        self, micro_batches: Sequence[FlowMatchingBatch], weighting_scheme: str
    ) -> dict[str, float]:
        """Accumulate the supervised flow-matching gradient (`diffrl sft`) of one optimizer step.

        Each micro-batch holds clean latents, noise, noise levels and one conditioning row per
        sample; the loss of `diffrl.algos.flow_matching` is averaged over the micro-batches.
        """
        if not micro_batches:
            raise ValueError("flow_matching_backward needs at least one micro-batch")

        def term(mb: FlowMatchingBatch) -> tuple[torch.Tensor, dict[str, float]]:
            noisy = interpolate(mb.latents, mb.noise, mb.sigmas_B)
            velocity = self.adapter.velocity(
                noisy, mb.sigmas_B * NUM_TRAIN_TIMESTEPS, mb.cond, 1.0, mb.height, mb.width, mb.num_frames
            )
            return flow_matching_loss(velocity, mb.latents, mb.noise, mb.sigmas_B, weighting_scheme), {}

        count = len(micro_batches)
        terms = [GradientTerm(partial(term, mb), 1.0 / count) for mb in micro_batches]
        return self._reduce(self.accumulate(terms, metrics_divisor=count))

    def optim_step(self) -> dict[str, float]:
        """Clip, then step, unless the gradient norm is not finite: then skip, count and log it.

        With `actor.optimizer_offload` the AdamW state comes to the device for the step and goes
        back to host memory right after it (the first step creates it on the device, then)."""
        if self._replicated:
            average_gradients(self.params)
        clip = self.cfg.optim.clip_grad
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip is not None else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": float(self.skipped_steps)}
        with self._optimizer_on_device():
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optim_steps += 1
        return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": float(self.skipped_steps)}

    def log_probs(
        self,
        rollout: Rollout,
        policy: str = POLICY,
        micro_batch_size: int | None = None,
        as_trained: bool | None = None,
    ):
        """(log_probs_BW, means [B, W, ...]) of the rollout's window steps under `policy`, detached:
        the one log-prob pass (`diffrl.train.policies.window_log_probs`, which replicas run too),
        in micro-batches of actor.micro_batch_size unless given; `as_trained` None is its rule."""
        with self._resharded_after():
            return window_log_probs(
                self.adapter,
                rollout,
                policy,
                lora=self.lora,
                micro_batch_size=micro_batch_size or self.cfg.micro_batch_size,
                steps_per_forward=self.cfg.replay_steps_per_forward,
                as_trained=as_trained,
                reference=self.reference,
            )

    # ------------------------------------------------------------------------------ state
    def save(self, root: str | Path, step: int, extra: dict, keep_last: int) -> Path:
        from diffrl.train.checkpoint import save_checkpoint

        extra = {**extra, "optim_steps": self.optim_steps, "skipped_steps": self.skipped_steps}
        # The checkpoint code sees the optimizer state where it lives without offload, so an
        # offloaded run writes the same checkpoint (its peak is the optimizer step's, no more).
        with self._optimizer_on_device():
            return save_checkpoint(
                Path(root),
                step,
                model=self.transformer,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                trainable_only=self.lora,
                extra=extra,
                keep_last=keep_last,
            )

    def load(self, path: str | Path) -> dict:
        from diffrl.train.checkpoint import load_checkpoint

        with self._optimizer_on_device():
            extra = load_checkpoint(
                Path(path),
                model=self.transformer,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                trainable_only=self.lora,
            )
        self.optim_steps = int(extra.pop("optim_steps", 0))
        self.skipped_steps = int(extra.pop("skipped_steps", 0))
        return extra

    def export_lora(self, out_dir: str | Path, adapter_name: str = POLICY) -> Path:
        from diffrl.train.export import export_lora

        if not self.lora:
            raise ValueError("full fine-tuning has no LoRA to export: use export_full")
        export_lora(
            self.transformer,
            Path(out_dir),
            pipeline_class=self.adapter.lora_file_class,
            adapter_name=adapter_name,
        )
        return Path(out_dir)

    # ------------------------------------------------------------------------------ memory
    def to(self, device: str, *, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Load to or offload from the accelerator by hand: `device` is "cpu" or "device" (the
        accelerator this engine trains on; the CPU in a CPU run).

        model:     every parameter and buffer of the transformer, and of the frozen reference copy
                   (full fine-tuning with KL); FSDP2 modules move their local shards (`module.to`,
                   which FSDP2 supports), plain modules their tensors; parameters stay the same
                   objects, so the optimizer keeps referring to them
        optimizer: the AdamW state tensors (exp_avg, exp_avg_sq); the scalar step counter stays
                   where AdamW keeps it
        grad:      the `.grad` tensors. torch keeps a gradient on its parameter's device, so they
                   move with the parameters: model=True with grad=False, or grad=True without the
                   model, raises while gradients exist that would have to part from their
                   parameters (between optimizer steps there are none: `optim_step` frees them)

        Safe to call when everything is already there (nothing moves). Offloading then returns
        the freed blocks of torch's caching allocator to the device (`empty_cache`). Load the
        model back before the next forward. With `actor.param_offload` FSDP2's offload policy
        owns where the transformer's shards, gradients and optimizer state live (host memory),
        and `to` leaves them there.
        """
        target = offload.target_device(device, self.device)
        modules = self._model_modules()
        if model or grad:
            offload.check_gradients_follow(modules, target, model=model, grad=grad)
        if model:
            for module in modules:
                if any(t.device != target for t in (*module.parameters(), *module.buffers())):
                    module.to(target)
        if optimizer:
            offload.move_optimizer_state(self.optimizer, target, self.device)
        offload.release_cached_memory(self.device)

    def _model_modules(self) -> list[torch.nn.Module]:
        """The modules whose tensors `to(model=True)` moves (the transformer's stay with param_offload)."""
        modules = [] if self.cfg.param_offload else [self.transformer]
        return modules if self.reference is None else [*modules, self.reference]

    def _optimizer_on_device(self) -> AbstractContextManager[None]:
        return offload.optimizer_on_device(self.optimizer, self.device, enabled=self.cfg.optimizer_offload)

    # ------------------------------------------------------------------------------ internals
    def _pad_to_peers(
        self,
        terms: Sequence[GradientTerm],
        padding: Callable[[], tuple[torch.Tensor, dict[str, float]]] | None,
    ) -> list[GradientTerm]:
        """`terms`, plus zero-weight padding up to the largest count of any rank (see `accumulate`)."""
        terms = list(terms)
        if not (self._sharded and torch.distributed.is_initialized()):
            return terms
        from diffrl.train.distributed import _collective_device

        count = torch.tensor([len(terms)], dtype=torch.int64, device=_collective_device())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        missing = int(count) - len(terms)
        if missing and padding is None:
            if not terms:
                raise ValueError("this rank has no gradient terms to pad with: pass `padding`")
            padding = terms[0].forward
        return terms + [GradientTerm(padding, 0.0, metric_weight=None)] * missing

    @property
    def _sharded(self) -> bool:
        """Whether the transformer is an FSDP2 module (its forwards and backwards are collective)."""
        return hasattr(self.transformer, "set_requires_gradient_sync")

    def _sync_gradients(self, last: bool) -> None:
        """Under FSDP2 reduce gradients only after the mini-batch's last backward; a model kept
        gathered is also resharded only then (one all-gather per unit per optimizer step)."""
        if self._sharded:
            self.transformer.set_requires_gradient_sync(last)
            if self._keep_gathered:
                self.transformer.set_reshard_after_backward(last)

    @staticmethod
    def _reduce(metrics: dict[str, float]) -> dict[str, float]:
        if torch.distributed.is_initialized():
            from diffrl.train.distributed import all_reduce_mean

            return all_reduce_mean(metrics)
        return metrics


# The policies' names and the gradient terms are imported from here by the loops and algorithms.
__all__ = [
    "NUM_TRAIN_TIMESTEPS",
    "OLD",
    "POLICY",
    "REFERENCE",
    "FlowMatchingBatch",
    "GradientTerm",
    "TrainEngine",
    "lr_lambda",
]
