"""Memory a sampled image needs at least, from the model's VAE config, and the memory this process
may use: both known before a model loads, so a size that cannot fit is refused at once instead of
the kernel killing the process minutes later without a word.

- `memory_limit`: the least of the machine's physical memory, the limits of this process's memory
  cgroups (cgroup v2 `memory.max`, cgroup v1 `memory.limit_in_bytes`, of its own cgroup and every
  ancestor up to the hierarchy's mount), and the process's own `RLIMIT_AS` / `RLIMIT_DATA`.
- `latent_elements`: the elements of one sample's latents (`ModelAdapter.latent_shape`), read off
  the VAE config: AutoencoderKL (SD3, FLUX.1), the Qwen-Image and Wan VAEs, or pixel space.
- `decoder_activation_bytes`: what the VAE decoder holds at least while it decodes one sample: its
  last blocks run at full resolution (see the function).

The byte counts are lower bounds: a refusal means the work cannot fit; passing does not promise it will.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
# cgroup v1's "no limit" is the largest page-aligned counter (0x7FFFFFFFFFFFF000 on 64-bit kernels);
# anything this large is no limit a machine could reach.
_UNLIMITED = 1 << 60
#: Where `memory_limit` reads /proc and /sys from by default (tests point it at a folder of fake files).
ROOT = Path("/")


@dataclass(frozen=True)
class MemoryLimit:
    """The memory this process may use, and which limit sets it (for messages)."""

    bytes: int
    source: str

    def describe(self) -> str:
        """e.g. "8.0 GiB (cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory/job)"."""
        return f"{self.bytes / GIB:.1f} GiB ({self.source})"


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read_limit(file: Path) -> int | None:
    """The byte count in a cgroup limit file; None for "max", a huge value, or no such file."""
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= _UNLIMITED:
        return None
    return int(text)


def _cgroup_mounts(root: Path) -> list[tuple[str, Path, str]]:
    """(the hierarchy's path that is mounted, the mount point, "v1" or "v2") of each memory cgroup
    hierarchy in `root`/proc/self/mountinfo (fields: id parent dev root mountpoint options... -
    fstype source superoptions; spaces in paths are written \\040)."""
    try:
        lines = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, super_options = tail[0], tail[2].split(",")
        version = (
            "v2"
            if fstype == "cgroup2"
            else "v1"
            if fstype == "cgroup" and "memory" in super_options
            else None
        )
        if version is not None:
            unescape = fields[3].replace("\\040", " "), fields[4].replace("\\040", " ")
            mounts.append((unescape[0], root / unescape[1].lstrip("/"), version))
    return mounts


def _own_cgroups(root: Path) -> dict[str, str]:
    """This process's cgroup path per version, from `root`/proc/self/cgroup ("0::/path" is v2;
    "N:memory,...:/path" the v1 memory hierarchy)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    paths = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    return paths


def cgroup_limits(root: Path | None = None) -> list[MemoryLimit]:
    """Every memory limit on this process's cgroups below `root` (the file system root; tests pass
    a folder of fake files): for each memory hierarchy mounted, its own cgroup's limit file and those
    of its ancestors up to the mount (a parent's limit binds its children too). Where the process's
    cgroup is not under the mounted part (a container that sees only its own cgroup), the mount
    point's own file. The usual mount points /sys/fs/cgroup (v2) and /sys/fs/cgroup/memory (v1) are
    read too, for a /proc that does not say."""
    root = ROOT if root is None else root
    files = {"v2": "memory.max", "v1": "memory.limit_in_bytes"}
    own = _own_cgroups(root)
    folders: list[tuple[Path, str]] = []
    for mounted, point, version in _cgroup_mounts(root):
        path = own.get(version)
        folder = point
        if path is not None and (
            mounted == "/" or path == mounted or path.startswith(mounted.rstrip("/") + "/")
        ):
            relative = path[len(mounted) :] if mounted != "/" else path
            folder = point / relative.lstrip("/")
        while True:
            folders.append((folder, version))
            if folder == point or point not in folder.parents:
                break
            folder = folder.parent
    folders += [(root / "sys/fs/cgroup", "v2"), (root / "sys/fs/cgroup/memory", "v1")]
    limits, seen = [], set()
    for folder, version in folders:
        file = folder / files[version]
        if file in seen:
            continue
        seen.add(file)
        if (value := _read_limit(file)) is not None:
            limits.append(MemoryLimit(value, f"cgroup {version} {files[version]} of {folder}"))
    return limits


