"""A rank's reports to rank 0 (ranks other than 0, worker.py): those waiting for the next control
exchange, and those the last exchange took.

A report is numbered when it is packed. The reports the last exchange took are kept: when a peer dies
mid-exchange, rank 0 may not have received them even though this rank's side of the exchange
succeeded, so after a regroup they go again, ahead of any newer report packed since (the step of the
failed iteration may have run here and packed one). Rank 0 reads a rank's reports in order and drops a
number it has read already (driver.py); one it had received in the failed iteration it reads while it
recovers.
"""

from __future__ import annotations

from locus.engine.ep.ranks.messages import Report, encode_report, pack_reports


class ReportOutbox:
    def __init__(self):
        self.waiting: list[bytes] = []  # packed, oldest first: sent in the next exchange
        self.sent: list[bytes] = []  # those the last exchange took
        self.seq = 0  # the last number given

    def put(self, report: Report) -> None:
        """Number `report` and pack it for the next exchange, after any that wait."""
        self.seq += 1
        report.seq = self.seq
        self.waiting.append(encode_report(report))

    def payload(self) -> bytes:
        """What the next exchange carries to rank 0 (empty: no report)."""
        return pack_reports(self.waiting) if self.waiting else b""

    def exchanged(self) -> None:
        """The exchange that carried the waiting reports succeeded on this rank."""
        if self.waiting:
            self.sent, self.waiting = self.waiting, []

    def after_regroup(self) -> None:
        """The failed exchange may have lost the reports it took: they go again, before newer ones."""
        self.waiting = [r for r in self.sent if r not in self.waiting] + self.waiting
