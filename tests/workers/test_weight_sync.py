"""WeightSyncGroup: a trainer's tensors reach separate replica processes bitwise, in bounded buckets,
beside the trainer's own default process group; mismatches and dead peers fail within a deadline.

The multi-process tests spawn real processes (gloo on loopback). Expected tensors are rebuilt in
the test process from the same seed, and the expected byte and bucket counts are written out by
hand from the tensor sizes below, not computed by the code under test.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from diffrl.workers.sync_rendezvous import free_address
from diffrl.workers.weight_specs import TensorSpec, check_specs, tensor_specs
from diffrl.workers.weight_sync import SyncStats, WeightSyncGroup

TIMEOUT_S = 4.0
NEVER_JOINED_TIMEOUT_S = 1.5
BUCKET_BYTES = 256
# Sizes in bytes: a 128, b 64, c 32 (224: one bucket), d 64 (224 + 64 > 256: a second bucket),
# big 400 (larger than a bucket: alone, the third), e 128 (the fourth).
EXPECTED_BYTES = 128 + 64 + 32 + 64 + 400 + 128
EXPECTED_BUCKETS = 4
# The second sync moves only b and e (as LoRA moves only its adapters): 64 + 128 bytes, one bucket.
SUBSET = ("b", "e")


def source_tensors(version: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The trainer's weights at `version` (mixed dtypes, one tensor bigger than a bucket), drawn on
    the CPU so every device gets the same values."""
    gen = torch.Generator().manual_seed(version)
    tensors = {
        "a": torch.randn(4, 8, generator=gen),  # fp32, 128 B
        "b": torch.randn(32, generator=gen).bfloat16(),  # 64 B
        "c": torch.randn(2, 8, generator=gen).bfloat16(),  # 32 B
        "d": torch.randint(-(2**31), 2**31 - 1, (16,), generator=gen, dtype=torch.int32),  # 64 B
        "big": torch.randn(10, 10, generator=gen),  # fp32, 400 B > BUCKET_BYTES
        "e": torch.randn(8, 8, generator=gen).bfloat16(),  # 128 B
        "empty": torch.zeros(0, 3),  # 0 B, joins the fourth bucket
    }
    return {name: t.to(device) for name, t in tensors.items()}


def replica_params(device: str = "cpu") -> dict[str, torch.Tensor]:
    """A replica's own copy before any sync: same shapes and dtypes, different values; `c` is a
    transposed (non-contiguous) view, as a parameter can be."""
    params = {name: torch.full_like(t, 7) for name, t in source_tensors(0, device).items()}
    params["c"] = torch.full((8, 2), 7, dtype=torch.bfloat16, device=device).t()
    return params


def _stats(stats: SyncStats) -> tuple[int, int, int]:
    return stats.tensors, stats.bytes, stats.buckets


def _portable(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """Tensors as plain bytes for the result queue (torch would share their storage with the
    parent through a process that is about to exit)."""
    return {
        name: (
            str(t.dtype).removeprefix("torch."),
            list(t.shape),
            t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes(),
        )
        for name, t in tensors.items()
    }


def _restore(item: tuple[str, list[int], bytes]) -> torch.Tensor:
    dtype, shape, raw = item
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _streamed(tensors: dict[str, torch.Tensor], names=None):
    """A one-shot generator, as the trainer's `iter_weights` is."""
    for name, tensor in tensors.items():
        if names is None or name in names:
            yield name, tensor


def _trainer(port: int, default_port: int, world: int, device: str, ready, out) -> None:
    try:
        ready.wait(timeout=60)
        # The trainer's own default group (FSDP2's on a real run), initialised before the sync group.
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{default_port}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=30),
        )
        group = WeightSyncGroup.join("127.0.0.1", port, 0, world, backend="gloo", timeout_s=TIMEOUT_S)
        first = group.send(_streamed(source_tensors(1, device)), bucket_bytes=BUCKET_BYTES)
        total = torch.ones(3)
        dist.all_reduce(total)  # the default group still works beside the sync group
        second = group.send(_streamed(source_tensors(2, device), SUBSET), bucket_bytes=BUCKET_BYTES)
        renamed = {("c_renamed" if name == "c" else name): t for name, t in source_tensors(3, device).items()}
        try:
            group.send(_streamed(renamed), bucket_bytes=BUCKET_BYTES)
            third = "no error"
        except RuntimeError as err:
            third = str(err)
        out.put(("trainer", _stats(first), _stats(second), total.tolist(), third))
        dist.destroy_process_group()
    except Exception:
        out.put(("trainer", "error", traceback.format_exc()))


