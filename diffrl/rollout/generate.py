"""`diffrl sample`: generate images or videos from a model directory (optionally with an exported
LoRA), written to a folder. Image-edit models take the image(s) to edit with `--image PATH`, the
same for every prompt, checked against the family's rules before the model loads."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from diffrl.config.early_checks import check_device
from diffrl.config.schema import PipelineConfig, RolloutConfig, ValidationConfig
from diffrl.data.images import MAX_CONDITION_PIXELS, ConditionImage, read_condition_image
from diffrl.files import check_output_dir, naming, open_regular
from diffrl.models import adapter_class, load_model, read_model_index, resolve_model_path
from diffrl.models.base import ModelAdapter
from diffrl.models.bounds import check_model_bounds
from diffrl.models.conditions import check_condition_rows
from diffrl.models.experts import load_lora_kwargs, trained_components
from diffrl.models.lora_check import check_lora_file_bound
from diffrl.models.sampling import GENERIC, ImageGeometry, resolve_sampling
from diffrl.rollout import TrajectorySampler
from diffrl.rollout.line_progress import LineProgress
from diffrl.rollout.sample_memory import check_sample_memory
from diffrl.telemetry.images import save_gif


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_lora_dir(lora: str | Path) -> Path:
    """A directory that holds a LoRA in the diffusers format, or a FileNotFoundError/ValueError saying
    what it is instead and how to get one."""
    from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE as LORA_FILE  # save/load_lora_weights' file

    path = Path(lora)
    if not path.exists():
        raise FileNotFoundError(f"--lora {str(lora)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"--lora {str(lora)!r} is a file: pass the directory that holds {LORA_FILE}")
    if (path / LORA_FILE).is_file():
        return path
    if (path / "config.yaml").is_file() and (path / "export" / LORA_FILE).is_file():
        hint = f"it is a run: its final LoRA is in {path / 'export'}, pass --lora {path / 'export'}"
    elif (path / "config.yaml").is_file() or path.parent.name == "checkpoints":
        hint = f"it is a run or a checkpoint: export its LoRA first, `diffrl export {lora} --out DIR`, then --lora DIR"
    elif (path / "model_index.json").is_file():
        hint = "it is a full pipeline (e.g. a merged export): pass it as --model instead"
    else:
        hint = "`diffrl export RUN --out DIR` writes one"
    raise ValueError(f"--lora {str(lora)!r} holds no {LORA_FILE} (a LoRA in the diffusers format): {hint}")


def load_lora(adapter, lora_dir: Path, scale: float = 1.0) -> None:
    """Load an exported LoRA into the adapter's pipeline with diffusers' own loader
    (`pipe.load_lora_weights`, which reads the adapter's alpha from the file's metadata; Wan2.2
    A14B's second expert from its own file, `load_into_transformer_2`; the transformer's
    `load_lora_adapter` where the pipeline has no loader), and stop, naming the
    modules, when a tensor of a file was not bound (`check_lora_file_bound`)."""
    pipe = adapter.pipe
    pipeline_loader = hasattr(pipe, "load_lora_weights")
    for component, _ in trained_components(adapter.transformer):
        kwargs = load_lora_kwargs(component)
        file = lora_dir / kwargs["weight_name"]
        if not file.is_file():
            raise ValueError(
                f"--lora {str(lora_dir)!r} holds no {file.name}, the LoRA of this model's {component}: "
                "pass the export of a run on this model (`diffrl export RUN --out DIR`)"
            )
        if pipeline_loader:
            pipe.load_lora_weights(str(lora_dir), adapter_name="default", **kwargs)
        else:  # a pipeline diffusers gives no loader (HunyuanVideo-1.5): the transformer's own
            pipe.transformer.load_lora_adapter(
                str(lora_dir), prefix="transformer", adapter_name="default", weight_name=kwargs["weight_name"]
            )
        # a module diffusers dropped stops here
        check_lora_file_bound(pipe, file, "default", into=component if component != "transformer" else None)
    if scale != 1.0:
        if pipeline_loader:
            pipe.set_adapters(["default"], adapter_weights=[scale])
        else:
            pipe.transformer.set_adapters(["default"], weights=[scale])


FLAGS = {
    "height": "--height",
    "width": "--width",
    "steps": "--steps",
    "guidance_scale": "--guidance-scale",
    "max_sequence_length": "--max-sequence-length",
    "num_frames": "--num-frames",
    "negative_prompt": "--negative-prompt",
}


def sampling_settings(
    model: str | ModelAdapter, lora: str | Path | None, given: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The sampler settings of `diffrl sample` (`diffrl.models.sampling.resolve_sampling`): those
    `given` (None = not given), else the LoRA's, else the model's, else the generic ones; checked
    against the sizes the model takes before it loads. Returns (settings, where each came from)."""
    unknown = sorted(set(given) - set(FLAGS))
    assert not unknown, unknown
    root = None if isinstance(model, ModelAdapter) else resolve_model_path(model)
    lora_dir = check_lora_dir(lora) if lora is not None else None
    settings, sources = resolve_sampling(
        root if root is not None and root.is_dir() else None, lora_dir, given
    )
    if root is not None and root.is_dir():
        geometry = ImageGeometry.read(root)
        for key in ("height", "width"):
            if (problem := geometry.problem(settings[key])) is not None:
                raise ValueError(
                    f"{FLAGS[key]} {settings[key]} (from {sources[key]}) does not fit the model {str(model)!r}: "
                    f"{problem}: pass {FLAGS[key]} {geometry.nearest(settings[key])}"
                )
    return settings, sources