def rlimits() -> list[MemoryLimit]:
    """The process's soft RLIMIT_AS (address space) and RLIMIT_DATA (heap and data) limits, where set."""
    limits = []
    for name, flag in (("RLIMIT_AS", "-v"), ("RLIMIT_DATA", "-d")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY and soft >= 0:
            limits.append(MemoryLimit(soft, f"the process's {name}, ulimit {flag}"))
    return limits


def memory_limit(root: Path | None = None) -> MemoryLimit:
    """The memory this process may use (the module docstring): the smallest limit wins."""
    candidates = [MemoryLimit(physical_memory_bytes(), "physical memory"), *cgroup_limits(root), *rlimits()]
    return min(candidates, key=lambda limit: limit.bytes)


# ------------------------------------------------------------------------------ an image's bytes
def _spatial_factor(vae: dict[str, Any]) -> int | None:
    """The VAE's downsampling (as `diffrl.models.sampling.ImageGeometry` reads it)."""
    if isinstance(vae.get("scale_factor_spatial"), int):
        return vae["scale_factor_spatial"]
    if isinstance(vae.get("block_out_channels"), list) and vae["block_out_channels"]:
        return 2 ** (len(vae["block_out_channels"]) - 1)
    if isinstance(vae.get("temperal_downsample"), list):
        return 2 ** len(vae["temperal_downsample"])
    return None


def latent_elements(vae: dict[str, Any] | None, height: int, width: int, frames: int = 1) -> int:
    """Elements of one sample's latents: channels x (latent frames) x height/f x width/f, the VAE's
    factor f and channels from its config (`latent_channels`, or `z_dim` for the Qwen-Image and Wan
    VAEs, whose `scale_factor_temporal` packs frames 1 + 4k into 1 + k); `vae` None: pixel space
    (3 channels, factor 1). 0 for a VAE config this does not know (no bound rather than a wrong one)."""
    if vae is None:
        return 3 * height * width * max(1, frames)
    factor = _spatial_factor(vae)
    channels = vae.get("latent_channels", 4 if "block_out_channels" in vae else vae.get("z_dim"))
    if factor is None or not isinstance(channels, int):
        return 0
    temporal = vae.get("scale_factor_temporal")
    latent_frames = (max(1, frames) - 1) // temporal + 1 if isinstance(temporal, int) else max(1, frames)
    return channels * latent_frames * (height // factor) * (width // factor)


def decoder_activation_bytes(vae: dict[str, Any] | None, height: int, width: int, dtype_bytes: int) -> int:
    """Bytes the VAE decoder holds at least while it decodes one sample (one frame), in its dtype.

    AutoencoderKL's last up block runs ResnetBlock2D at full resolution on block_out_channels[0]
    channels, and diffusers' ResnetBlock2D ends in `(input_tensor + hidden_states) / scale`: its
    input, its hidden state, their sum and the result are alive at once, 4 tensors of that size.
    The Qwen-Image and Wan VAEs end in a convolution from base_dim x dim_mult[0] channels at full
    resolution to RGB: its input and output at least (2 tensors). Pixel space decodes nothing.
    With tiny:flux on the CPU at 1024², a micro-batch's peak RSS grows by 153 MB per sample; this
    bound is 134 MB of it."""
    if vae is None:
        return 0
    blocks = vae.get("block_out_channels")
    if isinstance(blocks, list) and blocks and isinstance(blocks[0], int):
        return 4 * blocks[0] * height * width * dtype_bytes
    base = vae.get("decoder_base_dim") or vae.get("base_dim")
    mult = vae.get("dim_mult")
    if isinstance(base, int) and isinstance(mult, list) and mult and isinstance(mult[0], int):
        return 2 * base * mult[0] * height * width * dtype_bytes
    return 0


__all__ = [
    "GIB",
    "ROOT",
    "MemoryLimit",
    "cgroup_limits",
    "decoder_activation_bytes",
    "latent_elements",
    "memory_limit",
    "physical_memory_bytes",
    "rlimits",
]


def declared_tensor_bytes(
    component_dir: Path, library: str, class_name: str
) -> tuple[int, str, tuple] | None:
    """What a model component's own config makes it allocate when it is built: the bytes of its
    parameters and buffers, and its largest tensor (name, shape), counted on the meta device (no
    memory, no weights read); None for a component that is no torch module (a scheduler, a
    tokenizer) or one its library cannot build from the config alone.

    The config's sizes decide this before any weight is read: a position-embedding table of
    `pos_embed_max_size`² patches, a vocabulary, a layer count. A wrong or hostile value there is
    otherwise found as an allocator traceback while the model loads."""
    import importlib

    import torch

    try:
        module = importlib.import_module(library)
        cls = getattr(module, class_name)
    except (ImportError, AttributeError):
        return None
    with torch.device("meta"):
        if library == "diffusers" and hasattr(cls, "from_config") and hasattr(cls, "load_config"):
            model = cls.from_config(cls.load_config(component_dir))
        elif library == "transformers" and hasattr(cls, "_from_config"):
            from transformers import AutoConfig

            model = cls._from_config(AutoConfig.from_pretrained(component_dir))
        else:
            return None
    if not isinstance(model, torch.nn.Module):
        return None
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if not tensors:
        return None
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    name, largest = max(tensors, key=lambda item: item[1].numel())
    return total, name, tuple(largest.shape)