def _replica(port: int, rank: int, world: int, device: str, ready, out) -> None:
    try:
        ready.wait(timeout=60)
        params = replica_params(device)
        group = WeightSyncGroup.join("127.0.0.1", port, rank, world, backend="gloo", timeout_s=TIMEOUT_S)
        specs = tensor_specs(source_tensors(0).items())
        first = group.receive(specs, params, bucket_bytes=BUCKET_BYTES)
        after_first = _portable(params)
        subset_specs = [spec for spec in specs if spec.name in SUBSET]
        second = group.receive(subset_specs, params, bucket_bytes=BUCKET_BYTES)
        try:
            group.receive(specs, params, bucket_bytes=BUCKET_BYTES)
            third = "no error"
        except ValueError as err:
            third = str(err)
        out.put((f"replica{rank}", _stats(first), _stats(second), after_first, _portable(params), third))
    except Exception:
        out.put((f"replica{rank}", "error", traceback.format_exc()))


def _run(targets, deadline_s: float) -> dict:
    """Start one process per (function, args), collect one result each within the deadline, and
    leave no process behind. The processes meet at a barrier once imported, so the group's short
    timeout measures the protocol, not how long a loaded machine takes to start Python."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    ready = ctx.Barrier(len(targets))
    procs = [ctx.Process(target=fn, args=(*args, ready, out), daemon=True) for fn, args in targets]
    for proc in procs:
        proc.start()
    results = {}
    end = time.monotonic() + deadline_s
    try:
        for _ in procs:
            try:
                item = out.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no result within {deadline_s} s; got only {sorted(results)}")
            assert item[1] != "error", f"{item[0]} failed:\n{item[2]}"
            results[item[0]] = item
    finally:
        for proc in procs:
            proc.join(timeout=max(0.1, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return results


def _check_stream(device: str, replicas: int) -> None:
    _, port = free_address()
    _, default_port = free_address()
    world = replicas + 1
    results = _run(
        [(_trainer, (port, default_port, world, device))]
        + [(_replica, (port, rank, world, device)) for rank in range(1, world)],
        deadline_s=60,
    )
    trainer = results["trainer"]
    assert trainer[1] == (7, EXPECTED_BYTES, EXPECTED_BUCKETS)
    assert trainer[2] == (2, 64 + 128, 1)
    assert trainer[3] == [1.0, 1.0, 1.0]
    # The replicas rejected the renamed stream, so the trainer's acknowledgement never came.
    assert f"weight sync send failed on rank 0/{world}" in trainer[4]

    first, second = source_tensors(1), source_tensors(2)
    assert sum(t.numel() * t.element_size() for t in first.values()) == EXPECTED_BYTES
    for rank in range(1, world):
        _, stats1, stats2, after_first, after_second, third = results[f"replica{rank}"]
        after_first = {name: _restore(item) for name, item in after_first.items()}
        after_second = {name: _restore(item) for name, item in after_second.items()}
        assert stats1 == (7, EXPECTED_BYTES, EXPECTED_BUCKETS)
        assert stats2 == (2, 64 + 128, 1)
        for name, tensor in first.items():
            assert after_first[name].dtype == tensor.dtype
            assert torch.equal(after_first[name], tensor), name
        for name in first:
            expected = second[name] if name in SUBSET else first[name]
            assert torch.equal(after_second[name], expected), name
        assert "'c_renamed'" in third and "expects 'c'" in third


def test_trainer_streams_to_two_replicas_bitwise_beside_its_default_group():
    _check_stream("cpu", replicas=2)


@pytest.mark.gpu
def test_cuda_tensors_stage_through_host_memory_with_gloo():
    """Trainer and replica both on cuda:0 (as on one GPU, where NCCL cannot have two ranks): the
    buckets are packed on the GPU and cross through pinned host memory."""
    _check_stream("cuda", replicas=1)


def _dying_trainer(port: int, ready, out) -> None:
    ready.wait(timeout=60)
    group = WeightSyncGroup.join("127.0.0.1", port, 0, 2, backend="gloo", timeout_s=TIMEOUT_S)
    group.send(_streamed(source_tensors(1)), bucket_bytes=BUCKET_BYTES)
    out.put(("trainer", "sent once"))
    out.close()
    out.join_thread()  # the result must leave before the process does
    os._exit(0)  # dies without closing anything, as a killed actor does


def _orphaned_replica(port: int, name: str, syncs_before: int, timeout_s: float, ready, out) -> None:
    ready.wait(timeout=60)
    params = replica_params()
    start = time.monotonic()
    try:
        group = WeightSyncGroup.join("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=timeout_s)
        specs = tensor_specs(source_tensors(0).items())
        for _ in range(syncs_before):
            group.receive(specs, params, bucket_bytes=BUCKET_BYTES)
        start = time.monotonic()
        group.receive(specs, params, bucket_bytes=BUCKET_BYTES)
        out.put((name, "no error", 0.0))
    except RuntimeError as err:
        out.put((name, str(err), time.monotonic() - start))


def _lonely_trainer(port: int, ready, out) -> None:
    ready.wait(timeout=60)
    start = time.monotonic()
    try:
        WeightSyncGroup.join("127.0.0.1", port, 0, 3, backend="gloo", timeout_s=NEVER_JOINED_TIMEOUT_S)
        out.put(("lonely_trainer", "no error", 0.0))
    except RuntimeError as err:
        out.put(("lonely_trainer", str(err), time.monotonic() - start))


def test_a_rank_raises_within_the_timeout_when_its_peer_dies_or_never_joins():
    _, port = free_address()
    _, nobody = free_address()  # no trainer ever listens here
    _, alone = free_address()  # a trainer listens here, but no replica comes
    results = _run(
        [
            (_dying_trainer, (port,)),
            (_orphaned_replica, (port, "after_death", 1, TIMEOUT_S)),
            # Alone, so no start-up skew to allow for: a shorter deadline keeps the test fast.
            (_orphaned_replica, (nobody, "never_joined", 0, NEVER_JOINED_TIMEOUT_S)),
            (_lonely_trainer, (alone,)),
        ],
        deadline_s=45,
    )
    died, waited = results["after_death"][1:]
    assert "weight sync receive failed on rank 1/2" in died
    assert waited < TIMEOUT_S + 3
    never, waited = results["never_joined"][1:]
    assert f"could not join the group at 127.0.0.1:{nobody}" in never
    # torch's store client retries once inside its deadline; allow a loaded machine some slack.
    assert waited < 2 * NEVER_JOINED_TIMEOUT_S + 3
    lonely, waited = results["lonely_trainer"][1:]
    assert f"rank 0/3 could not join the group at 127.0.0.1:{alone}" in lonely
    assert waited < NEVER_JOINED_TIMEOUT_S + 3


# ------------------------------------------------------------------------------ in-process checks
def test_check_specs_names_the_tensor_and_both_sides():
    params = replica_params()
    good = tensor_specs(source_tensors(0).items())
    check_specs(good, params)  # the matching list passes

    wrong_shape = [TensorSpec("a", (8, 4), "float32")]
    with pytest.raises(
        ValueError,
        match=r"'a': the sender streams shape \[8, 4\] dtype float32, the receiver has shape \[4, 8\] dtype float32",
    ):
        check_specs(wrong_shape, params)
    wrong_dtype = [TensorSpec("b", (32,), "float16")]
    with pytest.raises(
        ValueError,
        match=r"'b': the sender streams shape \[32\] dtype float16, the receiver has shape \[32\] dtype bfloat16",
    ):
        check_specs(wrong_dtype, params)
    with pytest.raises(ValueError, match=r"'lora_A' \(shape \[2, 3\] dtype float32\) does not exist"):
        check_specs([TensorSpec("lora_A", (2, 3), "float32")], params)


def test_receive_checks_specs_before_any_byte_moves():
    """A replica alone in its group (nobody else joins) fails on the spec check at once, not after
    the store's timeout: validation runs before any communication."""
    group = WeightSyncGroup(pg=None, store=None, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    with pytest.raises(ValueError, match="'a'"):
        group.receive([TensorSpec("a", (3,), "float32")], replica_params(), bucket_bytes=BUCKET_BYTES)


def test_tensor_spec_round_trips_through_json():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool):
        spec = TensorSpec.of("w", torch.zeros(2, 3, dtype=dtype))
        assert TensorSpec.from_json(spec.to_json()) == spec
        assert spec.torch_dtype == dtype
        assert spec.nbytes == 6 * torch.zeros((), dtype=dtype).element_size()
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        _ = TensorSpec("w", (1,), "float7").torch_dtype


def test_metrics_and_join_arguments():
    stats = SyncStats(tensors=3, bytes=2_000_000_000, buckets=2, seconds=2.0)
    assert stats.metrics() == {
        "weight_sync/tensors": 3.0,
        "weight_sync/bytes": 2e9,
        "weight_sync/buckets": 2.0,
        "weight_sync/seconds": 2.0,
        "weight_sync/gb_per_s": 1.0,
    }
    host, port = free_address()
    assert host == "127.0.0.1" and 0 < port < 65536
    with pytest.raises(ValueError, match="backend='mpi'"):
        WeightSyncGroup.join(host, port, 0, 2, backend="mpi", timeout_s=1)
    with pytest.raises(ValueError, match="world_size=1"):
        WeightSyncGroup.join(host, port, 0, 1, backend="gloo", timeout_s=1)
