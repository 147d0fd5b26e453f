"""The learner's background link to the syncer: sender, pollers and heartbeat threads.

The training loop never waits on the network. It hands work over through two non-blocking
calls and reads shared state:

- `enqueue_push(...)`: a fragment is due. A push carries the progress since the learner's
  previous push or install of that fragment (``delta = base - theta``, where `base` is the
  fragment's value at that moment), so no progress is ever sent twice. A push that could not be
  sent yet is folded into the next one of its fragment (`combine`): one request per fragment
  in flight, and nothing lost. The SENDER thread reads the fragment's parameters to host (the
  device->host copy happens here, off the hot path), computes the delta and pushes it.
- `drain()`: new global fragment versions that the POLLER threads (one long-poll per fragment)
  received since the last call.
- the HEARTBEAT thread reports step/tokens/throughput/loss every heartbeat period, keeps the
  run's share of its budget (`budget_done`), and sets `complete` when the budget is reached.

Connection trouble and 5xx answers are retried with exponential backoff (capped, jittered);
4xx answers are logged and the request dropped (retrying the same request cannot help).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import jax
import numpy as np

from diloco_trainer.learner.client import SyncerRejected, SyncerUnavailable
from diloco_trainer.learner.syncer_api import SyncerApi

log = logging.getLogger(__name__)

POLL_WAIT_SECONDS = 10.0
T = TypeVar("T")


@dataclass(frozen=True)
class PendingPush:
    fragment: int
    base_version: int  # the global version the learner last received (for the staleness bound)
    # The fragment at the previous push (device) or install (host): the delta is base - theta.
    base: Mapping[str, np.ndarray | jax.Array]
    theta: Mapping[str, jax.Array]  # the learner's current leaves (still on device)
    c_steps: int
    c_tokens: int
    step: int
    carry: Mapping[str, np.ndarray] | None = None  # unsent progress of an earlier push (host)


def combine(older: PendingPush, newer: PendingPush) -> PendingPush:
    """One push with the progress of both, the newer one's version and step.

    If `newer` continues from `older` (its base is `older`'s theta: no install in between), the
    two deltas telescope to older.base - newer.theta and nothing is computed here. Otherwise an
    install overwrote the fragment in between, and `older`'s delta is computed now (host) and
    carried, so neither progress is lost nor device memory held for it.
    """
    counters = (older.c_steps + newer.c_steps, older.c_tokens + newer.c_tokens)
    if newer.base is older.theta:
        return PendingPush(
            newer.fragment,
            newer.base_version,
            older.base,
            newer.theta,
            *counters,
            newer.step,
            older.carry,
        )
    carry = fragment_delta(older)
    if newer.carry is not None:
        carry = {k: v + newer.carry[k] for k, v in carry.items()}
    return PendingPush(
        newer.fragment, newer.base_version, newer.base, newer.theta, *counters, newer.step, carry
    )


@dataclass(frozen=True)
class Arrival:
    fragment: int
    version: int
    tensors: dict[str, np.ndarray]


@dataclass
class Progress:
    """What the heartbeat reports; written by the training loop, read by the heartbeat thread."""

    step: int = 0
    tokens: int = 0
    tokens_per_sec: float = 0.0
    loss: jax.Array | float | None = None


class Backoff:
    """Exponential backoff with full jitter, reset after a success."""

    def __init__(self, first: float = 0.2, cap: float = 5.0) -> None:
        self.first, self.cap, self.failures = first, cap, 0

    def next_delay(self) -> float:
        self.failures += 1
        return random.uniform(0.5, 1.0) * min(self.cap, self.first * 2 ** (self.failures - 1))

    def reset(self) -> None:
        self.failures = 0

    def after(self, error: Exception) -> float:
        """The next delay, no shorter than what the error asks for (a 429's Retry-After, the
        pause after a certificate that does not verify)."""
        floor = error.retry_after if isinstance(error, SyncerUnavailable) else 0.0
        return max(self.next_delay(), floor)


def host_copy(leaf: jax.Array) -> np.ndarray:
    """A replicated array's value from this process's first local shard (works multi-host)."""
    return np.asarray(leaf.addressable_data(0))


def _host(value: np.ndarray | jax.Array) -> np.ndarray:
    return host_copy(value) if isinstance(value, jax.Array) else np.asarray(value)


def fragment_delta(
    push: PendingPush, theta_host: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """base_p - theta_p (+ carried unsent progress), float32, per leaf of the fragment. If
    `theta_host` is given, it receives the host copy of theta made on the way."""
    theta_host = {} if theta_host is None else theta_host
    delta = {}
    for name, theta in push.theta.items():
        theta_host[name] = host_copy(theta)
        delta[name] = np.asarray(_host(push.base[name]), np.float32) - theta_host[name]
    if push.carry is not None:
        for name, value in push.carry.items():
            delta[name] += value
    return delta


class SyncLink:
    def __init__(
        self,
        client: SyncerApi,
        versions: list[int],
        heartbeat_seconds: float,
        progress: Progress,
    ) -> None:
        self.client = client
        self.progress = progress
        self.heartbeat_seconds = heartbeat_seconds
        self.complete = threading.Event()
        # Another process is this unit now (the syncer's 409 superseded): a recreated pod took
        # over from a warm spare's cover, or from this pod while it was thought lost.
        self.superseded = threading.Event()
        self.budget_done = 0.0  # the run's share of its budget, as of the last heartbeat reply
        self.stopping = threading.Event()
        self.stats = {"pushes": 0, "push_failures": 0, "push_combined": 0, "rejected": 0}
        self.last_quant_error = 0.0
        self._known = list(versions)  # the version last seen per fragment (pollers' cursor)
        self._outbox: dict[int, PendingPush] = {}
        # Pushes whose request failed. The syncer may have applied one anyway (a timeout after
        # it was received), so it is resent exactly as it was (the syncer drops a repeat by
        # unit, attempt and step), never folded into a newer push, and goes before its
        # fragment's queued one.
        self._retry: dict[int, PendingPush] = {}
        # Per link (the syncer process a fragment's requests go to, `client.link_of`): its
        # backoff and the time it may be tried again. A link that fails stalls only the
        # fragments it serves: a shard down must not hold back the others' pushes.
        self._backoff: dict[int, Backoff] = {}
        self._paused_until: dict[int, float] = {}
        # fragment -> (theta of its last sent push, that theta's host copy): see `settled`.
        self._sent_theta: dict[int, tuple[Mapping[str, jax.Array], dict[str, np.ndarray]]] = {}
        self._outbox_cv = threading.Condition()
        self._inbox: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._sender, name="sender", daemon=True),
            threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True),
        ] + [
            threading.Thread(target=self._poller, args=(p,), name=f"poller-{p}", daemon=True)
            for p in range(len(versions))
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self.stopping.set()
        with self._outbox_cv:
            self._outbox_cv.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            # Pollers may sit in a long-poll for seconds; they are daemons and hold no state
            # worth saving, so only the sender and the heartbeat are waited for.
            if not thread.name.startswith("poller"):
                thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ training-loop side
    def enqueue_push(self, push: PendingPush) -> None:
        with self._outbox_cv:
            queued = self._outbox.get(push.fragment)
            if queued is not None:
                self.stats["push_combined"] += 1
                push = combine(queued, push)
            self._outbox[push.fragment] = push
            self._outbox_cv.notify()

    def drain(self) -> list[Arrival]:
        arrivals = []
        while True:
            try:
                arrivals.append(self._inbox.get_nowait())
            except queue.Empty:
                return arrivals

    def settled(
        self, fragment: int, base: Mapping[str, np.ndarray | jax.Array]
    ) -> Mapping[str, np.ndarray | jax.Array]:
        """`base` itself, or its host copy once the sender has pushed it as a push's theta.

        The learner measures its next push of a fragment from the previous push's theta, held
        on the device until then; swapping in the copy the sender made anyway gives the device
        memory back as soon as the push is out."""
        with self._outbox_cv:
            sent = self._sent_theta.pop(fragment, None)
        # Not `base`: the learner has moved on (an install, or a later push), and the entry is
        # of no further use; dropping it drops its device reference too.
        return sent[1] if sent is not None and sent[0] is base else base

    def pending_pushes(self) -> int:
        with self._outbox_cv:
            return len(self._outbox) + len(self._retry)

    # ------------------------------------------------------------------ threads
    def _wait(self, seconds: float) -> bool:
        """Sleep unless stopping; True when the link is stopping."""
        return self.stopping.wait(seconds)

    def _take(self, now: float) -> tuple[PendingPush | None, float | None]:
        """(Under the lock.) The next push to send: retries first, then the oldest due step, so
        fragments keep their staggered order; a fragment with a retry pending sends nothing
        newer before it, and none whose link is backing off goes. Else (None, seconds until a
        link may be tried again, or None to wait for a new push)."""

        def ready(fragment: int) -> bool:
            return self._paused_until.get(self.client.link_of(fragment), 0.0) <= now

        for source in (self._retry, self._outbox):
            due = [
                p for p in source if ready(p) and (source is self._retry or p not in self._retry)
            ]
            if due:
                fragment = min(due, key=lambda p: source[p].step)
                return source.pop(fragment), None
        waits = [t - now for t in self._paused_until.values() if t > now]
        return None, (min(waits) if waits and (self._retry or self._outbox) else None)

    def _next(self) -> PendingPush | None:
        """Block until a push may go (None: the link is stopping)."""
        with self._outbox_cv:
            while not self.stopping.is_set():
                push, wait = self._take(time.monotonic())
                if push is not None:
                    return push
                self._outbox_cv.wait(wait)
        return None

    def _sender(self) -> None:
        while (push := self._next()) is not None:
            link = self.client.link_of(push.fragment)
            theta_host: dict[str, np.ndarray] = {}
            try:
                reply = self.client.push(
                    push.fragment,
                    push.base_version,
                    fragment_delta(push, theta_host),
                    push.c_steps,
                    push.c_tokens,
                    push.step,
                )
            except SyncerUnavailable as exc:
                self.stats["push_failures"] += 1
                with self._outbox_cv:
                    self._retry[push.fragment] = push
                    delay = self._backoff.setdefault(link, Backoff()).after(exc)
                    self._paused_until[link] = time.monotonic() + delay
                log.warning(
                    "event=push_retry fragment=%d delay=%.2f error=%s", push.fragment, delay, exc
                )
                continue
            except SyncerRejected as exc:
                self.stats["rejected"] += 1
                log.warning("event=push_rejected fragment=%d error=%s", push.fragment, exc)
                self.note_superseded(exc)
                continue
            with self._outbox_cv:
                self._backoff.pop(link, None)
                self._paused_until.pop(link, None)
                self._sent_theta[push.fragment] = (push.theta, theta_host)
            self.stats["pushes"] += 1
            self.last_quant_error = reply.quant_error
            log.debug(
                "event=pushed fragment=%d base=%d accepted=%s bytes=%d",
                push.fragment,
                push.base_version,
                reply.accepted,
                reply.bytes_sent,
            )

    def _poller(self, fragment: int) -> None:
        backoff = Backoff()
        while not self.stopping.is_set():
            try:
                got = self.client.poll(fragment, self._known[fragment], POLL_WAIT_SECONDS)
            except (SyncerUnavailable, SyncerRejected) as exc:
                delay = backoff.after(exc)
                log.warning(
                    "event=poll_retry fragment=%d delay=%.2f error=%s", fragment, delay, exc
                )
                self._wait(delay)
                continue
            backoff.reset()
            # Any version other than the one held is the syncer's word, an older one too: a
            # syncer restored from an older checkpoint refuses pushes from later bases
            # (future_base) until the learner takes the version it serves.
            if got is not None and got[0] != self._known[fragment]:
                self._known[fragment] = got[0]
                self._inbox.put(Arrival(fragment, got[0], got[1]))

    def note_superseded(self, exc: Exception) -> bool:
        """Whether `exc` says another process is the unit now; then the learner stops."""
        if not (isinstance(exc, SyncerRejected) and exc.reason == "superseded"):
            return False
        if not self.superseded.is_set():
            log.warning("event=superseded action=stop error=%s", exc)
        self.superseded.set()
        return True

    def _heartbeat(self) -> None:
        backoff = Backoff()
        delay = 0.0
        while not self._wait(delay):
            snap = self.progress
            loss = None if snap.loss is None else float(snap.loss)
            try:
                reply = self.client.heartbeat(snap.step, snap.tokens, snap.tokens_per_sec, loss)
            except (SyncerUnavailable, SyncerRejected) as exc:
                if self.note_superseded(exc):
                    return
                delay = backoff.after(exc)
                log.warning("event=heartbeat_retry delay=%.2f error=%s", delay, exc)
                continue
            backoff.reset()
            delay = self.heartbeat_seconds
            self.budget_done = reply.budget_done
            if reply.complete:
                log.info("event=run_complete outer_step=%d", reply.outer_step)
                self.complete.set()
                return


def retry_until(
    call: Callable[[], T], stop: threading.Event, what: str, cap: float = 5.0
) -> T | None:
    """Call until it succeeds (retrying SyncerUnavailable, and a shut-out unit's refusals, with
    backoff, as heartbeats and pushes are); None if `stop` is set."""
    backoff = Backoff(cap=cap)
    while not stop.is_set():
        try:
            return call()
        except (SyncerUnavailable, SyncerRejected) as exc:
            if isinstance(exc, SyncerRejected) and not exc.shut_out:
                raise
            delay = backoff.after(exc)
            log.warning("event=%s_retry delay=%.2f error=%s", what, delay, exc)
            stop.wait(delay)
    return None
