"""FLUX.2 [dev] (`Flux2Pipeline`): the adapter and its tiny random builder.

FLUX.2 [dev] and FLUX.2 [klein] share the transformer classes, the VAE, the packed 2x2-patchified
latents, the schedule (`compute_empirical_mu`, the same function in both pipeline modules) and the
decode, so `Flux2DevAdapter` is `Flux2KleinAdapter` with what `Flux2Pipeline` (diffusers 0.42)
does differently:

- Text: a Mistral-Small-3 vision-language encoder (`Mistral3ForConditionalGeneration`) behind a
  `PixtralProcessor`. Each prompt becomes a chat of the pipeline's system message and one user
  message (`format_input`), rendered by the processor's chat template (no generation prompt),
  padded and truncated to `max_sequence_length`; the hidden states of layers (10, 20, 30) are
  stacked on the feature axis: embeds [P, max_sequence_length, 3·D_text], no mask (the
  transformer attends to the padding too, as in the pipeline). Truncation keeps the start, so
  the system message's tokens come first: a `max_sequence_length` that leaves no room for the
  prompt is refused (the pipeline would silently encode the system message alone).
- Guidance: guidance-distilled, no CFG pass. `guidance_scale` goes into the transformer's
  guidance embedding, `guidance = full([B], guidance_scale)` in fp32 (the transformer scales it
  by 1000 itself, as it does the timestep t/1000); one forward per step; negatives are never used.
  The model card samples 50 steps at guidance 4 (the pipeline's default guidance_scale).
- Network call: `transformer(hidden_states, timestep=t/1000, guidance, encoder_hidden_states,
  txt_ids, img_ids)`, t = 1000·σ cast to the compute dtype first, as the pipeline.

The processor. transformers 5's `PixtralProcessor` module imports torchvision, which diffrl does
not require; without torchvision `transformers.PixtralProcessor` is a placeholder that diffusers
can neither load nor accept a stand-in for. So there `loaded_components` leaves the `tokenizer`
out of diffusers' loading and `with_text_processor` attaches the folder's text side as
`PixtralTextProcessor`: a `ProcessorMixin` with the folder's tokenizer and chat template only,
whose `apply_chat_template` (and so its tokenization) is `ProcessorMixin`'s own, the code
`PixtralProcessor` runs for text (it overrides only image handling). Text-to-image never calls
the image side. The pipeline's config keeps naming `PixtralProcessor`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import ProcessorMixin

from diffrl.models.base import PromptEmbeds
from diffrl.models.flux2 import FLUX2_SCHEDULER_CONFIG, Flux2KleinAdapter

#: Mistral-3 hidden layers the pipeline stacks into the text embedding (`text_encoder_out_layers`).
TEXT_LAYERS = (10, 20, 30)
#: What `PixtralProcessor` saves besides the tokenizer (its `__init__` arguments), with the real
#: checkpoint's vision sizes; `PixtralTextProcessor` keeps them so that a saved folder stays a
#: `PixtralProcessor` folder.
PIXTRAL_DEFAULTS = {
    "patch_size": 14,
    "spatial_merge_size": 2,
    "image_token": "[IMG]",
    "image_break_token": "[IMG_BREAK]",
    "image_end_token": "[IMG_END]",
}


class PixtralTextProcessor(ProcessorMixin):
    """The text side of transformers' `PixtralProcessor` (module docstring): the tokenizer and chat
    template, `ProcessorMixin`'s own `apply_chat_template` and `__call__`. It saves a folder that
    `PixtralProcessor.from_pretrained` (and `AutoProcessor`) loads: `processor_class`
    PixtralProcessor, the Pixtral sizes, and the image processor's config it was loaded with."""

    def __init__(self, tokenizer=None, chat_template=None, **pixtral: Any):
        super().__init__(tokenizer, chat_template=chat_template)
        unknown = set(pixtral) - {*PIXTRAL_DEFAULTS, "image_processor"}
        if unknown:
            raise ValueError(f"PixtralTextProcessor got unknown settings {sorted(unknown)}")
        self.pixtral = {**PIXTRAL_DEFAULTS, **pixtral}

    @classmethod
    def from_folder(cls, folder: str | Path) -> PixtralTextProcessor:
        """Load a saved `PixtralProcessor` folder's tokenizer, chat template and settings."""
        from transformers import AutoTokenizer

        folder = Path(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else tokenizer.chat_template
        if template is None:
            raise ValueError(
                f"{folder} has no chat template (chat_template.jinja): it is not a Pixtral processor"
            )
        config_file = folder / "processor_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        settings = {k: config[k] for k in (*PIXTRAL_DEFAULTS, "image_processor") if k in config}
        processor = cls(tokenizer=tokenizer, chat_template=template, **settings)
        processor.source_folder = folder
        return processor

    def save_pretrained(self, save_directory, **kwargs):
        """The folder a real `PixtralProcessor` writes: tokenizer files, chat_template.jinja and
        processor_config.json (its settings and, nested, the image processor's config). Loaded
        from a folder (`from_folder`), it copies that folder's files (what a checkpoint holds that
        this class does not, e.g. a separate image processor config) instead."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        source = getattr(self, "source_folder", None)
        if source is not None:
            if Path(source).resolve() != folder.resolve():
                for file in Path(source).iterdir():
                    if file.is_file():
                        shutil.copy2(file, folder / file.name)
            return [str(folder / "processor_config.json")]
        self.tokenizer.save_pretrained(folder)
        (folder / "chat_template.jinja").write_text(self.chat_template)
        config = {**self.pixtral, "processor_class": "PixtralProcessor"}
        (folder / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer_config = folder / "tokenizer_config.json"
        settings = json.loads(tokenizer_config.read_text())
        settings["processor_class"] = "PixtralProcessor"
        tokenizer_config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        return [str(folder / "processor_config.json")]


class Flux2DevAdapter(Flux2KleinAdapter):
    """FLUX.2 [dev] through `Flux2Pipeline`: [klein]'s latents, schedule, network and decode with a
    Mistral-3 text encoder and the distilled guidance embedding instead of CFG (module docstring)."""

    pipeline_class_name: ClassVar[str] = "Flux2Pipeline"
    family_name: ClassVar[str] = "FLUX.2 [dev]"

    @classmethod
    def loaded_components(cls, path: Path) -> dict[str, Any]:
        """Where torchvision is missing, no `tokenizer` for diffusers to load (module docstring:
        `from_pretrained` then attaches its text side); otherwise diffusers loads the
        `PixtralProcessor` itself."""
        from transformers.utils import is_torchvision_available

        return {} if is_torchvision_available() else {"tokenizer": None}

    @classmethod
    def from_pretrained(cls, path, device: torch.device, dtype: torch.dtype) -> Flux2DevAdapter:
        adapter = super().from_pretrained(path, device, dtype)
        with_text_processor(adapter.pipe, path)
        return adapter

    def _check_transformer(self, pipe) -> None:
        if not pipe.transformer.config.guidance_embeds:
            raise ValueError(
                "this FLUX.2 transformer has no guidance embedding (guidance_embeds=False), which "
                "Flux2Pipeline's guidance_scale drives: FLUX.2 [dev] is guidance-distilled. A [klein] "
                "transformer loads with Flux2KleinPipeline"
            )

    @property
    def distilled(self) -> bool:
        """Not step-distilled: FLUX.2 [dev] samples its full step count (guidance-distilled instead)."""
        return False

    # ------------------------------------------------------------------------------ text
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        max_sequence_length: int,
    ) -> PromptEmbeds:
        """`pipe.encode_prompt` (Mistral-3 layers 10, 20, 30): embeds [P, max_sequence_length, 3·D_text].
        Negatives are encoded when given, as for any family, though no setting uses them here."""
        if isinstance(max_sequence_length, int) and 1 <= max_sequence_length <= self.max_text_tokens:
            prefix = self.template_tokens()
            if max_sequence_length <= prefix:
                raise ValueError(
                    f"max_sequence_length={max_sequence_length} leaves no room for the prompt: FLUX.2 [dev]'s "
                    f"system message and chat template take {prefix} tokens before it, and the pipeline "
                    f"truncates at the end. Use more than {prefix} (the model card's 512)"
                )
        return super().encode_prompts(prompts, negative_prompts, max_sequence_length)

    def template_tokens(self) -> int:
        """Tokens of the chat around an empty prompt: the system message and the template's markers."""
        if getattr(self, "_template_tokens", None) is None:
            from diffusers.pipelines.flux2.pipeline_flux2 import format_input

            ids = self.pipe.tokenizer.apply_chat_template(
                format_input([""], system_message=self.pipe.system_message),
                add_generation_prompt=False,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
            self._template_tokens = len(ids[0])
        return self._template_tokens

    def wants_negative(self, guidance_scale: float, true_cfg_scale: float | None = None) -> bool:
        """Never: `guidance_scale` is the distilled guidance embedding, not CFG."""
        return False

    def pipeline_call(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str] | None,
        *,
        num_inference_steps: int,
        guidance_scale: float,
        true_cfg_scale: float | None,
        height: int,
        width: int,
        num_frames: int,
        max_sequence_length: int,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> dict[str, Any]:
        """The `Flux2Pipeline` call of these settings: `guidance_scale` as given (the guidance
        embedding), no negatives (the pipeline takes none)."""
        self._require_no_true_cfg(true_cfg_scale)
        self._require_no_images(images)
        self._latent_hw(height, width, num_frames)
        return dict(
            prompt=list(prompts),
            guidance_scale=guidance_scale,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            max_sequence_length=max_sequence_length,
        )

    # ------------------------------------------------------------------------------ network
    def _guidance(self, guidance_scale: float, rows: int) -> torch.Tensor:
        """`full([rows], guidance_scale)` in fp32, as the pipeline builds it."""
        return torch.full([1], guidance_scale, device=self.device, dtype=torch.float32).expand(rows)

    def _unpack(self, latents: torch.Tensor, ids: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """`Flux2Pipeline._unpack_latents_with_ids` reads the grid size off the ids."""
        return self.pipe._unpack_latents_with_ids(latents, ids)


def with_text_processor(pipe, path: str | Path):
    """`pipe` (a `Flux2Pipeline` loaded from `path`) with a processor: where diffusers loaded none
    (`Flux2DevAdapter.loaded_components` without torchvision), the text side of the folder's
    `PixtralProcessor` (`PixtralTextProcessor`), the config still naming `PixtralProcessor`."""
    if pipe.tokenizer is None:
        pipe.register_modules(tokenizer=PixtralTextProcessor.from_folder(Path(path) / "tokenizer"))
        pipe.register_to_config(tokenizer=("transformers", "PixtralProcessor"))
    return pipe


# ---------------------------------------------------------------------------------- tiny builder
#: A Mistral-style chat template (written for the tiny processor): BOS, the system message in
#: [SYSTEM_PROMPT]..[/SYSTEM_PROMPT], each user turn in [INST]..[/INST], assistant turns closed by
#: EOS; a message's content is a string or a list of parts, of which the text parts are rendered
#: (an image part as [IMG]).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = namespace(value='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}"
    "{%- elif part['type'] == 'image' -%}{%- set text.value = text.value + '[IMG]' -%}{%- endif -%}"
    "{%- endfor -%}{%- set text = text.value -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{%- elif message['role'] == 'user' -%}[INST]{{ text }}[/INST]"
    "{%- else -%}{{ text }}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
)
#: The special tokens of the tiny vocabulary (Mistral's control tokens the template and the
#: processor use), first in the vocabulary as in Mistral's.
_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)
_TINY_CORPUS = (
    "a photo of an image with one two three four five red green blue yellow purple orange black white "
    "circle square triangle star cat dog on the left right top bottom above below next to small large "
    "blurry low quality text that says hello world"
)


def tiny_mistral_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer built offline with the `tokenizers` library (Mistral's tekken
    vocabulary is byte-level BPE too), trained on the pipeline's system message (so that it is a few
    dozen tokens, as with the real tokenizer, and fits short test sequences) and a few prompt
    words; Mistral's control tokens are special, <pad> pads (on the right)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([SYSTEM_MESSAGE] * 8 + [_TINY_CORPUS] * 8, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=131072,
    )


