"""Exports of a run: `diffrl export` (`export_run`) and the end of `diffrl train` (`export_final_weights`).

`export_run` finds a run's checkpoint (`resolve_run_checkpoint`: the newest, or the best with
`best`), builds the model as the run's training engine does, loads the weights (taking the next
checkpoint if the run prunes the one it picked while it loads) and writes a LoRA or a whole
pipeline; `export_final_weights` and `publish_by_workers` have the workers that hold the weights
write them. Either way the export goes to a staging folder, gets its manifest and the run's
sampler settings (diffrl_sampling.json), and replaces the target only when whole
(`diffrl.train.export_folder`); `ExportResult` says what was written and how to load or sample
it. Apart from `diffrl.train.export` (the weight formats, on any module) because this is about
runs: their folders, configs and checkpoints.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diffrl.files import check_output_dir
from diffrl.models.sampling import EXAMPLE_PROMPTS, read_sampling_file, settings_of_run, write_sampling_file
from diffrl.train.export import export_pipeline
from diffrl.train.export_folder import begin_staging, check_export_target, normalized, publish, write_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    out: Path
    kind: str  # "lora" or "pipeline"
    source: str  # the checkpoint, or the run for its end-of-run export
    base_model: str  # the run's model.path: what the LoRA goes on top of
    example_prompt: str = "a photo of a cat"  # for the `diffrl sample` command printed

    @property
    def edits_images(self) -> bool:
        """Whether the base model is an image-edit model (its `diffrl sample` needs --image)."""
        from diffrl.models import edits_images

        return edits_images(self.base_model)

    @property
    def plain_diffusers_runs_it(self) -> bool:
        """Whether a diffusers pipeline can run the base model: not diffrl's pixel-space toy models
        (toy:shapes), whose model_index.json has no VAE; only `diffrl sample` runs those."""
        from diffrl.models import read_model_index, resolve_model_path

        vae = read_model_index(resolve_model_path(self.base_model)).get("vae")
        return not (isinstance(vae, list) and vae and vae[0] is None)

    @property
    def pipeline_loads_lora(self) -> bool:
        """Whether the base model's diffusers pipeline class has `load_lora_weights` (0.42 gives
        HunyuanVideo15Pipeline none: its transformer's `load_lora_adapter` loads the file)."""
        import diffusers

        from diffrl.models import read_model_index, resolve_model_path

        name = read_model_index(resolve_model_path(self.base_model)).get("_class_name", "")
        return hasattr(getattr(diffusers, name, None), "load_lora_weights")

    def sample_command(self) -> str:
        """A `diffrl sample` command that works as printed (an edit model's once IMAGE names the
        image to edit): the sampler settings come from the export's diffrl_sampling.json (the
        run's validation sampler)."""
        samples = self.out.parent / "samples"
        model = ["--model", str(self.out)] if self.kind == "pipeline" else ["--model", self.base_model]
        lora = ["--lora", str(self.out)] if self.kind == "lora" else []
        argv = [
            "diffrl",
            "sample",
            *model,
            *lora,
            *(["--image", "IMAGE"] if self.edits_images else []),
            "--prompt",
            self.example_prompt if not self.edits_images else "make it blue",
            "-n",
            "4",
            "--out",
            str(samples),
        ]
        return shlex.join(argv)

    def describe(self) -> str:
        what = "the LoRA" if self.kind == "lora" else "the full pipeline"
        lines = [f"exported {what} of {self.source} to {self.out}"]
        if not self.plain_diffusers_runs_it:
            lines.append(
                f"  (plain diffusers cannot run it: {self.base_model} is diffrl's pixel-space toy model, "
                "without a VAE; diffrl sample runs it)"
            )
        elif self.kind == "lora" and not self.pipeline_loads_lora:
            lines.append(
                f"  load it in diffusers: pipe.transformer.load_lora_adapter({str(self.out)!r}, "
                f'prefix="transformer") on the {self.base_model} pipeline (diffusers gives it no load_lora_weights)'
            )
        elif self.kind == "lora":
            lines.append(
                f"  load it in diffusers: pipe.load_lora_weights({str(self.out)!r}) on the {self.base_model} pipeline"
            )
        else:
            lines.append(f"  load it in diffusers: DiffusionPipeline.from_pretrained({str(self.out)!r})")
        lines.append(
            f"  or sample from it:    {self.sample_command()}"
            + ("  (IMAGE: the image to edit)" if self.edits_images else "")
        )
        return "\n".join(lines)


