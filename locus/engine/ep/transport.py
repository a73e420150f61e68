"""How a tier's rows travel: packed byte rows over one all_to_all_single, two layouts.

A row goes to group member m when `member_of[row, k] == m` for some k. It is packed once, with all
K of its (slot, weight) pairs, into one uint8 row (`RowFormat`), so the metadata rides in the
payload's collective; the receiver keeps the pairs it is there for (its node's slots in tier 1, its
own in tier 2):

    [ x: H * dtype bytes | padding to 8 | slots: K int32 | weights: K * dtype bytes | padding to 8 bytes ]

where x is the row as `--ep-dispatch-format` sends it (payload.py): its H * dtype bytes, or an MX
format's H elements and ceil(H/32) scales, encoded once by the exchange and decoded on arrival. The
combine sends [rows, H] partial sums back in `--ep-combine-format` (the model's dtype by default).

- `ExactTransport`: the rows' per-member counts go first (one small all_to_all), then exactly the
  rows; combine sends back exactly the received rows. Wire bytes = payload + metadata (+ counts).
  Rows and combine travel as one batch of point-to-point messages between the members that really
  exchange something (the counts say which, on both sides): an all_to_all would also send an empty
  message to every member it has nothing for, ~400 bytes each on the wire with gloo (bench/ep_wire.py),
  and a rank with nothing to send or receive in a tier skips the batch.
- `FixedTransport`: each member's block holds `capacity` rows, agreed for the whole step, so no
  count exchange and no host sync; unused rows are padding (slots -1), which the receiver computes to
  zero and which cost wire bytes but are never payload.

Both are written for few tokens (decode): a handful of tensor ops a tier, buffers and index bases
cached per shape.

Shape legend: N rows held by the sender, K experts per token, H hidden, M group members,
C capacity rows per member, P (row, member) pairs sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import irecv, isend  # bound at import: P2POp accepts only these two functions

from locus.engine.ep.counters import DeviceTally, ExchangeCounters
from locus.engine.ep.payload import Payload


@dataclass(frozen=True)
class RowFormat:
    hidden: int
    top_k: int
    dtype: torch.dtype
    dispatch_format: str = "model"  # how x travels out (payload.py)
    combine_format: str = "model"  # how the partial sums travel back
    dispatch: Payload = field(init=False)
    combine: Payload = field(init=False)
    x_bytes: int = field(init=False)  # the dispatch payload of a row: H * dtype bytes, or the MX format's packed row
    x_span: int = field(init=False)  # x_bytes rounded up to 8, so that the slots and weights after it are aligned
    weight_bytes: int = field(init=False)
    meta_bytes: int = field(init=False)  # routing metadata per packet as docs/design.md counts it: K slot ids (4 bytes) and K weights
    row_bytes: int = field(init=False)

    def __post_init__(self):
        item = self.dtype.itemsize
        set_ = object.__setattr__
        set_(self, "dispatch", Payload(self.hidden, self.dtype, self.dispatch_format))
        set_(self, "combine", Payload(self.hidden, self.dtype, self.combine_format))
        set_(self, "x_bytes", self.dispatch.nbytes)
        set_(self, "x_span", -(-self.x_bytes // 8) * 8)
        set_(self, "weight_bytes", self.top_k * item)
        set_(self, "meta_bytes", self.top_k * 4 + self.top_k * item)
        set_(self, "row_bytes", -(-(self.x_span + self.meta_bytes) // 8) * 8)

    def pack(self, xb: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[P, x_bytes] encoded rows (`dispatch.encode`), [P, K], [P, K] -> [P, row_bytes] uint8."""
        out = torch.empty((xb.shape[0], self.row_bytes), dtype=torch.uint8, device=xb.device)
        if xb.shape[0] == 0:  # (an empty tensor may carry strides a byte view refuses)
            return out
        a, b = self.x_span, self.x_span + 4 * self.top_k
        out[:, :self.x_bytes] = xb
        out[:, a:b] = slots.to(torch.int32).contiguous().view(torch.uint8)
        out[:, b:b + self.weight_bytes] = weights.to(self.dtype).contiguous().view(torch.uint8)
        return out  # the padding bytes are never read

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[P, row_bytes] uint8 -> encoded x [P, x_bytes], slots [P, K] int64, weights [P, K] (views where they can be)."""
        a, b = self.x_span, self.x_span + 4 * self.top_k
        xb = rows[:, :self.x_bytes]
        slots = rows[:, a:b].view(torch.int32).long()
        weights = rows[:, b:b + self.weight_bytes].view(self.dtype)
        return xb, slots, weights

    def delivery(self, rows: torch.Tensor, route) -> "Delivery":
        xb, slots, weights = self.unpack(rows)
        return Delivery(self.dispatch.decode(xb), slots, weights, route, self, xb)

    def padding(self, rows: int, device) -> torch.Tensor:
        """Padding rows: zeros (zero in every payload format), every slot -1."""
        out = torch.zeros((rows, self.row_bytes), dtype=torch.uint8, device=device)
        out[:, self.x_span:self.x_span + 4 * self.top_k] = 255  # int32 -1
        return out


@dataclass
class Delivery:
    """The rows a dispatch delivered to this rank, and how to send values for them back."""

    x: torch.Tensor  # [R, H] rows received, decoded (fixed: every block row, padding included)
    slots: torch.Tensor  # [R, K] their slots (-1: not for this node / padding)
    weights: torch.Tensor  # [R, K]
    route: object  # the transport's own record of where the sent rows went
    format: RowFormat
    encoded: torch.Tensor  # [R, x_bytes] the rows as they travelled (a proxy forwards these, not re-encoded)


def hits(member_of: torch.Tensor, size: int) -> torch.Tensor:
    """[N, M] bool: row n goes to member m (member_of [N, K], -1 = nowhere)."""
    if member_of.shape[1] == 1:
        return member_of == torch.arange(size, device=member_of.device)
    return (member_of[:, :, None] == torch.arange(size, device=member_of.device)).any(dim=1)


class Transport:
    name = "?"

    def dispatch(self, x, slots, weights, member_of, size, group, fmt: RowFormat, capacity: int, tier: str,
                 counters: ExchangeCounters, tally: DeviceTally, payload: bool = True) -> Delivery:
        """Send each row to the members `member_of` names. x: [N, x_bytes] the rows as encoded by
        `fmt.dispatch` (what travels); the delivery holds them decoded and as they came. `payload`:
        count the rows as the tier's payload (dispatch and combine, each in its format, and metadata)
        here; False where the source ranks count them themselves (tier 2, exchange.py). Wire bytes are
        always counted by the sender."""
        raise NotImplementedError

    def combine(self, values, delivery: Delivery, group, tier: str, counters: ExchangeCounters) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class _ExactRoute:
    row: torch.Tensor  # [P] the sender's row of each pair, in send order (sorted by member)
    sent: list[int]
    received: list[int]
    rows: int  # N, the sender's row count


P2P_TAG = 41  # sparse_all_to_all's messages (no other point-to-point traffic shares its groups)


def sparse_all_to_all(send: torch.Tensor, receive: torch.Tensor, sent: list[int], received: list[int],
                      group) -> bool:
    """all_to_all_single(receive, send, received, sent) as one batch of point-to-point messages
    between the members that exchange something; this rank's own block is a local copy. Every member
    must know the sizes it sends and receives (from counts or headers exchanged before), so the
    sends and receives pair up. Returns whether any message was issued (a collective to count).
    Used by the exact transport's rows and combine and by the control plane's messages."""
    ops, at_send, at_receive, me = [], 0, 0, group.rank()
    for member, (s, r) in enumerate(zip(sent, received)):
        if member == me:
            if s:
                receive[at_receive:at_receive + r].copy_(send[at_send:at_send + s])
        else:
            if s:
                ops.append(dist.P2POp(isend, send[at_send:at_send + s], group=group, tag=P2P_TAG, group_peer=member))
            if r:
                ops.append(dist.P2POp(irecv, receive[at_receive:at_receive + r], group=group, tag=P2P_TAG,
                                      group_peer=member))
        at_send += s
        at_receive += r
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return bool(ops)


class ExactTransport(Transport):
    name = "exact"

    def dispatch(self, x, slots, weights, member_of, size, group, fmt, capacity, tier, counters, tally, payload=True):
        hit = hits(member_of, size)
        member, row = hit.t().nonzero(as_tuple=True)  # pairs sorted by member, rows ascending within one
        sent_counts = hit.sum(dim=0)
        received_counts = torch.empty_like(sent_counts)
        dist.all_to_all_single(received_counts, sent_counts, group=group)
        sent, received = sent_counts.tolist(), received_counts.tolist()
        packed = fmt.pack(x, slots, weights)[row]
        buf = packed.new_empty((sum(received), fmt.row_bytes))
        pairs = len(row)
        counters.collectives += 1 + sparse_all_to_all(packed, buf, sent, received, group)
        if payload:
            _count_payload(counters, tier, pairs * fmt.x_bytes, pairs * fmt.combine.nbytes, pairs * fmt.meta_bytes)
        setattr(counters, f"wire_{tier}_dispatch", getattr(counters, f"wire_{tier}_dispatch")
                + pairs * fmt.row_bytes + 8 * (size - 1))
        return fmt.delivery(buf, _ExactRoute(row, sent, received, x.shape[0]))

    def combine(self, values, delivery, group, tier, counters):
        route: _ExactRoute = delivery.route
        payload = delivery.format.combine
        send = payload.encode(values)
        back = send.new_empty((sum(route.sent), payload.nbytes))
        counters.collectives += sparse_all_to_all(send, back, route.received, route.sent, group)
        setattr(counters, f"wire_{tier}_combine", getattr(counters, f"wire_{tier}_combine")
                + send.shape[0] * payload.nbytes)
        out = values.new_zeros((route.rows, values.shape[1]))
        return out.index_add_(0, route.row, payload.decode(back))


@dataclass
class _FixedRoute:
    where: torch.Tensor  # [N, M] flat block row of each (row, member) pair; the trash row when not sent
    hit: torch.Tensor  # [N, M]
    capacity: int
    size: int


class FixedTransport(Transport):
    name = "fixed"

    def __init__(self):
        self._templates: dict[tuple, torch.Tensor] = {}  # padding blocks, per (rows, format, device)

    def _send_buffer(self, rows: int, fmt: RowFormat, device) -> torch.Tensor:
        key = (rows, fmt, str(device))
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) > 64:  # capacities vary by step: keep the cache small
                self._templates.clear()
            template = self._templates[key] = fmt.padding(rows, device)
        return template.clone()

    def dispatch(self, x, slots, weights, member_of, size, group, fmt, capacity, tier, counters, tally, payload=True):
        N, device = x.shape[0], x.device
        hit = hits(member_of, size)  # [N, M]
        index = torch.cumsum(hit, dim=0) - 1  # [N, M] place in the member's block
        block = torch.arange(0, size * (capacity + 1), capacity + 1, device=device)
        where = torch.where(hit, block + index, block + capacity)  # row `capacity` of a block is trash
        send = self._send_buffer(size * (capacity + 1), fmt, device)
        send.index_copy_(0, where.view(-1), fmt.pack(x, slots, weights).repeat_interleave(size, dim=0))
        if N and device.type == "cpu" and int(index[-1].max()) >= capacity:  # a capacity bug (a free check on CPU)
            raise RuntimeError(f"fixed-capacity exchange: {int(index[-1].max()) + 1} rows for one member exceed the capacity {capacity}")
        send = send.view(size, capacity + 1, fmt.row_bytes)[:, :capacity].reshape(size * capacity, fmt.row_bytes).contiguous()
        buf = torch.empty_like(send)
        dist.all_to_all_single(buf, send, group=group)
        counters.collectives += 1
        if payload:
            pairs = hit.sum()
            tally.add(f"{tier}_bytes", pairs * fmt.x_bytes)
            tally.add(f"{tier}_combine_bytes", pairs * fmt.combine.nbytes)
            tally.add("metadata_bytes", pairs * fmt.meta_bytes)
        setattr(counters, f"wire_{tier}_dispatch", getattr(counters, f"wire_{tier}_dispatch")
                + (size - 1) * capacity * fmt.row_bytes)
        return fmt.delivery(buf, _FixedRoute(where, hit, capacity, size))

    def combine(self, values, delivery, group, tier, counters):
        route: _FixedRoute = delivery.route
        payload = delivery.format.combine
        H = values.shape[1]
        send = payload.encode(values)
        back = torch.empty((route.size * (route.capacity + 1), H), dtype=values.dtype, device=values.device)
        blocks = back.view(route.size, route.capacity + 1, H)
        blocks[:, route.capacity].zero_()  # the trash row reads 0
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        counters.collectives += 1
        blocks[:, :route.capacity] = payload.decode(received).view(route.size, route.capacity, H)
        setattr(counters, f"wire_{tier}_combine", getattr(counters, f"wire_{tier}_combine")
                + (route.size - 1) * route.capacity * payload.nbytes)
        return back[route.where].sum(dim=1)


def _count_payload(counters: ExchangeCounters, tier: str, dispatch: int, combine: int, metadata: int) -> None:
    """Dispatch and combine carry the same rows (each in its own format): the source counts both when
    it sends."""
    setattr(counters, f"{tier}_dispatch", getattr(counters, f"{tier}_dispatch") + dispatch)
    setattr(counters, f"{tier}_combine", getattr(counters, f"{tier}_combine") + combine)
    counters.metadata += metadata


TRANSPORTS = {"exact": ExactTransport, "fixed": FixedTransport}
