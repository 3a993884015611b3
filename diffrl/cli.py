"""The `diffrl` command."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from diffrl import __version__

# Parsing the command line imports nothing heavy (torch, diffusers, transformers, Ray): every
# command imports what it needs inside its function, so `diffrl --help` and `diffrl config` start
# in well under a second. tests/test_cli.py checks it.

# (command, what it does): the --help examples; a command too long for the column gets its
# description on the next line, at the column
EXAMPLES = (
    ("diffrl presets", "list the built-in presets"),
    ("diffrl config", "the default preset, fully resolved"),
    (
        "diffrl config default rollout.sde.noise_level=0.8 actor.optim.lr=1e-4",
        "the same with two keys changed",
    ),
    (
        "diffrl config my_run.yaml trainer.total_steps=10",
        "a YAML file (`base: default` + the keys it changes)",
    ),
    ("diffrl eval runs/latest", "held-out accuracy of the last run's newest checkpoint"),
    ("diffrl check tiny_sd3", "is the setup consistent? (sampler, log-probs, rewards, memory)"),
    ("diffrl sft", "retrain the shapes world's toy model (a GPU job)"),
    ("diffrl export runs/latest --out my_lora", "the trained LoRA, diffusers format"),
    ("diffrl export runs/latest --out my_model --merge", "a full pipeline, LoRA merged"),
    ('diffrl sample --model ./sd35-medium --prompt "a cat holding a sign" -n 4 --out samples/', "4 images"),
    (
        'diffrl sample --model ./sd35-medium --lora my_lora --prompt "a cat holding a sign" --out samples/',
        "with a trained LoRA",
    ),
    (
        'diffrl sample --model ./flux-kontext --image cat.png --prompt "make the cat blue" --out samples/',
        "an edit of cat.png",
    ),
)
_EXAMPLE_COLUMN = 52


def _examples() -> str:
    lines = []
    for command, what in EXAMPLES:
        if len(command) <= _EXAMPLE_COLUMN - 3:  # two spaces at least between command and text
            lines.append(f"  {command:<{_EXAMPLE_COLUMN - 1}}{what}")
        else:
            lines += [f"  {command}", f"  {'':<{_EXAMPLE_COLUMN - 1}}{what}"]
    return "\n".join(lines)


EPILOG = f"""\
examples:
{_examples()}

Keys and their meaning: docs/configuration.md
"""


def _split_source(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[PRESET|file.yaml] [key=value ...]` -> (source, overrides)."""
    if items and "=" not in items[0]:
        return items[0], list(items[1:])
    return None, list(items)


def cmd_presets(args: argparse.Namespace) -> int:
    from diffrl.config.catalog import format_presets

    print(format_presets(), end="")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from diffrl.config import load_config, to_yaml

    source, overrides = _split_source(args.items)
    cfg = load_config(source, overrides)
    print(to_yaml(cfg), end="")
    print("# derived (computed from the keys above):")
    for line in OmegaConf.to_yaml(cfg.derived()).splitlines():
        print(f"#   {line}")
    return 0


def _config_first(items: Sequence[str], job: str, default: str | None = None) -> tuple[str | None, list[str]]:
    """(source, overrides) of `items`, once the config loads (`default`: the job's preset when none is
    named): a config error is found in a second, before the job imports torch, diffusers and Ray
    (10-20 s on a slow host)."""
    from diffrl.config import load_config
    from diffrl.config.early_checks import check_model_dir

    source, overrides = _split_source(items)
    cfg = load_config(source or default, overrides, job=job)
    check_model_dir(cfg.model.path)
    return source, overrides


def _run_of(target: str) -> Path | None:
    """The run directory (with config.yaml) that TARGET is, or is a checkpoint of
    (RUN/checkpoints/step_N, RUN/checkpoints/best); None for anything else."""
    path = Path(target)
    if (path / "config.yaml").is_file():
        return path
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent
    return None


