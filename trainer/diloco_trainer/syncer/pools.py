"""The syncer's worker threads, one pool per kind of work so that none queues behind another: a
checkpoint write never waits for an evaluation, a heartbeat never for a merge."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor as Pool


class Pools:
    def __init__(self) -> None:
        self.merge = Pool(1, thread_name_prefix="merge")  # outer steps and screens, in order
        self.decode = Pool(2, thread_name_prefix="decode")  # pushes in, downloads out
        self.checkpoint = Pool(1, thread_name_prefix="checkpoint")
        self.eval = Pool(1, thread_name_prefix="eval")
        self.journal = Pool(1, thread_name_prefix="journal")  # fragments, versions, leases

    def close(self) -> None:
        """Let queued merges, decodes and writes finish; drop a queued evaluation."""
        self.merge.shutdown(wait=True)
        self.decode.shutdown(wait=True)
        self.checkpoint.shutdown(wait=True)
        self.eval.shutdown(wait=False, cancel_futures=True)
        self.journal.shutdown(wait=True)