def build_tiny(path: Path, seed: int = 0) -> Path:
    """Write a tiny random FLUX.2 [dev] pipeline (`tiny_pipeline`) to `path`."""
    from diffusers import Flux2Pipeline

    pipe = tiny_pipeline(seed)
    assert isinstance(pipe, Flux2Pipeline)
    pipe.save_pretrained(path)
    index_file = Path(path) / "model_index.json"
    index = json.loads(index_file.read_text())
    # the text-only processor is how this process built it; the folder is a PixtralProcessor's
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return Path(path)


def tiny_pipeline(seed: int = 0):
    """A tiny random `Flux2Pipeline` of real classes at small sizes.

    `Flux2Transformer2DModel` as [klein]'s tiny one (2 double- and 2 single-stream blocks, D = 32,
    128 input channels) but with the guidance embedding on, as FLUX.2 [dev]; [klein]'s tiny
    `AutoencoderKLFlux2` (32 latent channels, 8x, random batch-norm statistics); a
    `Mistral3ForConditionalGeneration` whose text model has 31 layers of width 16 (the pipeline
    reads layers 10, 20 and 30: text features of 48) and a 1-layer Pixtral vision tower; the
    processor `PixtralTextProcessor` over `tiny_mistral_tokenizer` with `TINY_CHAT_TEMPLATE`
    (saved as a `PixtralProcessor` folder, patch 4, merge 2, a 32-pixel image processor config);
    `FLUX2_SCHEDULER_CONFIG`. 32x32 images give 4 image tokens.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from diffrl.models.flux2 import tiny_vae

    text_dim, patch, merge = 16, 4, 2
    tokenizer = tiny_mistral_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    image_processor = PixtralImageProcessorPil(patch_size=patch, size={"longest_edge": 32}).to_dict()
    processor = PixtralTextProcessor(
        tokenizer=tokenizer,
        chat_template=TINY_CHAT_TEMPLATE,
        patch_size=patch,
        spatial_merge_size=merge,
        image_processor=image_processor,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = tiny_vae().eval()
        text_encoder = Mistral3ForConditionalGeneration(
            Mistral3Config(
                text_config={
                    "model_type": "mistral",
                    "vocab_size": len(tokenizer),
                    "hidden_size": text_dim,
                    "intermediate_size": 32,
                    "num_hidden_layers": max(TEXT_LAYERS) + 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 8,
                    "max_position_embeddings": 2048,
                    "bos_token_id": ids("<s>"),
                    "eos_token_id": ids("</s>"),
                    "pad_token_id": ids("<pad>"),
                },
                vision_config={
                    "model_type": "pixtral",
                    "hidden_size": 16,
                    "intermediate_size": 32,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "head_dim": 8,
                    "image_size": 32,
                    "patch_size": patch,
                },
                image_token_index=ids("[IMG]"),
                spatial_merge_size=merge,
            )
        )
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=128,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=len(TEXT_LAYERS) * text_dim,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=True,
        )
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder.eval(),
        tokenizer=processor,
        transformer=transformer.eval(),
    )


__all__ = [
    "Flux2DevAdapter",
    "PixtralTextProcessor",
    "build_tiny",
    "tiny_mistral_tokenizer",
    "with_text_processor",
]