def cmd_train(args: argparse.Namespace) -> int:
    source, overrides = _config_first(args.items, "train")
    # the first words within a second: torch, diffusers and Ray take 5-20 s to import, the setup
    # check seconds to a minute more, before the run's own first line (its directory)
    print(
        f"diffrl train {source or 'default'}: starting (libraries, model, setup check) ...",
        file=sys.stderr,
        flush=True,
    )
    from diffrl.controller.run import train
    from diffrl.controller.stopping import Interrupted, stop_signals
    from diffrl.telemetry.health import HealthStop

    try:
        with stop_signals(["diffrl", "train", *args.items]) as signals:  # Ctrl-C, SIGTERM
            run_dir = train(source, overrides)
    except HealthStop as stop:  # trainer.health.stop_on or a signal: checkpoint saved, weights exported
        print(f"diffrl train: stopped: {stop}", file=sys.stderr)
        return signals.exit_status(HealthStop.EXIT_STATUS)
    except Interrupted as stop:  # a signal outside the training loop, or a second one
        print(f"diffrl train: {stop}", file=sys.stderr)
        return stop.exit_status
    print(f"run finished: {run_dir}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    source, overrides = _config_first(args.items, "train")
    from diffrl.controller.check import check

    report = check(source, overrides, quick=args.quick)
    print(report.table(), end="")
    return report.exit_code


def cmd_sft(args: argparse.Namespace) -> int:
    source, overrides = _config_first(args.items, "sft", default="shapes_sft")
    from diffrl.controller.sft import sft
    from diffrl.controller.stopping import Interrupted, stop_signals
    from diffrl.telemetry.health import HealthStop

    try:
        with stop_signals(["diffrl", "sft", *args.items]) as signals:  # Ctrl-C, SIGTERM
            run_dir = sft(source, overrides)
    except HealthStop as stop:  # trainer.health.stop_on or a signal: checkpoint saved, model exported
        print(f"diffrl sft: stopped: {stop}", file=sys.stderr)
        return signals.exit_status(HealthStop.EXIT_STATUS)
    except Interrupted as stop:  # a signal outside the training loop, or a second one
        print(f"diffrl sft: {stop}", file=sys.stderr)
        return stop.exit_status
    print(f"run finished: {run_dir}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    # the config evaluate.resolve_target will use: the run's, else the default preset's on the model
    run = _run_of(args.target)
    if run is not None:
        _config_first([str(run / "config.yaml"), *args.overrides], "eval")
    elif not Path(args.target).is_dir() or (Path(args.target) / "model_index.json").is_file():
        _config_first(["default", f"model.path={args.target}", *args.overrides], "eval")
    from diffrl.controller.evaluate import evaluate

    evaluate(args.target, args.overrides, args.out, with_base=args.with_base)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from diffrl.config.early_checks import check_device

    check_device(args.device)
    # (a run's own config.yaml is loaded after its checkpoint is found: "no checkpoint" comes first)
    if _run_of(args.target) is None and not (Path(args.target) / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{args.target} is neither a run directory (with config.yaml) nor a checkpoint "
            "(RUN/checkpoints/step_N)" + ("" if Path(args.target).exists() else ": it does not exist")
        )
    from diffrl.train.export_run import export_run

    out = export_run(args.target, args.out, merge=args.merge, device=args.device, best=args.best)
    print(out.describe())
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from diffrl.config.early_checks import check_device, check_model_dir

    if args.device is not None:
        check_device(args.device)  # before anything reads the model directory
    prompts = list(args.prompt)
    if args.prompts_file:
        from diffrl.data.prompts import read_text_prompts

        prompts += read_text_prompts(Path(args.prompts_file), "--prompts-file")
    if prompts and args.lora is None:  # else generate's errors for those come first, as they did
        check_model_dir(args.model)  # the device and the model before torch and diffusers load (seconds)
    from diffrl.rollout.generate import FLAGS, describe_settings, generate, sampling_settings

    given = {key: getattr(args, key) for key in FLAGS}
    settings, sources = sampling_settings(args.model, args.lora, given)
    print(f"sampling with {describe_settings(settings, sources)}")
    written = generate(
        args.model,
        prompts,
        args.out,
        n=args.n,
        seed=args.seed,
        **{key: settings[key] for key in FLAGS},
        noise_level=args.noise_level,
        dtype=args.dtype,
        device=args.device,
        micro_batch_size=args.micro_batch_size,
        lora=args.lora,
        lora_scale=args.lora_scale,
        images=args.image,
    )
    print(f"wrote {len(written)} file(s) and samples.jsonl to {written[0].parent}")
    return 0


def _add_source_items(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "items",
        nargs="*",
        metavar="[PRESET|file.yaml] [key=value ...]",
        help=f"a preset name (default: '{default}') or a YAML file, then dotted key=value overrides",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffrl",
        description="RL post-training for diffusion and flow-matching models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"diffrl {__version__}")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show third-party warnings and progress bars (transformers, diffusers, Ray); hidden by default",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="run an RL job from a preset or YAML file with key=value overrides",
        description="Run an RL job. Config errors, a missing model or data file, or an unknown reward are "
        "reported before anything starts. trainer.resume=auto continues the run named trainer.run_name.",
    )
    _add_source_items(train, default="default")
    train.set_defaults(func=cmd_train)

    check = sub.add_parser(
        "check",
        help="prove a setup is consistent before a long run: a table of checks, measured values, tolerances",
        description="Run, on the config's own model and settings, what the test suite proves on tiny models: "
        "the ODE sampler against the family's diffusers pipeline, every pipeline setting read back from what "
        "ran, the sampled log-probs against the trainer's recomputation, each reward, the peak memory of one "
        "micro-batch per phase, and (separate placement) the replicas' weights after a sync. Exit 0 when every "
        "check passes, 1 when one fails, 2 for a bad config. docs/check.md describes each check.",
    )
    _add_source_items(check, default="default")
    check.add_argument(
        "--quick",
        action="store_true",
        help="only the checks that cost seconds (what `diffrl train` runs at start): no memory phases at the "
        "preset's sizes, no separate pools",
    )
    check.set_defaults(func=cmd_check)

    sft = sub.add_parser(
        "sft",
        help="supervised flow-matching fine-tuning on images and prompts (default: retrain the shapes model, on a GPU)",
        description="Supervised flow matching on (image, prompt) pairs from a dataset, or on freshly rendered "
        "shapes-world images (the 'shapes_sft' preset, the default: 8,000 steps of 512 images, a job for one GPU, "
        "hours on a CPU). Writes the trained pipeline to RUN/model.",
    )
    _add_source_items(sft, default="shapes_sft")
    sft.set_defaults(func=cmd_sft)

    evaluate = sub.add_parser(
        "eval",
        help="validation metrics (e.g. shapes held-out accuracy) of a run, checkpoint or model",
        description="Run the validation of a run directory (its newest checkpoint), a checkpoint directory, "
        "or a model (a diffusers directory, toy:shapes, tiny:<family>; with the default preset's validation).",
    )
    evaluate.add_argument("target", help="RUN_DIR, RUN_DIR/checkpoints/step_N, or a model path")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    evaluate.add_argument("--out", help="output folder (default: RUN_DIR/eval/step_N or runs/eval/NAME)")
    evaluate.add_argument(
        "--with-base",
        action="store_true",
        help="also validate the base model the run started from, on the same prompts and noise, and show "
        "both side by side (OUT/base_vs_trained.png, a paired per-category table)",
    )
    evaluate.set_defaults(func=cmd_eval)

    export = sub.add_parser(
        "export",
        help="write a run's trained weights: LoRA in the diffusers format, or a full pipeline (--merge)",
        description="Export the weights of a run directory (its newest checkpoint) or of one checkpoint "
        "(RUN/checkpoints/step_N). A LoRA run gives the adapter in the diffusers format "
        "(pipe.load_lora_weights(OUT), or diffrl sample --lora OUT); --merge, or a full fine-tuning run, "
        "gives a whole diffusers pipeline directory (DiffusionPipeline.from_pretrained(OUT)).",
    )
    export.add_argument("target", help="RUN_DIR, RUN_DIR/checkpoints/step_N or RUN_DIR/checkpoints/best")
    export.add_argument(
        "--out",
        required=True,
        help="output folder: a new one, or an earlier export, which is replaced once the new one is whole "
        "(a run, its checkpoints or any other folder is refused)",
    )
    export.add_argument(
        "--merge", action="store_true", help="merge the LoRA into the base model and write the whole pipeline"
    )
    export.add_argument("--device", default="cpu", help="where to load the model (default cpu)")
    export.add_argument(
        "--best",
        action="store_true",
        help="the run's best checkpoint, RUN/checkpoints/best (kept with trainer.keep_best=true), not its newest",
    )
    export.set_defaults(func=cmd_export)

    presets = sub.add_parser("presets", help="list the built-in presets and how far each has been verified")
    presets.set_defaults(func=cmd_presets)

    config = sub.add_parser(
        "config",
        help="print the resolved config of a preset or YAML file with key=value overrides",
        description="Print the fully resolved config: schema defaults <- preset or file <- overrides.",
    )
    _add_source_items(config, default="default")
    config.set_defaults(func=cmd_config)

    sample = sub.add_parser(
        "sample",
        help="generate images (or videos) from a model directory",
        description="Generate images or videos with the ODE sampler (or an SDE with --noise-level > 0). "
        "Size, steps, guidance and text length default to what the LoRA's run or the model was trained "
        "with (their diffrl_sampling.json); the line printed first says which were used.",
    )
    sample.add_argument("--model", required=True, help="local diffusers pipeline directory")
    sample.add_argument(
        "--lora", help="a LoRA directory in the diffusers format (`diffrl export RUN --out DIR` writes one)"
    )
    sample.add_argument("--lora-scale", type=float, default=1.0, help="LoRA strength (default 1)")
    sample.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    sample.add_argument("--prompts-file", help="a text file with one prompt per line")
    sample.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="image-edit models: the image to edit, the same for every prompt (repeat for models that "
        "take several, e.g. Qwen-Image-Edit-2509)",
    )
    sample.add_argument("-n", type=int, default=1, help="samples per prompt (default 1)")
    sample.add_argument("--out", required=True, help="output folder (images, videos as GIF, samples.jsonl)")
    sample.add_argument("--seed", type=int, default=0)
    # Sampler settings left out come from the LoRA's or the model's diffrl_sampling.json (a run's
    # export and toy:shapes have one: what the model was trained and validated with), else the defaults.
    from_model = "default: the LoRA's or the model's own (diffrl_sampling.json), else"
    sample.add_argument("--steps", type=int, help=f"denoising steps ({from_model} 28)")
    sample.add_argument("--guidance-scale", type=float, help=f"CFG scale; 1 disables CFG ({from_model} 4.5)")
    sample.add_argument(
        "--height", type=int, help=f"image height ({from_model} the model's sample size, else 512)"
    )
    sample.add_argument("--width", type=int, help=f"image width ({from_model} as --height)")
    sample.add_argument("--num-frames", type=int, help=f"frames, video models ({from_model} 1)")
    sample.add_argument("--negative-prompt", help=f"negative prompt ({from_model} none)")
    sample.add_argument(
        "--max-sequence-length", type=int, help=f"text tokens of the T5-like encoder ({from_model} 256)"
    )
    sample.add_argument("--noise-level", type=float, default=0.0, help="0 = deterministic ODE sampling")
    sample.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bf16 on GPU")
    sample.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    sample.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward")
    sample.set_defaults(func=cmd_sample)

    # The reward server's module imports the reward stack; its parser is built only when the
    # command runs (here a placeholder takes every argument, `--help` included, verbatim).
    serve = sub.add_parser(
        "serve-reward",
        help="serve a registered reward over HTTP (JSON + base64 PNG); `diffrl serve-reward --help`",
        add_help=False,
        prefix_chars="\0",
    )
    serve.add_argument("argv", nargs="*")
    serve.set_defaults(func=cmd_serve_reward)
    return parser


def cmd_serve_reward(args: argparse.Namespace) -> int:
    from diffrl.rewards.serve_cli import register_cli

    parser = argparse.ArgumentParser(prog="diffrl")
    register_cli(parser.add_subparsers(dest="command"))
    real = parser.parse_args(["serve-reward", *args.argv])
    return real.func(real)


def _disk_full(error: BaseException) -> tuple[str, str | None] | None:
    """(the OS's message, the file) of the full-disk error (ENOSPC, EDQUOT) `error` is or was
    raised from (a worker's error carries its cause), or None. Every diffrl write names its file
    (`diffrl.files.naming`), so the first such error in the chain that names one is taken; the
    file is None only for a write outside diffrl's own."""
    from diffrl.files import os_errno

    found = []
    seen: BaseException | None = error
    while seen is not None:
        code = os_errno(seen)
        if code in (errno.ENOSPC, errno.EDQUOT):
            found.append((os.strerror(code), getattr(seen, "filename", None)))
        seen = seen.__cause__ or seen.__context__
    return next((item for item in found if item[1] is not None), found[0] if found else None)


def _print_worker_failure(command: str, error: BaseException) -> bool:
    """A worker's failure, in one line, when its whole text (the remote traceback, the worker's
    last log lines, this process's traceback) is in the run's console.log; whether it printed."""
    from diffrl.workers.errors import WorkerError

    logged = getattr(error, "logged_to", None)
    if not isinstance(error, WorkerError) or logged is None or not Path(logged).is_file():
        return False  # no file kept it (a start that failed before its first record): all of it here
    summary = str(error).split("\n", 1)[0]
    print(f"diffrl {command}: {summary} (its traceback and last log lines: {logged})", file=sys.stderr)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "check" and not any(e.startswith("-") for e in extra):
        # `diffrl check PRESET --quick key=value`: overrides after the flag belong to the items too
        args.items += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    from diffrl.telemetry.console import configure

    configure(verbose=args.verbose)  # before any command imports transformers, diffusers or Ray
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        # User errors carry their own fix in the message; a traceback would bury it.
        print(f"diffrl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Exception as error:
        full = _disk_full(error)
        if full is None:
            if _print_worker_failure(args.command, error):
                return 1
            raise
        strerror, filename = full
        # Every write diffrl makes is atomic (temporary file or folder, then a rename), so what was
        # published before stays whole: say so, and where the disk filled.
        print(
            f"diffrl {args.command}: error: the disk is full ({strerror}) writing "
            f"{filename or 'a file'}: nothing was half-written (files and checkpoints are written to "
            "a temporary name and renamed when whole), so every checkpoint and metrics line already "
            "there is intact; free space on that file system, then resume (trainer.resume=auto) or rerun",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
