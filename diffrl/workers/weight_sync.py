"""Stream the trainer's weights to rollout replicas over a process group of their own.

With `separate` placement (issue 13) the trainer ranks (FSDP2 among themselves, through the
default torch.distributed group) and the rollout replicas (no default group at all) are different
processes. After each optimizer step the new weights must reach every replica. This module is that
transport.

Who takes part. A `WeightSyncGroup` has R + 1 ranks: rank 0 is trainer rank 0 (the *source*),
ranks 1..R are the replicas. It is built on its own `TCPStore` (hosted by rank 0) with a
`ProcessGroupGloo` or `ProcessGroupNCCL` constructed directly on that store (both set up by
`diffrl.workers.sync_rendezvous`), so it never touches the default group and can coexist with
FSDP's in the same process. Only trainer rank 0 is in the group: on FSDP2 every trainer rank must
take part in each parameter's all-gather (`full_tensor()` inside `diffrl.train.export.iter_weights`),
but after the gather rank 0 holds the full tensor, so one sender suffices and the other trainer
ranks simply drain the same iterator and drop the result.

Protocol of one sync, repeated per bucket and ended by an empty bucket:

    1. header   int64[3] = (tensors in the bucket, payload bytes, spec-blob bytes)   (0, 0, 0) ends
    2. specs    uint8[spec-blob bytes]: JSON [[name, shape, dtype], ...] of the bucket's tensors
    3. payload  uint8[payload bytes]: the tensors' raw bytes, back to back, in stream order
    4. (after the end marker) digests float64[tensors, 2]: each tensor's (sum, sum |x|) as sent
    5. an all-reduce of each receiver's "all unpacked, digests match" flag

The source packs tensors in stream order into one flat byte buffer of at most `bucket_bytes`
(dtypes mixed: the bytes are copied as they are, so a bucket needs no per-dtype split and keeps the
stream order); a tensor larger than the bucket goes alone, straight from its own storage. The
source never holds more than one bucket (plus the one tensor the iterator just produced): it
consumes the iterator lazily and copies each tensor into the bucket at once.

Why the specs travel with every bucket: the source consumes a one-shot iterator and cannot know
the whole tensor list up front, while each replica is told the list it expects (`specs`, from the
controller; `diffrl.workers.weight_specs` holds the spec type, its checks and its JSON form). Each
receiver compares every bucket's spec list with its own expectation *before* that bucket's bytes
move, and raises a ValueError naming the first tensor that differs (name, shape and dtype on both
sides); a stream that is too short or too long is caught the same way. Before any communication,
`receive` also checks that every expected tensor exists in its own parameters with the same shape
and dtype. After the stream each receiver digests the tensors it wrote into (its module's own
storage) and compares them with the source's digests of what it sent
(`diffrl.workers.weight_specs.digest_table`: float64 sums, in each tensor's own dtype on both
sides, so no cast can make them differ), raising an AdapterMismatchError
(`diffrl.models.lora_check`) naming the modules whose bytes did not land. The final all-reduce makes `send` return only once every replica has unpacked and checked
everything (a replica whose check failed answers 0, so the source fails at once rather than at
its deadline), so `SyncStats.seconds` on the source is the end-to-end time.

Deadlines: the store and the process group are both built with `timeout_s`; a peer that never
joins, dies, or stops midway makes `join`, `send` or `receive` raise within about that time (gloo
raises; NCCL's watchdog aborts the communicator and, with torch's default async error handling,
the process). After any error the group is closed and unusable: a half-streamed protocol cannot
be resumed, and the controller ends the run.

Backends: "nccl" moves CUDA buffers GPU to GPU. "gloo" moves host buffers: CUDA tensors are packed
into a bucket on their own device and staged through pinned host memory (one device-host copy per
bucket, not per tensor), which also makes two ranks on one GPU possible (NCCL cannot put two ranks
on one device).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from diffrl.workers.sync_rendezvous import (
    _STORE_PREFIX,
    _cuda_device,
    _first_line,
    _listen_socket,
    _make_backend,
)
from diffrl.workers.weight_specs import (
    TensorSpec,
    _parse_blob,
    _spec_blob,
    check_specs,
    differing_digests,
    digest_table,
)

BACKENDS = ("gloo", "nccl")


# ------------------------------------------------------------------------------------------ stats
@dataclass
class SyncStats:
    """What one sync moved: payload bytes only (the small headers and spec lists are not counted),
    so `bytes` equals the sum of numel * element_size of the tensors streamed."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0

    def metrics(self, prefix: str = "weight_sync") -> dict[str, float]:
        rate = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return {
            f"{prefix}/tensors": float(self.tensors),
            f"{prefix}/bytes": float(self.bytes),
            f"{prefix}/buckets": float(self.buckets),
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/gb_per_s": rate,
        }


