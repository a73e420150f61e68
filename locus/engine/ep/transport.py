"""How a tier's rows travel: packed byte rows over one all_to_all_single, two layouts.

A row is sent to group member m when `member_of[row, k] == m` for some k; it carries the hidden state
and only the (slot, weight) pairs that m holds (the others read -1). `RowFormat` packs the three
into one uint8 row, so the metadata rides in the payload's collective:

    [ x: H * dtype bytes | slots: K int32 | weights: K * dtype bytes | padding to 8 bytes ]

- `ExactTransport`: the rows' per-member counts go first (one small all_to_all), then exactly the
  rows; combine sends back exactly the received rows. Wire bytes = payload + metadata (+ counts).
- `FixedTransport`: each member's block holds `capacity` rows, agreed for the whole step, so no
  count exchange and no host sync; unused rows are padding (slots -1), which the receiver computes to
  zero and which cost wire bytes but are never payload.

Shape legend: N rows held by the sender, K experts per token, H hidden, M group members,
C capacity rows per member, P (row, member) pairs sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from locus.engine.ep.counters import DeviceTally, ExchangeCounters


@dataclass(frozen=True)
class RowFormat:
    hidden: int
    top_k: int
    dtype: torch.dtype

    @property
    def x_bytes(self) -> int:
        return self.hidden * torch.empty((), dtype=self.dtype).element_size()

    @property
    def weight_bytes(self) -> int:
        return self.top_k * torch.empty((), dtype=self.dtype).element_size()

    @property
    def meta_bytes(self) -> int:
        """Routing metadata per row as DESIGN.md counts it: K slot ids (4 bytes) and K weights."""
        return self.top_k * 4 + self.weight_bytes

    @property
    def row_bytes(self) -> int:
        return -(-(self.x_bytes + self.meta_bytes) // 8) * 8

    def pack(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[P, H], [P, K], [P, K] -> [P, row_bytes] uint8."""
        parts = [x.contiguous().view(torch.uint8), slots.to(torch.int32).contiguous().view(torch.uint8),
                 weights.to(self.dtype).contiguous().view(torch.uint8)]
        pad = self.row_bytes - self.x_bytes - self.meta_bytes
        if pad:
            parts.append(torch.zeros((x.shape[0], pad), dtype=torch.uint8, device=x.device))
        return torch.cat(parts, dim=1)

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[P, row_bytes] uint8 -> x [P, H], slots [P, K] int64, weights [P, K]."""
        a, b = self.x_bytes, self.x_bytes + 4 * self.top_k
        x = rows[:, :a].contiguous().view(self.dtype)
        slots = rows[:, a:b].contiguous().view(torch.int32).long()
        weights = rows[:, b:b + self.weight_bytes].contiguous().view(self.dtype)
        return x, slots, weights

    def padding(self, rows: int, device) -> torch.Tensor:
        """Padding rows: zeros, every slot -1."""
        out = torch.zeros((rows, self.row_bytes), dtype=torch.uint8, device=device)
        out[:, self.x_bytes:self.x_bytes + 4 * self.top_k] = 255  # int32 -1
        return out


@dataclass
class Delivery:
    """The rows a dispatch delivered to this rank, and how to send values for them back."""

    x: torch.Tensor  # [R, H] rows received (fixed: every block row, padding included)
    slots: torch.Tensor  # [R, K] their slots (-1: not for this node / padding)
    weights: torch.Tensor  # [R, K]
    route: object  # the transport's own record of where the sent rows went
    format: RowFormat


def member_slots(slots: torch.Tensor, member_of: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hit [N, M]: row n goes to member m; per_member [N, M, K]: the slots it carries there."""
    members = torch.arange(size, device=slots.device)
    on = member_of[:, None, :] == members[None, :, None]  # [N, M, K]
    return on.any(dim=2), torch.where(on, slots[:, None, :], -1)


class Transport:
    name = "?"

    def dispatch(self, x, slots, weights, member_of, size, group, fmt: RowFormat, capacity: int, tier: str,
                 counters: ExchangeCounters, tally: DeviceTally) -> Delivery:
        raise NotImplementedError

    def combine(self, values, delivery: Delivery, group, tier: str, counters: ExchangeCounters) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class _ExactRoute:
    row: torch.Tensor  # [P] the sender's row of each pair, in send order (sorted by member)
    sent: list[int]
    received: list[int]
    rows: int  # N, the sender's row count


