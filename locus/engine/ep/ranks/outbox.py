"""A rank's reports to rank 0 (ranks other than 0, worker.py): the one waiting for the next control
exchange, and the last one sent.

A report is numbered when it is packed. The last one sent is kept: when a peer dies mid-exchange, rank
0 may not have received it, so after a regroup it is sent again unless a newer one waits (rank 0
drops a number it has read already, driver.py; one it had received in the failed iteration it reads
while it recovers).
"""

from __future__ import annotations

from locus.engine.ep.ranks.messages import Report, encode_report


class ReportOutbox:
    def __init__(self):
        self.waiting = b""  # packed, sent in the next exchange
        self.sent = b""  # the last one the exchange took
        self.seq = 0  # the last number given

    def put(self, report: Report) -> None:
        """Number `report` and pack it for the next exchange (it replaces none: one report an iteration)."""
        self.seq += 1
        report.seq = self.seq
        self.waiting = encode_report(report)

    def exchanged(self) -> None:
        """The exchange that carried the waiting report succeeded on this rank."""
        if self.waiting:
            self.sent, self.waiting = self.waiting, b""

    def after_regroup(self) -> None:
        """Send the last report again unless a newer one waits: the failed exchange may have lost it."""
        if not self.waiting:
            self.waiting = self.sent