def _write_info(out: Path, cfg, **info) -> None:
    """diffrl_export.json (what the export came from) and diffrl_sampling.json (the run's validation
    sampler, which `diffrl sample` takes its defaults from), next to the weights."""
    write_manifest(out, **info)
    write_sampling_file(out, settings_of_run(cfg.rollout, _prompt_grammar(cfg.model.path)))


def _prompt_grammar(model_path: str) -> str | None:
    """The prompt grammar of the base model (toy:shapes: the shapes world's), which its fine-tunes keep."""
    from diffrl.models import resolve_model_path

    return (read_sampling_file(resolve_model_path(model_path)) or {}).get("prompt_grammar")


def _example_prompt(model_path: str) -> str:
    return EXAMPLE_PROMPTS[_prompt_grammar(model_path)]


def resolve_run_checkpoint(target: str | Path, best: bool = False) -> tuple[Path, Path]:
    """(run directory, checkpoint) of TARGET: a run directory (its newest complete checkpoint; with
    `best`, its best one, RUN/checkpoints/best: trainer.keep_best) or one of its checkpoints
    (RUN/checkpoints/step_N, RUN/checkpoints/best)."""
    from diffrl.train.best_checkpoint import best_checkpoint
    from diffrl.train.checkpoint import latest_checkpoint

    path = Path(target)
    if best:
        if not (path / "config.yaml").is_file():
            raise ValueError(f"--best takes a run directory (with config.yaml), not {target}")
        checkpoint = best_checkpoint(path / "checkpoints")
        if checkpoint is None:
            raise FileNotFoundError(
                f"run {path} kept no best checkpoint ({path / 'checkpoints' / 'best'}): runs keep one with "
                "trainer.keep_best=true; export its newest checkpoint without --best"
            )
        return path, checkpoint
    if (path / "config.yaml").is_file():
        checkpoint = latest_checkpoint(path / "checkpoints")
        if checkpoint is None:
            raise FileNotFoundError(
                f"run {path} has no complete checkpoint in {path / 'checkpoints'}: nothing to export yet "
                "(checkpoints are written every trainer.save_freq steps and at the end of the run)"
            )
        return path, checkpoint
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        return path.parent.parent, path
    if (path / "model_index.json").is_file():
        raise ValueError(
            f"{target} is a diffusers model directory, not a run: there are no trained weights to export "
            "(load it directly, e.g. diffrl sample --model)"
        )
    raise FileNotFoundError(
        f"{target} is neither a run directory (with config.yaml) nor a checkpoint (RUN/checkpoints/step_N)"
    )


def _load_newest(engine, target: str | Path, run_dir: Path, checkpoint: Path) -> tuple[Path, dict]:
    """Load `checkpoint` into the engine; when TARGET is a run that is still training, its newest
    checkpoint may be pruned (trainer.keep_checkpoints) while it loads: then the one that replaced it is
    loaded instead, a few times at most."""
    from diffrl.train.checkpoint import latest_checkpoint, load_checkpoint

    for _ in range(_LOAD_ATTEMPTS):
        try:
            extra = load_checkpoint(
                checkpoint,
                model=engine.transformer,
                optimizer=None,
                scheduler=None,
                trainable_only=engine.lora,
                restore_rng=False,
            )
            return checkpoint, extra
        except (OSError, ValueError):
            if checkpoint.exists() or normalized(target) != normalized(run_dir):
                raise
            newer = latest_checkpoint(run_dir / "checkpoints")
            if newer is None:
                raise
            log.info(
                "checkpoint %s was removed while loading (the run is training): exporting %s",
                checkpoint,
                newer,
            )
            checkpoint = newer
    raise ValueError(
        f"run {str(run_dir)!r} replaced its newest checkpoint {_LOAD_ATTEMPTS} times while it was being "
        "loaded: export one that stays, e.g. diffrl export RUN/checkpoints/step_N after the run ends, or "
        "raise trainer.keep_checkpoints"
    )


_LOAD_ATTEMPTS = 3


