"""A full disk inside a third-party writer names the path (issue 55): safetensors (diffusers'
save_pretrained, the export of `diffrl sft` and `diffrl train`) reports it in its own error type
with the errno only in its text, and torch.distributed.checkpoint's stream writes raise an OSError
naming no file. Either reaches the CLI as an OSError naming the path, so its message says where
(`diffrl.cli._disk_full`, the source of "the disk is full ... writing PATH")."""

from __future__ import annotations

import contextlib
import errno
import os

import pytest
import safetensors.torch
import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import LoraConfig
from safetensors import SafetensorError

from diffrl.cli import _disk_full
from diffrl.train.export import export_full, export_lora
from diffrl.train.export_folder import LORA_FILE

NO_SPACE = os.strerror(errno.ENOSPC)


def _no_space(*args, **kwargs):
    # the text safetensors' Rust writer gives a full tmpfs (seen on one: "os error 28" is ENOSPC)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _transformer(lora: bool) -> SD3Transformer2DModel:
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        out_channels=4,
        pos_embed_max_size=8,
    )
    if lora:
        transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]))
    return transformer


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_full_disk_in_a_safetensors_write_names_the_export_folder(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(safetensors.torch, "save_file", _no_space)
    out = tmp_path / "export.partial" / "transformer"
    with pytest.raises(OSError) as info:
        if kind == "full":
            export_full(_transformer(lora=False), out)
        else:
            export_lora(_transformer(lora=True), out, pipeline_class=StableDiffusion3Pipeline)
    assert info.value.errno == errno.ENOSPC
    where = out if kind == "full" else out / LORA_FILE
    assert _disk_full(info.value) == (NO_SPACE, str(where))
    assert isinstance(info.value.__cause__, SafetensorError)  # the writer's own report is kept


def test_an_unnamed_os_error_inside_a_checkpoint_write_names_the_checkpoint_folder(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_files

    import diffrl.train.checkpoint as checkpoint

    class FullStream:
        """A stream on a full disk: every write fails as os.write does there, naming no file."""

        def __init__(self, stream):
            self.stream = stream

        def write(self, data):
            raise OSError(errno.ENOSPC, NO_SPACE)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    create_stream = dcp_files.FileSystem.create_stream

    @contextlib.contextmanager
    def full_stream(self, path, mode):
        with create_stream(self, path, mode) as stream:
            yield FullStream(stream)

    monkeypatch.setattr(dcp_files.FileSystem, "create_stream", full_stream)
    root = tmp_path / "checkpoints"
    with pytest.raises(OSError) as info:
        checkpoint.save_checkpoint(
            root,
            3,
            model=torch.nn.Linear(4, 4),
            optimizer=None,
            scheduler=None,
            trainable_only=False,
            extra={},
        )
    assert info.value.errno == errno.ENOSPC
    assert _disk_full(info.value) == (NO_SPACE, str(root / ".tmp-step_00000003" / checkpoint.MODEL_DIR))
    assert not any(root.iterdir())  # the save's temporary folder is gone, nothing was published