def describe_settings(settings: dict[str, Any], sources: dict[str, str]) -> str:
    """One line: the settings and, for those not from the command line or the defaults, their file."""
    text = (
        f"{settings['height']}x{settings['width']}, {settings['steps']} steps, guidance "
        f"{settings['guidance_scale']:g}, text length {settings['max_sequence_length']}"
    )
    if settings["num_frames"] > 1:
        text += f", {settings['num_frames']} frames"
    if settings.get("sigmas") is not None:  # diffusers: pipe(..., sigmas=[...]) where its shift is 1
        text += f", sigmas {', '.join(f'{s:g}' for s in settings['sigmas'])}"
    files = sorted({where for where in sources.values() if where not in ("command line", "defaults")})
    return text + (f" (from {', '.join(files)})" if files else "")


def check_prompts(prompts: Sequence[str], grammar: str | None, model: str | ModelAdapter) -> None:
    """Prompts outside the grammar the model was trained on would give pictures of nothing it knows."""
    if grammar == "shapes":
        from diffrl.toy.grammar import parse_prompt

        for prompt in prompts:
            try:
                parse_prompt(prompt)
            except ValueError as err:
                raise ValueError(
                    f"--prompt: the model {str(model)!r} was trained on the shapes world's prompts only: {err}"
                ) from None


def check_image_file(value: str) -> None:
    """An `--image` value is a file Pillow reads and decodes, else a FileNotFoundError/ValueError
    worded for the flag. Checked before `read_condition_image` (which also checks the sizes the
    edit families take), whose messages speak of prompt rows and their file's folder."""
    path = Path(os.path.abspath(value))
    flag = f"--image {value!r}"
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"{flag}: no such file ({path}; a relative path is taken from the current folder): fix the path"
        )
    if path.is_dir():
        raise ValueError(f"{flag} is a folder ({path}): pass the image file to edit")
    with open_regular(path, flag) as file:
        try:
            image = Image.open(file)
        except Image.DecompressionBombError:
            raise ValueError(
                f"{flag}: {path} has more pixels than Pillow opens safely; edit models take at most "
                f"{MAX_CONDITION_PIXELS:,} (they resize to about one megapixel): downscale it"
            ) from None
        except UnidentifiedImageError:
            raise ValueError(
                f"{flag}: {path} is not an image Pillow can read (PNG, JPEG, WebP, ...): pass an image file"
            ) from None
        with image:
            if image.size[0] * image.size[1] > MAX_CONDITION_PIXELS:
                return  # read_condition_image refuses it by its size, without decoding it
            try:
                image.load()
            except (OSError, SyntaxError) as err:  # truncated or corrupt pixel data
                raise ValueError(
                    f"{flag}: {path} does not decode ({err}): the file is damaged; pass an intact copy"
                ) from None


