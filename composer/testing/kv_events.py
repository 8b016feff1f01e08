"""vLLM's KV event stream as a router receives it, for tests: a ZMQ SUB socket on a thread,
decoded with vLLM's own ``KVEventBatch``.

vLLM's publisher (``--kv-events-config``) binds only a wildcard or ``ipc://``
endpoint and connects to any other: the subscriber binds loopback and the
engine (``EngineSpec.kv_events_endpoint``) connects to it, so nothing listens
beyond loopback and no event is published before the subscriber is there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from composer.servers import LOOPBACK, free_port


class Subscriber:
    """Every batch an engine publishes while it runs (``batches``), in order."""

    def __init__(self, endpoint: str | None = None) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.endpoint = endpoint or f"tcp://{LOOPBACK}:{free_port(LOOPBACK)}"
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: list[Any] = []
        self._again = zmq.Again
        self.socket: Any = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVTIMEO, 200)
        self.socket.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self.socket.recv_multipart()
            except self._again:
                continue
            self.batches.append(self.decoder.decode(payload))

    def events(self) -> list[Any]:
        """Every event received, in order."""
        return [event for batch in self.batches for event in batch.events]

    def wait_for(self, done: Callable[[list[Any]], bool], timeout_s: float = 30.0) -> list[Any]:
        """Every event received, once ``done`` holds for them or ``timeout_s`` passed:
        the publisher sends from its own thread, so an event of a step that ended
        can still be on its way when the request's answer is back."""
        deadline = time.monotonic() + timeout_s
        while not done(events := self.events()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return events

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.socket.close(linger=0)
