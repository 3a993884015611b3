"""A run whose weight sync would leave a trained LoRA module behind stops, naming the module, at the
first sync that streams adapters only (the first sync streams every tensor). The separate
placement's pools run in this process (tests/controller/in_process_pools.py)."""

from __future__ import annotations

import pytest
from in_process_pools import in_process_pools

from diffrl.controller.run import train
from diffrl.train import export
from diffrl.workers.errors import WorkerError

LOST = "transformer_blocks.0.attn.to_out.0"


def test_a_sync_filter_that_misses_a_trained_module_stops_the_run_naming_it(tmp_path, monkeypatch):
    """The key filter both the stream and its spec list use (`adapter_key_predicate`) misses
    `to_out.0` (as Qwen-Image's did in verl-omni#658): stream and specs agree, so before the
    trainer compared them with what it trains the replica sampled with that module untrained."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("diffrl.controller.run.placement_session", in_process_pools)
    real, filtered = export.adapter_key_predicate, []

    def misses_lost(module, adapter_name=None):
        keep = real(module, adapter_name)
        filtered.append(adapter_name)
        return lambda key: keep(key) and not key.startswith(LOST + ".")

    monkeypatch.setattr(export, "adapter_key_predicate", misses_lost)
    args = [
        "trainer.placement=separate",
        "rollout.replicas=1",
        "trainer.total_steps=2",
        "trainer.save_freq=0",
    ]
    args += ["trainer.test_freq=0", "trainer.val_before_train=false", "trainer.loggers=[jsonl]"]
    with pytest.raises(WorkerError) as err:
        train("tiny_sd3", [*args, f"trainer.output_dir={tmp_path}"])
    assert filtered  # the first adapters-only sync, after step 1 (the first sync streams every tensor)
    message = str(err.value)
    assert "weights.specs" in message and "AdapterMismatchError" in message
    assert f"left out of what is handed over, of modules {LOST}." in message