# ------------------------------------------------------------------------------------------ group
class WeightSyncGroup:
    """A process group of the weight source (rank 0 = trainer rank 0) and the R replicas (ranks 1..R),
    separate from (and coexisting with) any default process group the process already has (FSDP's).

    Build it with `join` on all R + 1 processes at once (the constructor is collective). Rank 0 calls
    `send` and every replica calls `receive`, once per sync, in the same order; see the module
    docstring for the protocol.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ):
        self._pg: dist.ProcessGroup | None = pg
        self._store: dist.Store | None = store
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self._pinned: torch.Tensor | None = None  # reused host staging buffer (gloo + CUDA)
        self._closed_reason: str | None = None

    @classmethod
    def join(
        cls, host: str, port: int, rank: int, world_size: int, *, backend: str, timeout_s: float
    ) -> WeightSyncGroup:
        """Join the group at `host:port` (rank 0 hosts the store there). Blocks until all
        `world_size` ranks joined, at most about `timeout_s`; NCCL needs `torch.cuda.set_device`
        first (the group uses the current device)."""
        if backend not in BACKENDS:
            raise ValueError(f"weight sync backend={backend!r}: use one of {BACKENDS}")
        if world_size < 2:
            raise ValueError(
                f"weight sync world_size={world_size}: needs the source and at least one replica"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"weight sync rank={rank} is outside 0..{world_size - 1}")
        if timeout_s <= 0:
            raise ValueError(f"weight sync timeout_s={timeout_s}: must be > 0 seconds")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("weight sync backend='nccl' needs CUDA; use backend='gloo' on CPU")
        timeout = timedelta(seconds=timeout_s)
        try:
            if rank == 0:
                listen = _listen_socket(host, port)
                store = dist.TCPStore(
                    host,
                    port,
                    world_size,
                    True,
                    timeout,
                    wait_for_workers=False,
                    master_listen_fd=listen.detach(),
                )
            else:
                store = dist.TCPStore(host, port, world_size, False, timeout)
            prefixed = dist.PrefixStore(_STORE_PREFIX, store)
            pg = _make_backend(backend, prefixed, rank, world_size, timeout, host)
        except RuntimeError as err:
            raise RuntimeError(
                f"weight sync: rank {rank}/{world_size} could not join the group at {host}:{port} "
                f"within {timeout_s:g} s: {_first_line(err)}"
            ) from err
        return cls(pg, store, rank, world_size, backend, timeout_s)

    # ------------------------------------------------------------------------------ source side
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> SyncStats:
        """Broadcast every (name, tensor) of the iterator to the replicas; rank 0 only.

        The iterator is consumed lazily, one tensor at a time, and each tensor is copied into the
        current bucket at once, so a generator that gathers FSDP2 shards never has more than one
        full tensor alive. Returns after every replica acknowledged the whole stream.
        """
        self._require(rank0=True, bucket_bytes=bucket_bytes)
        start = time.perf_counter()
        stats = SyncStats()
        sent: list[tuple[list[str], torch.Tensor]] = []  # each tensor's digest, taken as it goes
        try:
            bucket = _Bucket(bucket_bytes)
            for name, tensor in named_tensors:
                spec = TensorSpec.of(name, tensor)
                sent.append(digest_table([(name, tensor)]))
                if spec.nbytes > bucket_bytes:
                    self._flush(bucket, stats)
                    self._send_alone(spec, tensor, stats)
                    continue
                if bucket.used + spec.nbytes > bucket_bytes:
                    self._flush(bucket, stats)
                bucket.add(spec, tensor)
            self._flush(bucket, stats)
            self._broadcast_header(0, 0, 0)
            self._broadcast(self._digests(sent))
            self._ack()
        except Exception as err:
            self._fail("send", err)
        stats.seconds = time.perf_counter() - start
        return stats

    def _flush(self, bucket: _Bucket, stats: SyncStats) -> None:
        if not bucket.specs:
            return
        blob = _spec_blob(bucket.specs)
        self._broadcast_header(len(bucket.specs), bucket.used, blob.numel())
        self._broadcast(blob.to(self._wire_device()))
        if bucket.used:
            self._broadcast(self._to_wire(bucket.data[: bucket.used]))
        stats.tensors += len(bucket.specs)
        stats.bytes += bucket.used
        stats.buckets += 1
        bucket.clear()

    def _send_alone(self, spec: TensorSpec, tensor: torch.Tensor, stats: SyncStats) -> None:
        blob = _spec_blob([spec])
        self._broadcast_header(1, spec.nbytes, blob.numel())
        self._broadcast(blob.to(self._wire_device()))
        self._broadcast(self._to_wire(_byte_view(tensor.detach().contiguous())))
        stats.tensors += 1
        stats.bytes += spec.nbytes
        stats.buckets += 1

    def _to_wire(self, data_u8: torch.Tensor) -> torch.Tensor:
        """The bytes as the backend wants them: on the GPU for NCCL, in (pinned) host memory for gloo."""
        if self.backend == "nccl":
            if data_u8.device.type != "cuda":
                return data_u8.to(_cuda_device())
            return data_u8
        if data_u8.device.type == "cpu":
            return data_u8
        host = self._host_buffer(data_u8.numel())
        host.copy_(data_u8)
        return host

    # ---------------------------------------------------------------------------- replica side
    def receive(
        self, specs: Sequence[TensorSpec], params: Mapping[str, torch.Tensor], *, bucket_bytes: int
    ) -> SyncStats:
        """Receive the stream and copy each tensor into `params[name]` in place; ranks >= 1 only.

        `params` maps names to the replica's tensors, e.g. `module.state_dict()` (its tensors share
        storage with the module, so the copy lands in the model; parameters and buffers alike).
        `specs` is the list the source will stream, in order (from `tensor_specs` on the trainer);
        it is checked against `params` before anything moves, and every bucket's spec list is
        checked against it before that bucket's bytes move. `bucket_bytes` bounds this replica's
        buffer: a sender bucket larger than it (other than a lone oversized tensor) is an error.
        """
        self._require(rank0=False, bucket_bytes=bucket_bytes)
        check_specs(specs, params)
        start = time.perf_counter()
        stats = SyncStats()
        position = 0
        try:
            with torch.no_grad():
                while True:
                    count, payload, blob_bytes = self._broadcast_header()
                    if count == 0:
                        if position != len(specs):
                            missing = specs[position]
                            raise ValueError(
                                f"weight sync: the sender ended the stream after {position} of {len(specs)} "
                                f"tensors; {missing.name!r} ({missing.describe()}) and later ones never came"
                            )
                        break
                    got = _parse_blob(
                        self._broadcast(
                            torch.empty(blob_bytes, dtype=torch.uint8, device=self._wire_device())
                        )
                    )
                    _check_bucket(got, specs, position, payload, count)
                    if len(got) > 1 and payload > bucket_bytes:
                        raise ValueError(
                            f"weight sync: the sender's bucket of {payload} bytes exceeds this replica's "
                            f"bucket_bytes={bucket_bytes}; use the same bucket size on both sides"
                        )
                    self._receive_bucket(got, params, payload)
                    position += len(got)
                    stats.tensors += len(got)
                    stats.bytes += payload
                    stats.buckets += 1
                mismatch = self._check_digests(specs, params)
            self._ack(ok=mismatch is None)
            if mismatch is not None:
                raise mismatch
        except Exception as err:
            self._fail("receive", err)
        stats.seconds = time.perf_counter() - start
        return stats

    def _receive_bucket(
        self, specs: list[TensorSpec], params: Mapping[str, torch.Tensor], payload: int
    ) -> None:
        if payload == 0:
            return  # only empty tensors: the sender sent no payload either
        first = params[specs[0].name]
        if len(specs) == 1 and first.is_contiguous() and first.device == self._wire_device():
            # A lone tensor already where the backend writes: receive straight into it.
            self._broadcast(_byte_view(first))
            return
        wire = self._broadcast(self._receive_buffer(payload))
        data = wire if wire.device == first.device else wire.to(first.device)
        offset = 0
        for spec in specs:
            target = params[spec.name]
            chunk = data[offset : offset + spec.nbytes]
            if target.is_contiguous():
                _byte_view(target).copy_(chunk)
            else:
                target.copy_(chunk.to(target.device).view(target.dtype).view(target.shape))
            offset += spec.nbytes

    def _receive_buffer(self, payload: int) -> torch.Tensor:
        if self.backend == "gloo" and torch.cuda.is_available():
            return self._host_buffer(payload)
        return torch.empty(payload, dtype=torch.uint8, device=self._wire_device())

    def _digests(self, sent: list[tuple[list[str], torch.Tensor]]) -> torch.Tensor:
        """The source's digests of what it sent, as one float64[n, 2] tensor on the wire device."""
        if not sent:
            return torch.zeros(0, 2, dtype=torch.float64, device=self._wire_device())
        device = sent[0][1].device  # the tensors' (the trainer's GPU): one copy to the wire, not n
        return torch.cat([table.to(device) for _, table in sent]).to(self._wire_device())

    def _check_digests(
        self, specs: Sequence[TensorSpec], params: Mapping[str, torch.Tensor]
    ) -> Exception | None:
        """Receive the source's digests and compare them with this replica's of the tensors it
        wrote into; the mismatch to raise (after the acknowledgement), or None."""
        sent = self._broadcast(torch.empty(len(specs), 2, dtype=torch.float64, device=self._wire_device()))
        names, held = digest_table((spec.name, params[spec.name]) for spec in specs)
        differing = differing_digests(names, sent, held)
        if not differing:
            return None
        # only on a mismatch: lora_check's package (diffrl.models) imports diffusers, seconds
        # that a process streaming plain tensors need not spend
        from diffrl.models.lora_check import check_adapter_tensors

        shapes = {spec.name: spec.shape for spec in specs}
        try:
            check_adapter_tensors(
                f"weight sync to rank {self.rank}",
                shapes,
                shapes,
                differing=differing,
                side="the replica's model",
                fix="The bytes sent did not land in the module's tensors: a bug in the transport, please report it",
            )
        except ValueError as err:
            return err
        return None

    # ------------------------------------------------------------------------------ plumbing
    def _wire_device(self) -> torch.device:
        return _cuda_device() if self.backend == "nccl" else torch.device("cpu")

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of at least `nbytes`, kept between syncs (pinning is slow)."""
        if self._pinned is None or self._pinned.numel() < nbytes:
            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._pinned[:nbytes]

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        work = self._pg.broadcast([tensor], _broadcast_options())
        work.wait(self.timeout)
        return tensor

    def _broadcast_header(self, *values: int) -> tuple[int, int, int]:
        header = torch.tensor(values or (0, 0, 0), dtype=torch.int64, device=self._wire_device())
        self._broadcast(header)
        count, payload, blob_bytes = (int(v) for v in header.tolist())
        return count, payload, blob_bytes

    def _ack(self, ok: bool = True) -> None:
        """All ranks meet once the stream is over: the source's `send` returns only after every
        replica has unpacked and checked everything. A replica whose digests differ answers 0 (and
        raises its own error after); one that failed earlier never arrives: the source times out."""
        flag = torch.full((1,), int(ok), dtype=torch.int32, device=self._wire_device())
        self._pg.allreduce([flag], dist.AllreduceOptions()).wait(self.timeout)
        if ok and int(flag.item()) != self.world_size:
            raise ValueError(
                f"weight sync: acknowledgement summed to {int(flag.item())}, expected {self.world_size}: "
                "a replica found that the tensors it received differ from those sent (its own error names them)"
            )

    def _require(self, *, rank0: bool, bucket_bytes: int) -> None:
        if self._closed_reason is not None:
            raise RuntimeError(f"weight sync group is closed ({self._closed_reason}); join a new one")
        if rank0 and self.rank != 0:
            raise ValueError(f"send() is for rank 0 (the trainer); this is rank {self.rank}: call receive()")
        if not rank0 and self.rank == 0:
            raise ValueError("receive() is for the replicas (ranks >= 1); rank 0 is the source: call send()")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be > 0")

    def _fail(self, what: str, err: Exception) -> None:
        """Close the group (a half-done stream cannot be resumed) and re-raise: a ValueError (a
        mismatch the user can fix) unchanged, a transport error with the rank and the deadline."""
        self.close(reason=f"{type(err).__name__} during {what}")
        if isinstance(err, ValueError):
            raise err
        raise RuntimeError(
            f"weight sync {what} failed on rank {self.rank}/{self.world_size} ({self.backend}, "
            f"timeout {self.timeout.total_seconds():g} s): a peer died or stopped answering: {_first_line(err)}"
        ) from err

    def close(self, reason: str = "closed") -> None:
        """Drop the process group and the store (rank 0's store stops serving). Idempotent."""
        if self._closed_reason is not None:
            return
        self._closed_reason = reason
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            with contextlib.suppress(RuntimeError):  # already broken: nothing left to release
                pg.shutdown()
        self._store = None
        self._pinned = None


# -------------------------------------------------------------------------------------- helpers
class _Bucket:
    """The source's flat byte buffer, allocated on the device of the first tensor packed into it
    (the GPU on a trainer), once per sync and reused for every bucket."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.data: torch.Tensor | None = None
        self.specs: list[TensorSpec] = []
        self.used = 0

    def add(self, spec: TensorSpec, tensor: torch.Tensor) -> None:
        if self.data is None or (self.data.device != tensor.device and not self.specs):
            self.data = torch.empty(self.capacity, dtype=torch.uint8, device=tensor.device)
        self.data[self.used : self.used + spec.nbytes].copy_(_byte_view(tensor.detach().contiguous()))
        self.specs.append(spec)
        self.used += spec.nbytes

    def clear(self) -> None:
        self.specs = []
        self.used = 0


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat uint8, sharing memory (no copy)."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _check_bucket(
    got: list[TensorSpec], expected: Sequence[TensorSpec], position: int, payload: int, count: int
) -> None:
    if len(got) != count or sum(spec.nbytes for spec in got) != payload:
        raise RuntimeError(
            f"weight sync: corrupt bucket header ({count} tensors, {payload} bytes) for {len(got)} specs"
        )
    for offset, spec in enumerate(got):
        index = position + offset
        if index >= len(expected):
            raise ValueError(
                f"weight sync: the sender streams {spec.name!r} ({spec.describe()}) after the {len(expected)} "
                "tensors this replica expects: trainer and replica disagree on what is synced"
            )
        want = expected[index]
        if spec != want:
            raise ValueError(
                f"weight sync: tensor #{index}: the sender streams {spec.name!r} ({spec.describe()}), this "
                f"replica expects {want.name!r} ({want.describe()}): trainer and replica disagree on what is synced"
            )


def _broadcast_options() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts
