"""`model.*`: which diffusers model to load, its compute dtype, LoRA, attention and compilation."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffrl.config.checks import require, require_at_least, require_choice, require_positive


@dataclass
class LoraConfig:
    rank: int = 32  # 0 = full fine-tuning (no adapters; a frozen reference copy serves KL)
    alpha: float = 64.0
    target_modules: list[str] | None = None  # None = the model adapter's declared defaults
    init: str = "gaussian"  # peft's init_lora_weights
    # forward passes without gradients (rollouts, validation, the old policy's velocities) run with
    # the adapter merged into a copy of the targeted weights: one matmul per layer instead of three
    # (diffrl.train.lora.merged_adapter). Direct-preference losses on unsharded weights only.
    merge_inference: bool = False

    # Only inits that leave the base weights untouched: the reference policy is "adapters disabled",
    # which pissa/olora (they subtract from the base weights) would silently change.
    INITS = ("default", "gaussian")

    def validate(self, at: str) -> None:
        require_at_least(f"{at}.rank", self.rank, 0)
        require_positive(f"{at}.alpha", self.alpha)
        if self.target_modules is not None:
            require(
                len(self.target_modules) > 0,
                f"{at}.target_modules",
                self.target_modules,
                "must list at least one module name, or be null for the model's defaults",
            )
        require_choice(f"{at}.init", self.init, self.INITS)


@dataclass
class ModelConfig:
    path: str = ""  # a local diffusers directory (model_index.json inside)
    dtype: str = "bfloat16"  # the network's compute dtype; SDE math and stored latents are fp32
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    # a diffusers attention backend name, or `auto`: the family's GPU training backend on a GPU
    # (FLUX's flash attention, whose backward cuDNN fails), torch's default (`native`) elsewhere
    attn_backend: str = "auto"
    compile: bool = False  # torch.compile each transformer block (regional): faster after a warmup
    # float8 GEMMs for the transformer blocks' linear layers (not the LoRA adapters, norms'
    # modulation or attention itself): `none`; `sampling`, the sampler's passes only; `all`, also
    # the reference pass and the update's forward and backward. GPUs of compute capability 8.9+
    # (diffrl.train.fp8)
    fp8: str = "none"
    # float8 scales: one per row of each operand (`rowwise`) or one per tensor (`tensorwise`)
    fp8_scaling: str = "rowwise"

    DTYPES = ("float32", "bfloat16", "float16")
    FP8_MODES = ("none", "sampling", "all")
    FP8_SCALINGS = ("rowwise", "tensorwise")

    def validate(self, at: str) -> None:
        require_choice(f"{at}.dtype", self.dtype, self.DTYPES)
        self.lora.validate(f"{at}.lora")
        # YAML reads a bare off/on/false/true as a boolean, which lands here as 'False' or 'True'
        boolean = (
            "; off and on read as booleans in YAML: write none for no float8"
            if self.fp8 in ("False", "True")
            else ""
        )
        require(
            self.fp8 in self.FP8_MODES,
            f"{at}.fp8",
            self.fp8,
            f"must be one of 'none', 'sampling', 'all'{boolean}",
        )
        require_choice(f"{at}.fp8_scaling", self.fp8_scaling, self.FP8_SCALINGS)
        if self.attn_backend not in ("auto", "native"):
            # diffusers' list of backends costs seconds of imports; auto and its default need no check
            from diffusers.models.attention_dispatch import AttentionBackendName

            require_choice(
                f"{at}.attn_backend", self.attn_backend, ["auto", *(b.value for b in AttentionBackendName)]
            )
