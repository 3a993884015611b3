"""Checkpoints: an interrupted-and-resumed run equals an uninterrupted one, saves are atomic, errors are clear."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open

import diffrl.train.checkpoint as checkpoint
import diffrl.train.checkpoint_state as checkpoint_state
from diffrl.models import load_model
from diffrl.models.sd3 import SD3Adapter
from diffrl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, step_dir

TARGETS = list(SD3Adapter.default_lora_target_modules)


def _transformer(tiny_dir, *, lora: bool = True, seed: int = 0, rank: int = 4, adapters=("default", "old")):
    """The tiny SD3 transformer set up as the engine does: named adapters, "default" trained, the rest frozen."""
    transformer = load_model(tiny_dir, dtype="float32").transformer
    torch.manual_seed(seed)  # adapter init: a different seed gives different adapter values
    if lora:
        for name in adapters:
            config = LoraConfig(
                r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights="gaussian"
            )
            transformer.add_adapter(config, adapter_name=name)
        transformer.set_adapter("default")
    else:
        transformer.requires_grad_(True)
    return transformer


def _optim(transformer):
    optimizer = torch.optim.AdamW(
        [p for p in transformer.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    # Warmup: the learning rate differs at every step, so a scheduler that is not restored shows.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    return optimizer, scheduler


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(2, 16, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 6, 64, generator=g),
        "pooled_projections": torch.randn(2, 48, generator=g),
        "timestep": torch.tensor([250.0, 750.0]),
    }


def _train_step(transformer, optimizer, scheduler) -> float:
    out = transformer(**_inputs(), return_dict=False)[0]
    target = torch.randn_like(out)  # drawn from the global RNG: a resumed run must continue its stream
    loss = (out - target).pow(2).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _saved_model_keys(path) -> set[str]:
    keys = set()
    for file in (path / "model").glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def _save(root, step, transformer, optimizer=None, scheduler=None, *, trainable_only=True, **kwargs):
    return save_checkpoint(
        root,
        step,
        model=transformer,
        optimizer=optimizer,
        scheduler=scheduler,
        trainable_only=trainable_only,
        extra=kwargs.pop("extra", {"step": step}),
        **kwargs,
    )


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_resumed_run_equals_uninterrupted_run(tiny_model, tmp_path, lora):
    tiny = tiny_model("sd3")
    transformer = _transformer(tiny, lora=lora, seed=0)
    optimizer, scheduler = _optim(transformer)
    for _ in range(2):
        _train_step(transformer, optimizer, scheduler)
    path = _save(
        tmp_path,
        2,
        transformer,
        optimizer,
        scheduler,
        trainable_only=lora,
        extra={"step": 2, "sampler": [3, 1]},
    )
    expected_loss = _train_step(transformer, optimizer, scheduler)  # the uninterrupted run's third step

    torch.manual_seed(1234)  # the resumed process: other adapter init, other RNG stream
    random.seed(1234)
    np.random.seed(1234)
    fresh = _transformer(tiny, lora=lora, seed=1)
    if lora:
        assert not torch.equal(
            fresh.state_dict()["transformer_blocks.0.attn.to_q.lora_A.old.weight"],
            transformer.state_dict()["transformer_blocks.0.attn.to_q.lora_A.old.weight"],
        )
    fresh_optimizer, fresh_scheduler = _optim(fresh)
    extra = load_checkpoint(
        path, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler, trainable_only=lora
    )
    assert extra == {"step": 2, "sampler": [3, 1]}
    assert fresh_scheduler.get_last_lr() == pytest.approx([1e-2 * 3 / 4])
    loss = _train_step(fresh, fresh_optimizer, fresh_scheduler)

    assert loss == expected_loss
    want, got = transformer.state_dict(), fresh.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def test_rng_states_are_restored(tiny_model, tmp_path):
    transformer = _transformer(tiny_model("sd3"))
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    path = _save(tmp_path, 1, transformer)
    expected = (torch.rand(4), random.random(), np.random.rand(3), torch.randn(2))

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    load_checkpoint(path, model=transformer, optimizer=None, scheduler=None, trainable_only=True)
    got = (torch.rand(4), random.random(), np.random.rand(3), torch.randn(2))
    assert torch.equal(got[0], expected[0])
    assert got[1] == expected[1]
    np.testing.assert_array_equal(got[2], expected[2])
    assert torch.equal(got[3], expected[3])


def test_lora_checkpoint_holds_every_adapter_and_no_base_weight(tiny_model, tmp_path):
    transformer = _transformer(tiny_model("sd3"))
    path = _save(tmp_path, 1, transformer)
    lora_keys = {name for name, _ in transformer.named_parameters() if ".lora_" in name}
    assert {".default." in k for k in lora_keys} == {True, False}  # both adapters are there to be saved
    assert _saved_model_keys(path) == lora_keys

    full = _transformer(tiny_model("sd3"), lora=False)
    full_path = _save(tmp_path / "full", 1, full, trainable_only=False)
    assert _saved_model_keys(full_path) == set(full.state_dict())

    def data_bytes(p):
        return sum(f.stat().st_size for f in p.glob("model/*.safetensors"))

    adapter_bytes = 4 * sum(transformer.state_dict()[k].numel() for k in lora_keys)
    base_bytes = 4 * sum(t.numel() for t in full.state_dict().values())
    assert adapter_bytes <= data_bytes(path) < adapter_bytes + base_bytes // 4
    assert data_bytes(full_path) >= base_bytes


def test_optimizer_state_round_trips(tiny_model, tmp_path):
    transformer = _transformer(tiny_model("sd3"))
    optimizer, scheduler = _optim(transformer)
    _train_step(transformer, optimizer, scheduler)
    path = _save(tmp_path, 1, transformer, optimizer, scheduler)
    fresh = _transformer(tiny_model("sd3"), seed=3)
    fresh_optimizer, fresh_scheduler = _optim(fresh)
    load_checkpoint(
        path, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler, trainable_only=True
    )
    names = {p: n for n, p in transformer.named_parameters()}
    fresh_params = dict(fresh.named_parameters())
    assert len(optimizer.state) == len(fresh_optimizer.state) > 0
    for param, state in optimizer.state.items():
        loaded = fresh_optimizer.state[fresh_params[names[param]]]
        assert loaded.keys() == state.keys()
        for key in state:
            assert torch.equal(loaded[key], state[key]), (names[param], key)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_optimizer_that_never_stepped_is_saved_without_state(tiny_model, tmp_path):
    transformer = _transformer(tiny_model("sd3"))
    optimizer, scheduler = _optim(transformer)
    path = _save(tmp_path, 0, transformer, optimizer, scheduler)
    assert not optimizer.state  # saving did not initialise it (that would shift Adam's bias correction)
    assert not (path / "optim").exists() and not (path / "optim.json").exists()
    fresh_optimizer, fresh_scheduler = _optim(transformer)
    load_checkpoint(
        path, model=transformer, optimizer=fresh_optimizer, scheduler=fresh_scheduler, trainable_only=True
    )
    assert not fresh_optimizer.state


@pytest.mark.parametrize("fail_in", ["dcp_save", "rename"])
def test_interrupted_save_leaves_previous_checkpoint(tiny_model, tmp_path, monkeypatch, fail_in):
    transformer = _transformer(tiny_model("sd3"))
    optimizer, scheduler = _optim(transformer)
    _train_step(transformer, optimizer, scheduler)
    first = _save(tmp_path, 1, transformer, optimizer, scheduler)
    saved_weights = {k: v.clone() for k, v in transformer.state_dict().items()}
    _train_step(transformer, optimizer, scheduler)

    class Crash(RuntimeError):
        pass

    if fail_in == "dcp_save":
        real_save = checkpoint_state.dcp.save

        def crashing_save(*args, **kwargs):
            real_save(*args, **kwargs)  # the data is written ...
            raise Crash  # ... and the process dies before the marker and the rename

        monkeypatch.setattr(checkpoint_state.dcp, "save", crashing_save)
    else:
        real_replace = checkpoint.os.replace

        def crashing_replace(src, dst, *args, **kwargs):
            if str(dst).endswith("step_00000002"):
                raise Crash
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(checkpoint.os, "replace", crashing_replace)
    # a process that dies mid-save cleans nothing up (one that raises removes its temporary folder)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(Crash):
        _save(tmp_path, 2, transformer, optimizer, scheduler)
    monkeypatch.undo()

    assert (tmp_path / ".tmp-step_00000002").is_dir()  # the half-written save is there, and ignored
    assert not step_dir(tmp_path, 2).exists()
    assert latest_checkpoint(tmp_path) == first
    if fail_in == "dcp_save":
        with pytest.raises(ValueError, match="incomplete"):
            load_checkpoint(
                tmp_path / ".tmp-step_00000002",
                model=transformer,
                optimizer=None,
                scheduler=None,
                trainable_only=True,
            )

    extra = load_checkpoint(
        first, model=transformer, optimizer=optimizer, scheduler=scheduler, trainable_only=True
    )
    assert extra == {"step": 1}
    for key, value in transformer.state_dict().items():
        assert torch.equal(value, saved_weights[key]), key

    second = _save(tmp_path, 2, transformer, optimizer, scheduler)  # the next save cleans up the leftover
    assert latest_checkpoint(tmp_path) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002"]


def test_keep_last_deletes_the_oldest(tiny_model, tmp_path):
    transformer = _transformer(tiny_model("sd3"))
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, transformer, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 4)
    # Saving a step again replaces it.
    again = _save(tmp_path, 4, transformer, keep_last=2, extra={"step": 4, "again": True})
    assert json.loads((again / "extra.json").read_text()) == {"step": 4, "again": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_latest_checkpoint_without_checkpoints(tmp_path):
    assert latest_checkpoint(tmp_path / "never_written") is None
    (tmp_path / "step_00000005").mkdir()  # no marker: not a checkpoint
    assert latest_checkpoint(tmp_path) is None


def test_load_errors_name_the_problem_and_the_fix(tiny_model, tmp_path):
    tiny = tiny_model("sd3")
    transformer = _transformer(tiny)
    path = _save(tmp_path, 1, transformer)

    def load(model, p=path, **kwargs):
        kwargs.setdefault("trainable_only", True)
        return load_checkpoint(p, model=model, optimizer=None, scheduler=None, **kwargs)

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(transformer, tmp_path / "step_00000009")
    with pytest.raises(ValueError, match=r"checkpoint root.*latest_checkpoint"):
        load(transformer, tmp_path)
    with pytest.raises(
        ValueError, match=r"adapters \['default', 'old'\], the model has \['default'\].*add adapter"
    ):
        load(_transformer(tiny, adapters=("default",)))
    with pytest.raises(ValueError, match=r"r=4.*has 8 \(set model.lora.rank.*shape mismatch"):
        load(_transformer(tiny, rank=8))
    with pytest.raises(ValueError, match="trainable_only=True"):
        load(_transformer(tiny, lora=False), trainable_only=False)
    with pytest.raises(ValueError, match=r"has none .*trainable_only=False"):
        load(_transformer(tiny, lora=False))

    full_path = _save(tmp_path / "full", 1, _transformer(tiny, lora=False), trainable_only=False)
    other = _transformer(tiny, lora=False)
    other.register_buffer("surprise", torch.zeros(3))
    with pytest.raises(
        ValueError, match=r"different model: 1 model tensor\(s\) the checkpoint lacks.*surprise"
    ):
        load(other, full_path, trainable_only=False)

    (path / "complete").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        load(transformer)


def test_extra_must_be_json(tiny_model, tmp_path):
    transformer = _transformer(tiny_model("sd3"))
    with pytest.raises(ValueError, match=r"JSON-able.*\.item\(\)"):
        _save(tmp_path, 1, transformer, extra={"step": torch.tensor(1)})
    assert latest_checkpoint(tmp_path) is None


# ---------------------------------------------------------------------------------- under FSDP2
WORLD = 2


def _sharded_worker(rank: int, port: int, tiny_dir: str, out: str) -> None:
    """One gloo rank: train a sharded LoRA transformer, checkpoint, resume a fresh sharded one, export."""
    import os
    from pathlib import Path

    import torch.distributed as dist
    from diffusers import StableDiffusion3Pipeline
    from torch.distributed.fsdp import fully_shard

    from diffrl.train.export import export_full, export_lora, iter_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        out = Path(out)

        def sharded(seed):
            transformer = _transformer(tiny_dir, seed=seed)
            for block in transformer.transformer_blocks:
                fully_shard(block)
            fully_shard(transformer)
            return transformer

        def weights(transformer):
            return {name: tensor.clone() for name, tensor in iter_weights(transformer, adapter_only=True)}

        transformer = sharded(seed=0)
        optimizer, scheduler = _optim(transformer)
        torch.manual_seed(10 + rank)  # each rank its own RNG stream, as in a real run
        _train_step(transformer, optimizer, scheduler)
        path = save_checkpoint(
            out / "ckpt",
            1,
            model=transformer,
            optimizer=optimizer,
            scheduler=scheduler,
            trainable_only=True,
            extra={"step": 1},
            keep_last=1,
        )
        saved = weights(transformer)
        expected_loss = _train_step(transformer, optimizer, scheduler)
        expected = weights(transformer)

        torch.manual_seed(99)
        fresh = sharded(seed=1)
        fresh_optimizer, fresh_scheduler = _optim(fresh)
        load_checkpoint(
            path, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler, trainable_only=True
        )
        loss = _train_step(fresh, fresh_optimizer, fresh_scheduler)
        got = weights(fresh)

        export_lora(fresh, out / "lora", pipeline_class=StableDiffusion3Pipeline)
        export_full(fresh, out / "merged", merge=True)
        all_weights = dict(iter_weights(fresh, adapter_only=False))
        if rank == 0:
            torch.save(
                {
                    "saved": saved,
                    "loss": (expected_loss, loss),
                    "expected": expected,
                    "got": got,
                    "all": all_weights,
                },
                out / "result.pt",
            )
        # both ranks meet before either tears gloo down: a rank whose peer closed the group while
        # it was still in a collective aborts (SIGABRT), as one rank of this test did once in
        # about four full-suite runs
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_checkpoint_and_export_under_fsdp2(tiny_model, tmp_path):
    import socket

    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from spawn_ranks import start_ranks

    tiny = tiny_model("sd3")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_ranks(_sharded_worker, (port, str(tiny), str(tmp_path)), WORLD, fork=True)
    result = torch.load(tmp_path / "result.pt", weights_only=True)

    # Resuming a sharded run from its checkpoint continues it exactly.
    expected_loss, loss = result["loss"]
    assert loss == expected_loss
    assert result["got"].keys() == result["expected"].keys()
    assert all(torch.equal(result["got"][k], result["expected"][k]) for k in result["expected"])
    assert {".default." in k for k in result["got"]} == {True, False}

    # The two-rank checkpoint loads into one process (DCP reshards); RNG states are per rank.
    path = latest_checkpoint(tmp_path / "ckpt")
    single = _transformer(tiny, seed=5)
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\).*restore_rng=False"):
        load_checkpoint(path, model=single, optimizer=None, scheduler=None, trainable_only=True)
    load_checkpoint(
        path, model=single, optimizer=None, scheduler=None, trainable_only=True, restore_rng=False
    )
    state = single.state_dict()
    assert all(torch.equal(state[k], v) for k, v in result["saved"].items())

    # Exports from the sharded module equal the same weights in an unsharded one.
    reference = _transformer(tiny, seed=5)
    reference.load_state_dict(result["all"])
    inputs = {k: v[:1] for k, v in _inputs().items()}
    with torch.no_grad():
        expected_out = reference(**inputs, return_dict=False)[0]
        merged = SD3Transformer2DModel.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(merged(**inputs, return_dict=False)[0], expected_out, rtol=1e-5, atol=1e-5)
        pipe = StableDiffusion3Pipeline.from_pretrained(tiny, dtype=torch.float32, local_files_only=True)
        pipe.load_lora_weights(tmp_path / "lora")
        torch.testing.assert_close(
            pipe.transformer(**inputs, return_dict=False)[0], expected_out, rtol=1e-5, atol=1e-5
        )
