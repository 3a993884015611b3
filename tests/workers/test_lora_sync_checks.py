"""No LoRA module goes missing silently in a weight sync: the replica compares what it holds with
what the trainer sent (names, shapes, digests of the bytes), and the trainer its stream with what it
trains, each naming the modules that differ (diffrl.models.lora_check).

The group tests run the source and a replica as two threads of this process on a real gloo group,
so a monkeypatched transport applies to the receiving side.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch
from peft import LoraConfig

from diffrl.models import load_model
from diffrl.models.lora_check import AdapterMismatchError, check_adapter_tensors
from diffrl.models.sd3 import SD3Adapter
from diffrl.train.export import adapter_key_predicate
from diffrl.workers.rollout_worker import check_synced_set
from diffrl.workers.sync_rendezvous import free_address
from diffrl.workers.weight_specs import digest_table, digests_match, tensor_specs
from diffrl.workers.weight_sync import WeightSyncGroup

LOST = "transformer_blocks.0.attn.to_out.0"
TIMEOUT_S = 20.0


def lora_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"{module}.{part}.default.weight": torch.randn(4, 8, generator=gen)
        for module in ("transformer_blocks.0.attn.to_q", LOST)
        for part in ("lora_A", "lora_B")
    }


def _sync(params: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> dict[str, object]:
    """One sync of `sent` into `params` (a thread each side); what each side returned or raised."""
    host, port = free_address()
    results: dict[str, object] = {}

    def side(name, rank, work):
        try:
            group = WeightSyncGroup.join(host, port, rank, 2, backend="gloo", timeout_s=TIMEOUT_S)
            results[name] = work(group)
        except Exception as err:  # the test reads it
            results[name] = err

    specs = tensor_specs(sent.items())
    threads = [
        threading.Thread(
            target=side, args=("source", 0, lambda g: g.send(iter(sent.items()), bucket_bytes=1024))
        ),
        threading.Thread(
            target=side, args=("replica", 1, lambda g: g.receive(specs, params, bucket_bytes=1024))
        ),
    ]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    results["seconds"] = time.monotonic() - start
    return results


def test_a_sync_whose_bytes_miss_a_module_stops_both_sides_naming_it(monkeypatch):
    sent = lora_tensors(1)
    params = {name: torch.zeros_like(t) for name, t in sent.items()}
    assert _sync(params, sent)["replica"].tensors == 4  # the intact transport: every tensor arrives
    assert all(torch.equal(params[n], t) for n, t in sent.items())

    real = WeightSyncGroup._receive_bucket

    def loses_to_out(self, specs, params, payload):
        real(self, specs, {n: (t.clone() if n.startswith(LOST) else t) for n, t in params.items()}, payload)

    monkeypatch.setattr(WeightSyncGroup, "_receive_bucket", loses_to_out)
    results = _sync(params, lora_tensors(2))
    replica, source = results["replica"], results["source"]
    assert isinstance(replica, AdapterMismatchError), replica
    assert f"of modules {LOST}" in str(replica) and "values differ from those sent" in str(replica)
    assert "to_q" not in str(replica)
    assert sorted(replica.differing) == [f"{LOST}.lora_A.default.weight", f"{LOST}.lora_B.default.weight"]
    # the source hears it from the acknowledgement at once, not at its deadline
    assert isinstance(source, ValueError) and "differ from those sent" in str(source)
    assert results["seconds"] < TIMEOUT_S / 2


def digest(tensor: torch.Tensor) -> list[float]:
    return digest_table([("w", tensor)])[1][0].tolist()


def test_digests_tell_another_tensor_from_the_same_one_summed_in_another_order():
    x = torch.randn(1000, 64, dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        held = x.to(dtype)
        a = digest(held)
        b = digest(held.t().contiguous().t())  # another memory order
        assert digests_match(a, b)
        assert digests_match(a, digest(held.flatten().flip(0)))  # summed in reverse
        assert not digests_match(a, digest(torch.zeros_like(held)))
        changed = held.clone()
        changed[0, 0] += 1.0
        assert not digests_match(a, digest(changed))
    nan = torch.tensor([float("nan"), 1.0])
    assert digests_match(digest(nan), digest(nan.clone()))


def test_the_message_names_at_most_ten_modules_and_counts_the_rest():
    trained = {f"blocks.{i}.to_q.lora_A.default.weight": (4, 8) for i in range(25)}
    arrived = dict(list(trained.items())[:3])
    with pytest.raises(AdapterMismatchError, match=r"22 trained tensor\(s\) missing .* and 12 more") as err:
        check_adapter_tensors("sync", trained, arrived)
    assert str(err.value).count("blocks.") == 10
    # a worker's error crosses processes (Ray pickles it) whole
    again = pickle.loads(pickle.dumps(err.value))
    assert type(again) is AdapterMismatchError and str(again) == str(err.value)
    assert again.missing == err.value.missing and len(again.missing) == 22


def _replica_transformer(tiny_model):
    transformer = load_model(tiny_model("sd3"), dtype="float32").transformer
    targets = list(SD3Adapter.default_lora_target_modules)
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=targets), adapter_name="default")
    return transformer


def test_a_replica_lora_module_the_trainer_never_sends_stops_the_sync_naming_it(tiny_model):
    transformer = _replica_transformer(tiny_model)
    is_adapter = adapter_key_predicate(transformer)
    state = transformer.state_dict()
    adapters = [(k, v) for k, v in state.items() if is_adapter(k)]
    check_synced_set(tensor_specs(adapters), transformer, "sync")  # the whole adapter set: fine
    check_synced_set(tensor_specs(state.items()), transformer, "sync")  # a full sync: fine

    dropped = tensor_specs((k, v) for k, v in adapters if not k.startswith(LOST + "."))
    with pytest.raises(
        AdapterMismatchError, match=rf"in the replica's model that are not trained, of modules {LOST}\."
    ) as err:
        check_synced_set(dropped, transformer, "weight sync of version 3")
    assert "weight sync of version 3" in str(err.value) and "same model.lora settings" in str(err.value)
    assert sorted(err.value.unexpected) == [f"{LOST}.lora_A.default.weight", f"{LOST}.lora_B.default.weight"]


def test_a_snapshot_for_a_later_sync_that_misses_a_trained_module_stops_naming_it(tiny_model, monkeypatch):
    """Bounded staleness copies what a sync will stream (`weights.snapshot`) and streams it later:
    the copy is held to what trains as `weights.specs` is (tests/controller/test_lora_sync_run.py)."""
    from types import SimpleNamespace

    from diffrl.train import export
    from diffrl.workers.weight_source import WeightSource

    transformer = _replica_transformer(tiny_model)
    transformer.set_adapter("default")  # its tensors require grad: what trains
    source = WeightSource(SimpleNamespace(transformer=transformer, lora=True), cfg=None)
    assert len(source.snapshot(1, full=False)) == len(source.specs(full=False)) > 0
    real = export.adapter_key_predicate

    def misses_lost(module, adapter_name=None):
        keep = real(module, adapter_name)
        return lambda key: keep(key) and not key.startswith(LOST + ".")

    monkeypatch.setattr(export, "adapter_key_predicate", misses_lost)
    for call in (lambda: source.snapshot(2, full=False), lambda: source.specs(full=False)):
        with pytest.raises(
            AdapterMismatchError, match=rf"left out of what is handed over, of modules {LOST}\."
        ):
            call()
    assert sorted(source.snapshots) == [1]