def export_run(
    target: str | Path, out_dir: str | Path, *, merge: bool = False, device: str = "cpu", best: bool = False
) -> ExportResult:
    """`diffrl export`: the trained weights of a run or checkpoint, in one process (no Ray).

    The model is built as the run's training engine builds it (same LoRA adapters, names and
    initialisation seed), the checkpoint's weights are loaded into it (no optimizer state, no RNG),
    and then: a LoRA run writes its `default` adapter in the diffusers LoRA format (`export_lora`);
    with `merge`, or for a full fine-tuning run, the whole pipeline (`export_pipeline`). OUT may be
    new or an earlier export, never the run, its checkpoints or any other folder
    (`export_folder.check_export_target`); the export replaces it only when whole. `best`: the
    run's best checkpoint (`resolve_run_checkpoint`).
    """
    from diffrl.algos.spec import worker_options
    from diffrl.config import load_config
    from diffrl.models import load_model
    from diffrl.train.engine import TrainEngine

    run_dir, checkpoint = resolve_run_checkpoint(target, best=best)
    out = check_export_target(out_dir, protected=(run_dir, checkpoint))
    check_output_dir(out, "--out")
    check_output_dir(out.parent, "--out's parent (OUT.partial is written there, then renamed)")
    cfg = load_config(str(run_dir / "config.yaml"), job="eval")
    adapter = load_model(cfg.model.path, dtype=cfg.model.dtype, device=device)
    options = worker_options(cfg)
    engine = TrainEngine(
        adapter,
        cfg.model,
        cfg.actor,
        total_optim_steps=1,
        with_old=options.get("with_old", False),
        with_reference=False,  # a frozen copy is for training only
        seed=cfg.trainer.seed,
    )
    # the best checkpoint is that one or none: never the newest in its place
    checkpoint, extra = _load_newest(engine, checkpoint if best else target, run_dir, checkpoint)
    info = {
        "run": str(run_dir),
        "checkpoint": str(checkpoint),
        "step": extra.get("step"),
        "base_model": cfg.model.path,
    }
    if "best" in extra:  # RUN/checkpoints/best: which validation made it the best
        info["best"] = extra["best"]
    kind = "lora" if engine.lora and not merge else "pipeline"
    staging = begin_staging(out)
    if kind == "lora":
        engine.export_lora(staging)
        _write_info(staging, cfg, kind="lora", **info)
    else:
        export_pipeline(adapter, staging, model_path=cfg.model.path, merge=engine.lora)
        _write_info(staging, cfg, kind="pipeline", merged=engine.lora, **info)
    publish(staging, out)
    return ExportResult(out, kind, str(checkpoint), cfg.model.path, _example_prompt(cfg.model.path))


def publish_by_workers(workers, out: str | Path, method: str, write_info: Callable[[Path], None]) -> Path:
    """The workers' export (`method`: checkpoint.export_lora or checkpoint.export_pipeline; every rank takes part, since
    gathering FSDP shards is a collective) written into a staging folder beside `out`, completed by
    `write_info(staging)` in this process, then published as `out` (which must be new or an
    earlier export)."""
    out = check_export_target(out, what="the export folder")
    staging = begin_staging(out)
    workers.call(method, str(staging))
    write_info(staging)
    return publish(staging, out)


def export_final_weights(workers, run_dir: str | Path, cfg, checkpoint: Path | None = None) -> ExportResult:
    """End of `diffrl train`: the trained weights to RUN/export, by the workers that hold them.

    LoRA: the `default` adapter in the diffusers LoRA format; full fine-tuning: the whole pipeline.
    Published as `publish_by_workers` does: RUN/export is replaced only when the new one is whole.
    Prints where it went. With `checkpoint` (the run's best, trainer.keep_best) the workers load its
    weights first and the export goes to RUN/export_best, its manifest naming the checkpoint, its
    step and its score.
    """
    kind = "lora" if cfg.model.lora.rank > 0 else "pipeline"
    name, info, source = "export", {"step": "final"}, f"run {run_dir} (its final weights)"
    if checkpoint is not None:
        extra = workers.call("checkpoint.load", str(checkpoint))[0]
        name, info = "export_best", {"step": extra["step"], "checkpoint": str(checkpoint)}
        info.update({"best": extra["best"]} if "best" in extra else {})
        source = f"{checkpoint} (step {extra['step']}, the run's best validation)"
    out = publish_by_workers(
        workers,
        Path(run_dir) / name,
        f"checkpoint.export_{kind}",
        lambda staging: _write_info(
            staging, cfg, kind=kind, run=str(run_dir), base_model=cfg.model.path, **info
        ),
    )
    result = ExportResult(out, kind, source, cfg.model.path, _example_prompt(cfg.model.path))
    print(result.describe())
    return result