def condition_images(model: str | ModelAdapter, paths: Sequence[str | Path]) -> tuple[ConditionImage, ...]:
    """`--image PATH` values, read and checked against the model family's rules on condition
    images (`diffrl.models.conditions`) before the model loads: none for a text-to-image model,
    the family's count for an edit model."""
    family = (
        type(model)
        if isinstance(model, ModelAdapter)
        else adapter_class(read_model_index(model)["_class_name"])
    )
    rule = family.condition_rule
    if rule is None:
        if paths:
            raise ValueError(
                f"--image: the model {str(model)!r} ({family.pipeline_class_name}) generates from text only and "
                "takes no condition image: leave --image out, or sample an image-edit model (docs/models.md)"
            )
        return ()
    if not paths:
        raise ValueError(
            f"the model {str(model)!r} ({family.pipeline_class_name}) edits images: give the image to edit with "
            f"--image PATH ({rule.count_text()})"
        )
    if not rule.min_images <= len(paths) <= rule.max_images:
        raise ValueError(
            f"{len(paths)} --image flags given, and the model {str(model)!r} ({family.pipeline_class_name}) takes "
            f"{rule.count_text()} condition image(s) per prompt: pass --image PATH {rule.count_text()} time(s)"
        )
    for path in paths:
        check_image_file(str(path))
    images = tuple(read_condition_image(str(p), Path.cwd(), f"--image {p}", "--image") for p in paths)
    check_condition_rows(
        rule, [("--image", [(i.name, i.width, i.height) for i in images])], "--image", "--image"
    )
    return images