class ExactTransport(Transport):
    name = "exact"

    def dispatch(self, x, slots, weights, member_of, size, group, fmt, capacity, tier, counters, tally):
        hit, per_member = member_slots(slots, member_of, size)
        member, row = hit.t().nonzero(as_tuple=True)  # pairs sorted by member, rows ascending within one
        sent_counts = torch.bincount(member, minlength=size).to(torch.int64)
        received_counts = torch.empty_like(sent_counts)
        dist.all_to_all_single(received_counts, sent_counts, group=group)
        sent, received = sent_counts.tolist(), received_counts.tolist()
        packed = fmt.pack(x[row], per_member[row, member], weights[row])
        buf = packed.new_empty((sum(received), fmt.row_bytes))
        dist.all_to_all_single(buf, packed, received, sent, group=group)
        pairs = len(row)
        counters.collectives += 2
        _count_payload(counters, tier, pairs * fmt.x_bytes, pairs * fmt.meta_bytes)
        setattr(counters, f"wire_{tier}_dispatch", getattr(counters, f"wire_{tier}_dispatch")
                + pairs * fmt.row_bytes + 8 * (size - 1))
        rx, rslots, rw = fmt.unpack(buf)
        return Delivery(rx, rslots, rw, _ExactRoute(row, sent, received, x.shape[0]), fmt)

    def combine(self, values, delivery, group, tier, counters):
        route: _ExactRoute = delivery.route
        back = values.new_empty((sum(route.sent), values.shape[1]))
        dist.all_to_all_single(back, values.contiguous(), route.sent, route.received, group=group)
        counters.collectives += 1
        setattr(counters, f"wire_{tier}_combine", getattr(counters, f"wire_{tier}_combine")
                + values.shape[0] * values.shape[1] * values.element_size())
        out = values.new_zeros((route.rows, values.shape[1]))
        return out.index_add_(0, route.row, back)


@dataclass
class _FixedRoute:
    where: torch.Tensor  # [N, M] flat block row of each (row, member) pair; the trash row when not sent
    hit: torch.Tensor  # [N, M]
    capacity: int
    size: int


class FixedTransport(Transport):
    name = "fixed"

    def dispatch(self, x, slots, weights, member_of, size, group, fmt, capacity, tier, counters, tally):
        N, device = x.shape[0], x.device
        hit, per_member = member_slots(slots, member_of, size)
        index = torch.cumsum(hit.to(torch.int64), dim=0) - 1  # [N, M] place in the member's block
        block = torch.arange(size, device=device)[None, :] * (capacity + 1)
        where = torch.where(hit, block + index, block + capacity)  # row `capacity` of a block is trash
        send = fmt.padding(size * (capacity + 1), device)
        H, K = x.shape[1], slots.shape[1]
        packed = fmt.pack(x[:, None, :].expand(N, size, H).reshape(N * size, H), per_member.reshape(N * size, K),
                          weights[:, None, :].expand(N, size, K).reshape(N * size, K))
        send.index_copy_(0, where.reshape(-1), packed)
        if N and device.type == "cpu" and int(index.max()) >= capacity:  # a bug in the capacity bound (a free check on CPU)
            raise RuntimeError(f"fixed-capacity exchange: {int(index.max()) + 1} rows for one member exceed the capacity {capacity}")
        send = send.view(size, capacity + 1, fmt.row_bytes)[:, :capacity].contiguous().view(size * capacity, fmt.row_bytes)
        buf = torch.empty_like(send)
        dist.all_to_all_single(buf, send, group=group)
        counters.collectives += 1
        pairs = hit.sum()
        tally.add(f"{tier}_bytes", pairs * fmt.x_bytes)
        tally.add("metadata_bytes", pairs * fmt.meta_bytes)
        setattr(counters, f"wire_{tier}_dispatch", getattr(counters, f"wire_{tier}_dispatch")
                + (size - 1) * capacity * fmt.row_bytes)
        rx, rslots, rw = fmt.unpack(buf)
        return Delivery(rx, rslots, rw, _FixedRoute(where, hit, capacity, size), fmt)

    def combine(self, values, delivery, group, tier, counters):
        route: _FixedRoute = delivery.route
        H = values.shape[1]
        values = values.contiguous()
        back = torch.empty_like(values)
        dist.all_to_all_single(back, values, group=group)
        counters.collectives += 1
        setattr(counters, f"wire_{tier}_combine", getattr(counters, f"wire_{tier}_combine")
                + (route.size - 1) * route.capacity * H * values.element_size())
        blocks = torch.cat([back.view(route.size, route.capacity, H),
                            back.new_zeros((route.size, 1, H))], dim=1).view(-1, H)  # the trash row reads 0
        return blocks[route.where.reshape(-1)].view(*route.where.shape, H).sum(dim=1)


def _count_payload(counters: ExchangeCounters, tier: str, payload: int, metadata: int) -> None:
    """Dispatch and combine carry the same rows: the source counts both when it sends."""
    setattr(counters, f"{tier}_dispatch", getattr(counters, f"{tier}_dispatch") + payload)
    setattr(counters, f"{tier}_combine", getattr(counters, f"{tier}_combine") + payload)
    counters.metadata += metadata


TRANSPORTS = {"exact": ExactTransport, "fixed": FixedTransport}
