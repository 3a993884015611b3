"""`vlm_judge` scoring speed on a full-size random Qwen2.5-VL-7B: images/s and memory, one JSON line.

The judge is written once to a local directory (`--build`, default /tmp/qwen25vl7b) with the real
architecture of Qwen/Qwen2.5-VL-7B-Instruct (config.json's values: 28 text layers of 3584, 28 heads /
4 KV heads, MLP 18944, vocabulary 152064; a 32-block vision tower of 1280 with window attention,
full attention in blocks 7/15/23/31, patches of 14 px merged 2 x 2 into 3584; 8.29 B parameters),
random bf16 weights initialised on the GPU, saved as safetensors, and the real image processor's
bounds (3136 to 12845056 pixels). The tokenizer and chat template are diffrl's tiny offline ones
(`diffrl.rewards.tiny_vlm`: a ~400-token byte-level BPE with Qwen's special tokens, in which "Yes"
and "No" are single tokens); the embedding table keeps its 152064 rows, so only the question's text
tokens differ a little in number from the real tokenizer's (the image tokens, most of a question, are
the image processor's and exact: a question is ~77 text tokens here against ~40 with Qwen's own
tokenizer, so the language model sees ~10% more tokens per question than a real run at 512², ~3% at
1024²). A directory with this benchmark's marker file is reused as is.

The reward is then built as a run builds it (`build_reward("vlm_judge", args)`, the path
`MultiReward` takes for `reward.functions.vlm_judge`) and scores `--images` random uint8 images per
resolution (512² and 1024²: 504² / 324 and 1036² / 1369 image tokens) after one warm-up batch, for
each `--batch-sizes` entry (the reward is built with the first; the others set its scorer's batch
size, which is all the constructor's `batch_size` does). Per row: images/s, the seconds spent in the
processor (`processor_s`, CPU: resize, patchify, copy to the device), in the vision tower
(`vision_s`), in the rest of the scorer (`language_s`: the language model, the two logits) and
outside it (`other_s`: the reward's uint8-to-PIL conversion, questions, means), the peak memory over
the measured call (`torch.cuda.max_memory_allocated`), tokens per image and per question, and the
range of the scores (random weights: around 0.5, always in [0, 1]).

    python benchmarks/vlm_judge.py                          # GPU: build /tmp/qwen25vl7b once, score
    python benchmarks/vlm_judge.py --batch-sizes 8 16 32 --images 128
    python benchmarks/vlm_judge.py --model /models/qwen2.5-vl-7b   # a real checkpoint, nothing built
    python benchmarks/vlm_judge.py --tiny --device cpu      # CPU smoke run on tiny_vlm's judge
    python benchmarks/vlm_judge.py --with-recipe            # + the e2e_recipe.py command with this judge

The SD3.5-M recipe with the judge on the policy's GPU (one GPU: the run's reward scores in its
process, on the GPU, in bf16), from `--with-recipe` (JSON `recipe_command`):

    python benchmarks/e2e_recipe.py --recipe flow_grpo --set reward.functions.jpeg_compressibility=null \\
        reward.functions.vlm_judge.weight=1.0 reward.functions.vlm_judge.args.model=/tmp/qwen25vl7b \\
        reward.functions.vlm_judge.args.batch_size=16

(the same command without `--set` is the recipe's step time with no reward model, JPEG's; on a CPU
the overrides run as `e2e_recipe.py --tiny --device cpu --recipe flow_grpo --steps 1 --set
model.compile=false <the four above, model=a tiny_vlm judge>`, its metrics `rewards/vlm_judge/*`).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MARKER = "diffrl_bench_vlm_judge.json"

# Qwen/Qwen2.5-VL-7B-Instruct config.json (text part; the token ids come from the tokenizer below).
TEXT = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    hidden_act="silu",
    max_position_embeddings=128000,
    max_window_layers=28,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
    sliding_window=32768,
    attention_dropout=0.0,
    initializer_range=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
)
# ... its vision_config
VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
    hidden_act="silu",
)
# ... and its preprocessor_config.json (CLIP's mean and std are the processor's defaults)
PROCESSOR = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2)

# Prompts of words the tiny tokenizer knows (any text works; these keep the questions short).
COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle", "star", "cat", "dog")


def log(message: str) -> None:
    print(f"vlm_judge bench: {message}", file=sys.stderr, flush=True)


def spec_hash(overrides: dict[str, Any] | None = None) -> str:
    """What the marker records: the architecture, processor and tokenizer this file builds."""
    spec = {"text": TEXT, "vision": VISION, "processor": PROCESSOR, "overrides": overrides or {}}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def judge_config(tokenizer: Any, overrides: dict[str, Any] | None = None) -> Any:
    """Qwen2.5-VL-7B's `Qwen2_5_VLConfig` with `tokenizer`'s special-token ids; `overrides`
    ({"text": {...}, "vision": {...}}) shrinks it for a CPU check of the build."""
    import transformers

    ids = tokenizer.convert_tokens_to_ids
    overrides = overrides or {}
    text = {
        **TEXT,
        **overrides.get("text", {}),
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    return transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config={**VISION, **overrides.get("vision", {})},
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def build_judge(
    directory: Path, device: str, *, overrides: dict[str, Any] | None = None, seed: int = 0
) -> dict[str, float]:
    """Write the random judge to `directory` unless it holds this spec's marker; returns the
    build's timings ({} when reused). Written to `<directory>.partial` first, then renamed."""
    import transformers

    from diffrl.rewards.tiny_vlm import QWEN2_5_VL_CHAT_TEMPLATE, tiny_qwen2_tokenizer

    marker = directory / MARKER
    want = spec_hash(overrides)
    if marker.is_file() and json.loads(marker.read_text()).get("spec") == want:
        log(f"reusing {directory}")
        return {}
    if directory.exists() and any(directory.iterdir()):
        raise SystemExit(
            f"vlm_judge bench: {directory} exists and is not this benchmark's judge (no {MARKER} of spec "
            f"{want}); remove it, name another --build directory, or score it with --model {directory}"
        )
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer = tiny_qwen2_tokenizer()
    config = judge_config(tokenizer, overrides)
    log(f"building a random Qwen2.5-VL-7B on {device} (bf16)")
    start = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.eval()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    built = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    log(f"{params / 1e9:.2f} B parameters in {built - start:.1f} s; saving to {directory}")
    model.save_pretrained(partial)
    del model
    tokenizer.save_pretrained(partial)
    transformers.Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(partial)
    # as tiny_vlm writes it: the auto class picks the torchvision backend where it is installed
    preprocessor = json.loads((partial / "preprocessor_config.json").read_text())
    preprocessor.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2_5_VLProcessor")
    (partial / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    (partial / "chat_template.json").write_text(
        json.dumps({"chat_template": QWEN2_5_VL_CHAT_TEMPLATE}, indent=2) + "\n"
    )
    (partial / MARKER).write_text(json.dumps({"spec": want, "params": params}) + "\n")
    if directory.exists():
        directory.rmdir()  # empty (checked above)
    partial.rename(directory)
    saved = time.perf_counter()
    log(f"saved in {saved - built:.1f} s")
    return {"build_s": built - start, "save_s": saved - built}


def build_tiny(directory: Path) -> dict[str, float]:
    from diffrl.rewards.tiny_vlm import save_tiny_vlm

    start = time.perf_counter()
    save_tiny_vlm(directory, "qwen2_5_vl")
    return {"build_s": time.perf_counter() - start}


def random_batch(count: int, size: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """`count` uint8 noise images of `size`² and a prompt for each."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (count, 3, size, size), generator=g, dtype=torch.uint8)
    prompts = [
        f"a {COLOURS[i % len(COLOURS)]} {SHAPES[i % len(SHAPES)]} next to a small "
        f"{COLOURS[(i + 1) % len(COLOURS)]} {SHAPES[(i + 2) % len(SHAPES)]}"
        for i in range(count)
    ]
    return pixels, prompts


class Timers:
    """Seconds in the scorer's processor call and in the vision tower, accumulated while on."""

    def __init__(self, scorer: Any, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.processor_s = 0.0
        self.vision_s = 0.0
        self.scorer_s = 0.0
        inputs, p_yes = scorer.inputs, scorer.p_yes

        def timed_inputs(queries):
            self.sync()
            start = time.perf_counter()
            batch = inputs(queries)
            self.sync()
            self.processor_s += time.perf_counter() - start
            return batch

        def timed_p_yes(queries):
            start = time.perf_counter()
            scores = p_yes(queries)  # on the CPU when it returns
            self.scorer_s += time.perf_counter() - start
            return scores

        # instance attributes: the class's methods are untouched
        scorer.inputs, scorer.p_yes = timed_inputs, timed_p_yes
        inner = scorer.model.model
        visual = getattr(inner, "visual", None) or getattr(scorer.model, "visual", None)
        if visual is not None:
            visual.register_forward_pre_hook(lambda *_: self._vision_start())
            visual.register_forward_hook(lambda *_: self._vision_end())
        self._started = 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _vision_start(self) -> None:
        self.sync()
        self._started = time.perf_counter()

    def _vision_end(self) -> None:
        self.sync()
        self.vision_s += time.perf_counter() - self._started

    def reset(self) -> None:
        self.processor_s = self.vision_s = self.scorer_s = 0.0


def tokens(scorer: Any, pixels: torch.Tensor, prompt: str) -> tuple[int, int]:
    """(image tokens, all tokens) of one question about one image, as the scorer builds it."""
    from diffrl.rewards.base import to_pil
    from diffrl.rewards.vlm_judge import DEFAULT_TEMPLATE, PROMPT

    question = DEFAULT_TEMPLATE.replace(PROMPT, prompt)
    batch = scorer.inputs([(to_pil(pixels[:1]), question)])
    ids = batch["input_ids"][0]
    return int((ids == scorer.model.config.image_token_id).sum()), int(ids.numel())


def score_rows(reward: Any, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    scorer = reward.scorer
    timers = Timers(scorer, device)
    cuda = device.type == "cuda"
    rows = []
    for size in args.sizes:
        pixels, prompts = random_batch(args.images, size, seed=size)
        image_tokens, seq_tokens = tokens(scorer, pixels, prompts[0])
        for batch_size in args.batch_sizes:
            scorer.batch_size = batch_size
            log(f"{size}²: batch {batch_size}, {image_tokens} image tokens of {seq_tokens}; warm-up")
            reward(pixels[:batch_size], prompts[:batch_size])
            timers.sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            timers.reset()
            start = time.perf_counter()
            out = reward(pixels, prompts)
            timers.sync()
            wall = time.perf_counter() - start
            scores = out.scores_B
            row = {
                "size": size,
                "batch_size": batch_size,
                "images": args.images,
                "images_per_s": args.images / wall,
                "wall_s": wall,
                "processor_s": timers.processor_s,
                "vision_s": timers.vision_s,
                "language_s": timers.scorer_s - timers.processor_s - timers.vision_s,
                "other_s": wall - timers.scorer_s,
                "tokens_per_image": image_tokens,
                "tokens_per_question": seq_tokens,
                "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
                "score_min": float(scores.min()),
                "score_mean": float(scores.mean()),
                "score_max": float(scores.max()),
                "scores_finite": bool(torch.isfinite(scores).all()),
            }
            log(
                f"{size}²: batch {batch_size}: {row['images_per_s']:.2f} images/s, processor "
                f"{row['processor_s']:.2f} s, vision {row['vision_s']:.2f} s of {wall:.2f} s"
                + (f", peak {row['peak_gb']:.1f} GB" if cuda else "")
            )
            rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def recipe_command(model: Path, batch_size: int) -> list[str]:
    """e2e_recipe.py's flow_grpo recipe with this judge in place of its JPEG reward."""
    return [
        "python",
        "benchmarks/e2e_recipe.py",
        "--recipe",
        "flow_grpo",
        "--set",
        "reward.functions.jpeg_compressibility=null",
        "reward.functions.vlm_judge.weight=1.0",
        f"reward.functions.vlm_judge.args.model={model}",
        f"reward.functions.vlm_judge.args.batch_size={batch_size}",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--build", type=Path, default=None, help="judge directory, built if absent")
    parser.add_argument(
        "--model", type=Path, default=None, help="an existing judge directory (nothing built)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny_vlm's random judge (CPU smoke run)")
    parser.add_argument("--device", default="cuda", help="where the judge is built and scores")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="image sides in pixels")
    parser.add_argument("--images", type=int, default=64, help="images scored per size and batch size")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16], help="questions per forward")
    parser.add_argument("--with-recipe", action="store_true", help="add the e2e_recipe.py command (JSON)")
    args = parser.parse_args(argv)
    from diffrl.rewards.registry import build_reward

    timings: dict[str, float] = {}
    if args.model is not None:
        model = args.model
    elif args.tiny:
        model = args.build or Path(tempfile.mkdtemp(prefix="vlm_judge_tiny_")) / "judge"
        timings = build_tiny(model)
    else:
        model = args.build or Path("/tmp/qwen25vl7b")
        timings = build_judge(model, args.device)
    device = torch.device(args.device)
    if device.type == "cuda":  # the build's copy is gone before the reward loads its own
        gc.collect()
        torch.cuda.empty_cache()
    log(f"loading {model} through the vlm_judge reward on {device}")
    start = time.perf_counter()
    reward = build_reward(
        "vlm_judge", {"model": str(model), "device": args.device, "batch_size": args.batch_sizes[0]}
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    timings["load_s"] = time.perf_counter() - start
    scorer = reward.scorer
    weights_gb = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None
    log(f"loaded in {timings['load_s']:.1f} s" + (f", {weights_gb:.1f} GB" if weights_gb else ""))
    rows = score_rows(reward, args, device)
    import transformers

    config = scorer.model.config
    result = {
        "bench": "vlm_judge",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "judge": "tiny_vlm qwen2_5_vl"
        if args.tiny
        else ("checkpoint" if args.model else "random Qwen2.5-VL-7B"),
        "model": str(model),
        "params_b": sum(p.numel() for p in scorer.model.parameters()) / 1e9,
        "dtype": str(scorer.dtype).removeprefix("torch."),
        "attn_implementation": config._attn_implementation,
        "image_processor": type(scorer.processor.image_processor).__name__,
        "weights_gb": weights_gb,
        **{k: round(v, 2) for k, v in timings.items()},
        "runs": rows,
    }
    if args.with_recipe:
        result["recipe_command"] = " ".join(recipe_command(model, args.batch_sizes[-1]))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