def generate(
    model: str | ModelAdapter,
    prompts: Sequence[str],
    out_dir: str | Path,
    *,
    n: int = 1,
    seed: int = 0,
    steps: int | None = None,
    guidance_scale: float | None = None,
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    negative_prompt: str | None = None,
    max_sequence_length: int | None = None,
    noise_level: float = 0.0,
    dtype: str | None = None,
    device: str | None = None,
    micro_batch_size: int = 8,
    fps: int = 16,
    lora: str | Path | None = None,
    lora_scale: float = 1.0,
    images: Sequence[str | Path] = (),
    progress: bool = True,
) -> list[Path]:
    """Sample `n` images (or videos) per prompt and write them with a manifest, samples.jsonl.

    Sample j of prompt i uses the noise keyed (seed, 0, i·n + j): the same call gives the same files.
    `model`: a model directory (or `toy:`/`tiny:` name), or an already loaded adapter (then `dtype`
    and `device` are its own). `lora`: a LoRA directory in the diffusers format (`diffrl export`),
    loaded on top of the model. Sampler settings left at None come from the LoRA's or the model's
    diffrl_sampling.json, else the generic defaults (`sampling_settings`). The device, the LoRA
    directory, the image size, the steps and text length against the model directory's bounds
    (`diffrl.models.bounds`), for a model trained on a prompt grammar the prompts, and for an
    image-edit model the condition `images` (files, the same for every prompt), and the memory the
    samples and one micro-batch's decoding need at least (`diffrl.rollout.sample_memory`) are
    checked before the model loads. `progress`: rich's bar on a terminal, else plain lines
    (`LineProgress`).
    """
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    given = dict(
        height=height,
        width=width,
        steps=steps,
        guidance_scale=guidance_scale,
        max_sequence_length=max_sequence_length,
        num_frames=num_frames,
        negative_prompt=negative_prompt,
    )
    settings, _ = sampling_settings(model, lora, given)
    check_prompts(prompts, settings["prompt_grammar"], model)
    conditions = condition_images(model, images)
    lora_dir = check_lora_dir(lora) if lora is not None else None
    out = Path(os.path.abspath(out_dir))  # `.` and a trailing slash name the folder itself
    check_output_dir(out, "--out")
    for flag, value in (("-n", n), ("--micro-batch-size", micro_batch_size)):
        if value < 1:
            raise ValueError(f"{flag} {value}: give at least 1")
    cfg = RolloutConfig(
        n=n,
        micro_batch_size=micro_batch_size,
        pipeline=PipelineConfig(
            height=settings["height"],
            width=settings["width"],
            num_inference_steps=settings["steps"],
            guidance_scale=settings["guidance_scale"],
            max_sequence_length=settings["max_sequence_length"],
            num_frames=settings["num_frames"],
            negative_prompt=settings["negative_prompt"],
            sigmas=settings["sigmas"],
        ),
        val=ValidationConfig(n=n, seed=seed, num_inference_steps=settings["steps"], noise_level=noise_level),
    )
    cfg.pipeline.validate("sample")
    cfg.val.validate("sample")
    # rich's bar on a terminal; elsewhere (a log, a pipe) it draws nothing: lines instead
    report: bool | LineProgress = progress
    if progress and not sys.stdout.isatty():
        report = LineProgress(len(prompts) * n, settings["steps"])
    if isinstance(model, ModelAdapter):
        adapter = model
    else:
        check_model_bounds(
            model, {"--steps": settings["steps"]}, {"--max-sequence-length": settings["max_sequence_length"]}
        )
        device = device or default_device()
        parsed = torch.device(check_device(device))
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        check_sample_memory(
            resolve_model_path(model),
            prompts=len(prompts),
            n=n,
            micro_batch_size=micro_batch_size,
            height=settings["height"],
            width=settings["width"],
            frames=settings["num_frames"],
            steps=settings["steps"],
            stochastic=noise_level > 0,
            dtype=dtype,
            device=parsed,
        )
        if isinstance(report, LineProgress):
            report.print(f"loading {model} on {device} ({dtype})")
        adapter = load_model(model, dtype=dtype, device=device)
    if lora_dir is not None:
        load_lora(adapter, lora_dir, lora_scale)
    rollout = TrajectorySampler(adapter, cfg, progress=report).sample_validation(
        list(prompts), images=[conditions] * len(prompts) if conditions else None
    )

    out.mkdir(parents=True, exist_ok=True)
    written = []
    with naming(out / "samples.jsonl"), open(out / "samples.jsonl", "w") as manifest:
        for b, (pixels, p) in enumerate(
            zip(rollout.samples.pixels, rollout.samples.prompt_index_B.tolist(), strict=True)
        ):
            path = out / f"{p:03d}_{b % n:02d}{'.gif' if adapter.is_video else '.png'}"
            with naming(path):
                _save(pixels, path, fps)
            written.append(path)
            manifest.write(
                json.dumps(
                    {
                        "file": path.name,
                        "prompt": prompts[p],
                        "seed": seed,
                        "sample": b % n,
                        **{key: settings[key] for key in GENERIC},
                        **({"images": [str(p) for p in images]} if conditions else {}),
                        **({"lora": str(lora_dir), "lora_scale": lora_scale} if lora_dir else {}),
                    }
                )
                + "\n"
            )
    return written


def _save(pixels: torch.Tensor, path: Path, fps: int) -> None:
    if pixels.dim() == 3:  # [3, H, W]
        Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy()).save(path)
        return
    save_gif(path, pixels, fps)  # [T, 3, H, W]
