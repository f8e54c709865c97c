"""Rank 0 → other ranks: control messages and each step's SchedulerOutput, as plain data.

A message is a msgpack map (plain types only: no pickle, extension types refused), broadcast
over the group's gloo CPU group as two tensors: its length (int64) and its bytes (uint8).

A step travels as a *diff* (:class:`StepEncoder` / :class:`StepDecoder`): for every scheduled
sequence its new token ids, start position, whether it samples, and only the pages its block
table gained since the previous step. No sampling parameters travel: rank 0 samples; the other
ranks run the same forward (same shapes, same collectives: the runner's route depends on shapes
and sample flags only) with greedy parameters, so their ids cost an argmax and are dropped. Block tables only grow while a sequence
runs; a sequence that was not in the previous step, or whose table no longer extends what was
sent (preempted and readmitted), is sent whole. Both sides keep the tables of the previous
step's sequences only, so nothing accumulates.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

from engine.parallel.group import TPError, TPGroup
from engine.sampling import SamplingParams
from engine.sched.scheduler import ScheduledSeq, SchedulerOutput

MAX_MESSAGE_BYTES = 64 << 20
ITEMS_PER_SEQ = 7


class WireError(TPError):
    """A control message is malformed, too large, or not plain data."""


def _no_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code} in a control message")


class ControlChannel:
    """Broadcast of plain-data messages from rank 0 to every other rank of ``group``."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.bytes_sent = 0
        self.messages = 0

    def send(self, msg: dict[str, Any]) -> None:
        """Rank 0: broadcast ``msg`` (returns once the bytes are handed to the group)."""
        if self.group.rank != 0:
            raise WireError("only rank 0 sends control messages")
        if self.group.world_size == 1:
            return
        payload = msgpack.packb(msg, use_bin_type=True)
        if len(payload) > MAX_MESSAGE_BYTES:
            raise WireError(f"control message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
        n = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group.cpu_group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group.cpu_group)
        self.bytes_sent += len(payload)
        self.messages += 1

    def recv(self) -> dict[str, Any]:
        """Ranks > 0: the next message from rank 0 (blocks until it comes)."""
        if self.group.rank == 0:
            raise WireError("rank 0 does not receive control messages")
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group.cpu_group)
        size = int(n.item())
        if not 0 < size <= MAX_MESSAGE_BYTES:
            raise WireError(f"control message of {size} bytes announced")
        buf = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group.cpu_group)
        try:
            msg = msgpack.unpackb(buf.numpy().tobytes(), raw=False, strict_map_key=True, ext_hook=_no_ext)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise WireError(f"undecodable control message: {e}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            raise WireError("a control message is a map with a string 'op'")
        return msg


class StepEncoder:
    """Rank 0 side: SchedulerOutput → plain dict, block tables as diffs against the last step."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def encode(self, out: SchedulerOutput) -> dict[str, Any]:
        seqs = []
        tables: dict[int, list[int]] = {}
        for s in out.seqs:
            table = list(s.block_table)  # the scheduler's list is live: copy this step's state
            prev = self._tables.get(s.seq_id)
            if prev is not None and len(prev) <= len(table) and table[:len(prev)] == prev:
                base = len(prev)
            else:
                base = -1  # sent whole: the receiver replaces its copy
            tables[s.seq_id] = table
            seqs.append([s.seq_id, list(s.token_ids), s.start_pos, base, table[max(base, 0):], bool(s.sample),
                         s.output_step])
        self._tables = tables
        return {"seqs": seqs, "nd": out.num_decodes, "nt": out.num_batched_tokens}


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise WireError(f"step message: {what} must be an integer, got {type(v).__name__}")
    return v


class StepDecoder:
    """Other ranks: the plain dict → a SchedulerOutput the model runner executes as rank 0 does."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}
        self._greedy = SamplingParams(temperature=0.0)  # read-only here; shared by every entry

    def decode(self, d: Any) -> SchedulerOutput:
        if not isinstance(d, dict) or not isinstance(d.get("seqs"), list):
            raise WireError("step message: 'seqs' must be a list")
        seqs: list[ScheduledSeq] = []
        tables: dict[int, list[int]] = {}
        for item in d["seqs"]:
            if not isinstance(item, list) or len(item) != ITEMS_PER_SEQ:
                raise WireError(f"step message: each sequence is a {ITEMS_PER_SEQ}-item list")
            seq_id, token_ids, start_pos, base, tail, sample, output_step = item
            seq_id, start_pos, base = _int(seq_id, "seq_id"), _int(start_pos, "start_pos"), _int(base, "base")
            if not isinstance(token_ids, list) or not isinstance(tail, list) or not isinstance(sample, bool):
                raise WireError("step message: malformed sequence entry")
            if base < 0:
                table = list(tail)
            else:
                prev = self._tables.get(seq_id)
                if prev is None or len(prev) != base:
                    raise WireError(f"step message: table diff of sequence {seq_id} at {base} does not "
                                    "follow the previous step")
                table = prev + tail
            tables[seq_id] = table
            seqs.append(ScheduledSeq(seq_id, "", token_ids, start_pos, table, sample,
                                     _int(output_step, "output_step"), self._greedy))
        self._tables = tables
        return SchedulerOutput(seqs=seqs, num_decodes=_int(d.get("nd"), "nd"),
                               num_batched_tokens=_int(d.get("nt"), "nt"))
