"""`diffrl sft`: supervised flow matching on (image, prompt) pairs, on the same workers as RL.

One step reads top to bottom:

    rows        data.prompts_per_step rows from the resumable data sampler
    images      each row's image file (`sft.images` names the column), or, with `sft.images=shapes`,
                a fresh rendering of the row's shapes-world scene (an endless supply of new images);
                an image-edit model also gets each row's condition image(s): its `data.image_key`
                images, or with `sft.images=shapes_edit` a fresh layout of the row's shapes edit
                (the rendered source as the condition, the rendered target as the image)
    update      each worker encodes its share (VAE, or nothing in pixel space), draws per-sample
                noise levels, noise and prompt dropout from (seed, step, sample), and accumulates
                the flow-matching loss over micro-batches; one optimizer step
    validation  every `test_freq` steps: the rewards of `diffrl train`'s validation (for the shapes
                world, the verifier's held-out accuracy), with an image grid
    checkpoint  every `save_freq` steps and at the end; resumable like `diffrl train`

At the end the run directory holds `model/`: the whole pipeline with the trained transformer (a
LoRA merged in), loadable as `model.path` by `diffrl train`, `diffrl sample` or diffusers.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffrl.config import load_config
from diffrl.config.schema import Config
from diffrl.controller.loop import TrainingLoop
from diffrl.controller.preflight import preflight_common
from diffrl.controller.run import Job, print_report, run_job, run_loop
from diffrl.data import PromptRecord, PromptSampler
from diffrl.data.images import load_image_rows, open_image
from diffrl.files import check_output_dir, write_json
from diffrl.models import edits_images, read_model_index
from diffrl.models.sampling import EXAMPLE_PROMPTS, settings_of_run, write_sampling_file
from diffrl.seeding import SFT_STREAM, derive_seed
from diffrl.telemetry.health import HealthStop
from diffrl.toy import SHAPES, SHAPES_EDIT
from diffrl.train.export_folder import write_manifest
from diffrl.train.export_run import publish_by_workers
from diffrl.workers.roles import ImageShard


class SupervisedTrainer(TrainingLoop):
    """Runs `diffrl sft` for `cfg` on `workers` (see the module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, **loop_args: Any):
        super().__init__(cfg, run_dir, **loop_args)
        self.loader = ImageLoader(cfg, self.sampler)
        # The loader runs the sampler ahead; this is the position after the current step's rows.
        self.data_state = self.sampler.state_dict()

    def data_position(self) -> dict:
        return self.data_state

    @property
    def images_per_step(self) -> int:
        return self.cfg.data.prompts_per_step  # one image per row

    def resume(self, checkpoint: Path) -> None:
        super().resume(checkpoint)
        self.data_state = self.sampler.state_dict()

    def fit(self) -> dict[str, float]:
        try:
            return super().fit()
        finally:
            self.loader.close()

    def train_step(self) -> dict[str, float]:
        cfg, world = self.cfg, self.workers.size
        self.timer.reset()
        with self.timer.phase("data"):
            records, pixels, conditions, self.data_state = self.loader.next(self.step)
        per_worker = len(records) // world
        shards = [
            ImageShard(
                prompts=[r.prompt for r in records[rank * per_worker : (rank + 1) * per_worker]],
                pixels=pixels[rank * per_worker : (rank + 1) * per_worker],
                sample_offset=rank * per_worker,
                conditions=None
                if conditions is None
                else conditions[rank * per_worker : (rank + 1) * per_worker],
            )
            for rank in range(world)
        ]
        with self.timer.phase("update_actor"):
            results = self.workers.scatter(
                "flow_matching_backward", shards, seed=cfg.trainer.seed, step=self.step
            )
            step_metrics = self.workers.call("optim_step")[0]
        metrics = {f"actor/{key}": value for key, value in {**results[0], **step_metrics}.items()}
        metrics.update(self.timer.metrics(len(records), world))
        metrics["train/epoch"] = float(self.data_state["epoch"])
        return metrics


# ---------------------------------------------------------------------------------- images
class ImageLoader:
    """The images of the coming steps, loaded `sft.data_workers` processes wide and a few steps
    ahead while the current step trains; in the training process when data_workers is 0.

    The data sampler runs ahead with it, so each queued step keeps the sampler state that follows
    its rows: the checkpoint of step s stores that state, and a resumed run continues exactly.
    Image i of step s renders from the seed (SFT_STREAM, seed, s, i, 1).
    """

    def __init__(self, cfg: Config, sampler: PromptSampler, depth: int = 3):
        self.cfg, self.sampler = cfg, sampler
        # image-edit models train with each row's condition image(s)
        self.conditioned = edits_images(cfg.model.path)
        self.workers = cfg.sft.data_workers
        self.depth = depth if self.workers else 1
        self.pool = None
        if self.workers:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # spawn: the training process may hold CUDA state, which a forked child must not inherit.
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        self.queue: list[tuple[int, list[PromptRecord], dict, list]] = []

    def next(self, step: int) -> tuple[list[PromptRecord], torch.Tensor, list[list[Any]] | None, dict]:
        """(records, uint8 [B, 3, H, W] images, each image's condition images (Pillow RGB; None for
        a text-to-image model), sampler state after them) of `step`."""
        while len(self.queue) < self.depth:
            self._submit(step + len(self.queue))
        queued_step, records, state, parts = self.queue.pop(0)
        assert queued_step == step, (queued_step, step)
        arrays = np.concatenate([p.result() if hasattr(p, "result") else p for p in parts])
        conditions = None
        if self.cfg.sft.images == SHAPES_EDIT:  # [B, 2, H, W, 3]: the targets, then the sources
            from PIL import Image

            arrays, sources = arrays[:, 0], arrays[:, 1]
            conditions = [[Image.fromarray(source)] for source in sources]
        elif self.conditioned:
            conditions = [[image.load() for image in r.images] for r in records]
        pixels = torch.from_numpy(np.ascontiguousarray(arrays)).permute(0, 3, 1, 2).contiguous()
        return records, pixels, conditions, state

    def _submit(self, step: int) -> None:
        cfg, pipe = self.cfg, self.cfg.rollout.pipeline
        records = [record for _, record in self.sampler.next_batch()]
        state = self.sampler.state_dict()
        if cfg.sft.images == SHAPES:
            rows = [r.metadata["scene"] for r in records]
        elif cfg.sft.images == SHAPES_EDIT:
            rows = [r.metadata["edit"] for r in records]
        else:
            rows = [str(image_file(r, cfg.sft.images)) for r in records]
        seeds = [derive_seed(SFT_STREAM, cfg.trainer.seed, step, i, 1) for i in range(len(records))]
        args = (cfg.sft.images, rows, pipe.height, pipe.width, seeds)
        if self.pool is None:
            parts = [load_image_rows(*args)]
        else:
            chunk = -(-len(rows) // self.workers)
            parts = [
                self.pool.submit(
                    load_image_rows, args[0], rows[i : i + chunk], args[2], args[3], seeds[i : i + chunk]
                )
                for i in range(0, len(rows), chunk)
            ]
        self.queue.append((step, records, state, parts))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def image_file(record: PromptRecord, column: str) -> Path:
    """The row's image path; relative paths are relative to the row's data file."""
    if column not in record.metadata:
        raise ValueError(
            f"{record.source}: the row has no {column!r} column (sft.images); its columns are "
            f"{sorted(record.metadata)}. Set sft.images to the column holding the image file, or "
            "'shapes' to render shapes-world scenes"
        )
    path = Path(str(record.metadata[column]))
    if not path.is_absolute():
        path = Path(record.source.rsplit(":", 1)[0]).parent / path
    return path


def check_image(record: PromptRecord, column: str, height: int, width: int) -> Path:
    """The row's image file, checked to exist and have the training size (reads the header only)."""
    path = image_file(record, column)
    if not path.exists():
        raise FileNotFoundError(f"{record.source}: image {path} not found")
    with open_image(path, f"{record.source}: image") as image:
        if image.size != (width, height):
            raise ValueError(
                f"{path} is {image.size[0]}x{image.size[1]} but training runs at {width}x{height} "
                "(rollout.pipeline.width x height): resize the dataset's images, or change the size"
            )
    return path


# ---------------------------------------------------------------------------------- command
def preflight(cfg: Config) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Config rules of supervised training and every data row's image, before any model starts."""
    check_output_dir(cfg.trainer.output_dir, "trainer.output_dir")
    train, val = preflight_common(cfg)
    pipe = cfg.rollout.pipeline
    family = read_model_index(cfg.model.path)["_class_name"]
    edit_model = edits_images(cfg.model.path)
    if cfg.sft.images == SHAPES_EDIT and not edit_model:
        raise ValueError(
            f"sft.images=shapes_edit trains an image-edit model on shapes edits, but model.path="
            f"{cfg.model.path!r} is a {family}, which takes no condition image: use an edit model "
            "(model.path=tiny:toy_edit, docs/shapes.md), or sft.images=shapes for a text-to-image model"
        )
    if cfg.sft.images == SHAPES and edit_model:
        raise ValueError(
            f"model.path={cfg.model.path!r} is a {family}, an image-edit model: each training image needs "
            "its condition image, and sft.images=shapes renders scenes without one. Use sft.images=shapes_edit "
            "with shapes edit rows (builtin:shapes_edit_train.jsonl), or a column of target images with "
            "the rows' condition images in data.image_key"
        )
    if cfg.sft.images == SHAPES_EDIT and pipe.height != pipe.width:
        raise ValueError(
            f"sft.images=shapes_edit renders square images; rollout.pipeline is {pipe.width}x{pipe.height}: "
            "set rollout.pipeline.height = width"
        )
    for record in train:
        if cfg.sft.images in (SHAPES, SHAPES_EDIT):
            column = "scene" if cfg.sft.images == SHAPES else "edit"
            if not isinstance(record.metadata.get(column), dict):
                example = "shapes_train.jsonl" if cfg.sft.images == SHAPES else "shapes_edit_train.jsonl"
                raise ValueError(
                    f"{record.source}: sft.images={cfg.sft.images} needs {'a' if column == 'scene' else 'an'} "
                    f"{column!r} column (a shapes-world {column}, as in builtin:{example})"
                )
            if cfg.sft.images == SHAPES_EDIT:
                from diffrl.toy.edit import EditExample

                try:
                    EditExample.from_dict(record.metadata["edit"])
                except ValueError as err:
                    raise ValueError(f"{record.source}: {err}") from None
        else:
            check_image(record, cfg.sft.images, pipe.height, pipe.width)
    return train, val


#: A CPU trains the toy model at about 10 images/s (shapes_sft, 2 cores): past this many images
#: a job runs for hours there, and `diffrl sft` says so before it starts.
CPU_SFT_IMAGES_NOTE = 100_000
CPU_SFT_IMAGES_PER_S = 10


def cpu_job_note(cfg: Config, cuda: bool) -> str | None:
    """The line `diffrl sft` prints before a job too long for this machine (no GPU, and more than
    CPU_SFT_IMAGES_NOTE images), or None."""
    images = cfg.trainer.total_steps * cfg.data.prompts_per_step
    if cuda or images <= CPU_SFT_IMAGES_NOTE:
        return None
    hours = images / CPU_SFT_IMAGES_PER_S / 3600
    # steps in ~5 minutes; validation is extra, so the one before training is left out (issue 52)
    look = max(1, 300 * CPU_SFT_IMAGES_PER_S // cfg.data.prompts_per_step)
    return (
        f"note: this job trains {images:,} images ({cfg.trainer.total_steps} steps of "
        f"{cfg.data.prompts_per_step}) and there is no GPU: at a CPU's ~{CPU_SFT_IMAGES_PER_S} images/s "
        f"that is about {hours:,.0f} hours (a GPU job: shapes_sft is ~4000 images/s on one H100). "
        f"For a look: trainer.total_steps={look} trainer.val_before_train=false (about 5 minutes of "
        "training, then one validation pass, a few minutes more on a CPU)"
    )


def sft(source: str | None, overrides: Sequence[str] = ()) -> Path:
    """Run a supervised flow-matching job; returns its run directory (the model is in `model/`)."""
    source = source or "shapes_sft"
    cfg = load_config(source, overrides, job="sft")
    from diffrl.telemetry.report import skip_if_finished

    if (finished := skip_if_finished(cfg.trainer)) is not None:
        return finished  # before any model loads: nothing to do
    if (note := cpu_job_note(cfg, torch.cuda.is_available())) is not None:
        print(note, flush=True)
    train_records, val_records = preflight(cfg)

    def body(j: Job, state: dict[str, Any]) -> tuple[Job, SupervisedTrainer]:
        trainer = SupervisedTrainer(
            cfg,
            j.run_dir,
            workers=j.workers,
            rewards=j.rewards,
            train_records=train_records,
            val_records=val_records,
            logger=j.logger,
        )
        state["loop"] = trainer
        summary = run_loop(trainer, j.checkpoint, j.plan)
        grammar = "shapes" if cfg.sft.images == SHAPES else None  # trained on the shapes world's prompts

        def write_info(staging: Path) -> None:
            write_manifest(
                staging, kind="pipeline", run=str(j.run_dir), step="final", base_model=cfg.model.path
            )
            write_sampling_file(staging, settings_of_run(cfg.rollout, grammar))

        summary["model"] = str(
            publish_by_workers(j.workers, j.run_dir / "model", "checkpoint.export_pipeline", write_info)
        )
        write_json(j.run_dir / "summary.json", summary)
        model, prompt = str(summary["model"]), EXAMPLE_PROMPTS[grammar]
        images: list[str] = []
        if train_records[0].images:  # an edit model: a training row's instruction and source image
            prompt = train_records[0].prompt
            images = [
                arg for i in train_records[0].images if i.path is not None for arg in ("--image", i.path)
            ]
        command = ["diffrl", "sample", "--model", model, "--prompt", prompt, *images]
        command += ["--out", str(j.run_dir / "samples")]
        print(f"model written to {model}\n  sample from it: {shlex.join(command)}")
        print_report(j)
        return j, trainer

    j, trainer = run_job(cfg, source, body)
    if trainer.stopped is not None:  # trainer.health.stop_on, after the export and the report
        raise HealthStop(trainer.stopped)
    return j.run_dir


__all__ = ["ImageLoader", "SupervisedTrainer", "sft"]
