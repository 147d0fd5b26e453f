"""TLS on the syncer's port and its learners' side, with files that rotate under a live process.

- The syncer (`ServerTls`, `--tls-cert/--tls-key`) serves HTTPS with a certificate and key read
  from files that cert-manager or a Secret update replaces while it runs. At a new connection's
  handshake, at most every `check_seconds`, it looks at the files (a `stat`: cheap); when they
  changed it builds a new context from them and hands it to that and every later handshake
  (`sni_callback` switching the connection's context, which is what it exists for). A pair
  that does not load (a key of another certificate, a half-written file) is logged once as a
  WARNING and the old context keeps serving; connections already open keep theirs.
  Why a new context rather than `load_cert_chain` again on the live one: that call sets the
  certificate before it checks the key, and OpenSSL drops a certificate whose key does not
  match, so one bad pair would leave the listener with no certificate at all.
- A learner (`ClientTrust`, `--ca-file`) verifies the syncer against a CA bundle (the system
  trust store without one), host name included, and reads the bundle again when it changed at
  each new connection, so a bundle rotated to old + new CA is taken without a restart.

See docs/protocol.md, "TLS".
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("diloco.tls")
T = TypeVar("T")
CHECK_SECONDS = 2.0

Signature = tuple[tuple[int, int, int, int, int] | None, ...]


def signature(*paths: str) -> Signature:
    """What changes when any of the files is replaced or rewritten (None: the file is gone)."""
    out: list[tuple[int, int, int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)  # follows the symlinks a Secret volume swaps
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def _no_password() -> str:
    raise ValueError("the key is encrypted; give it unencrypted (a mounted Secret)")


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS server context with this certificate chain and key; ValueError naming the files."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # Never a prompt on the terminal for an encrypted key: an error instead.
        ctx.load_cert_chain(cert, key, password=_no_password)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise ValueError(f"TLS certificate {cert} with key {key}: {_reason(exc)}") from None
    return ctx


def client_context(ca_file: str | None) -> ssl.SSLContext:
    """A context that verifies the server's chain (against `ca_file`, or the system trust store
    when None) and its name; ValueError naming the file."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"CA file {ca_file}: {_reason(exc)}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx  # check_hostname and CERT_REQUIRED are create_default_context's


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


class Reloading(Generic[T]):
    """A value built from files, built again when they change; when that fails the old value
    stays and the failure is logged once per state of the files."""

    def __init__(self, paths: tuple[str, ...], build: Callable[[], T], what: str) -> None:
        self.paths, self.build, self.what = paths, build, what
        self.seen = signature(*paths)
        self.value = build()  # the first build's error is the caller's (a config error)

    def refresh(self) -> bool:
        """Build again if the files changed: True when a new value was taken."""
        before = signature(*self.paths)
        if before == self.seen:
            return False
        try:
            value, error = self.build(), None
        except ValueError as exc:
            value, error = None, exc
        if signature(*self.paths) != before:
            return False  # written to as we read (a pair mid-rotation): look again next time
        self.seen = before
        if value is None:
            log.warning(
                "event=tls_reload_failed what=%s files=%s action=keep_previous error=%r",
                self.what,
                ",".join(self.paths),
                str(error),
            )
            return False
        self.value = value
        log.info("event=tls_reloaded what=%s files=%s", self.what, ",".join(self.paths))
        return True


class ServerTls:
    """The syncer's TLS: `context` is what the listener is created with; each handshake gets
    the newest good certificate."""

    def __init__(
        self,
        cert: str,
        key: str,
        check_seconds: float = CHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cert, self.key = cert, key
        self.check_seconds, self.clock = check_seconds, clock
        self.pair = Reloading((cert, key), lambda: server_context(cert, key), "certificate")
        self.context = self.pair.value
        self.context.sni_callback = self._hello
        self._next_check = clock() + check_seconds

    def refresh(self) -> bool:
        self._next_check = self.clock() + self.check_seconds
        return self.pair.refresh()

    def _hello(self, conn: ssl.SSLObject | ssl.SSLSocket, name: str | None, ctx: object) -> None:
        # Runs in the handshake, on the event loop: a stat of two files at most every
        # check_seconds, a build only after they changed. Nothing may escape: an exception
        # here would fail the client's handshake.
        try:
            if self.clock() >= self._next_check:
                self.refresh()
            if self.pair.value is not ctx:
                conn.context = self.pair.value
        except Exception:
            log.exception("event=tls_hello_failed")


class ClientTrust:
    """A learner's view of whom to trust: the CA bundle in `ca_file` (None: the system trust
    store), read again whenever a new connection finds the file changed. Thread-safe."""

    def __init__(self, ca_file: str | None = None) -> None:
        self.ca_file = ca_file
        self._lock = threading.Lock()
        self._ca: Reloading[ssl.SSLContext] | None = None
        self._system: ssl.SSLContext | None = None
        if ca_file is None:
            self._system = client_context(None)
        else:
            self._ca = Reloading((ca_file,), lambda: client_context(ca_file), "ca_bundle")

    def context(self) -> ssl.SSLContext:
        if self._ca is None:
            assert self._system is not None
            return self._system
        with self._lock:
            self._ca.refresh()
            return self._ca.value

    def describe(self) -> str:
        return f"the CA file {self.ca_file}" if self.ca_file else "the system trust store"
