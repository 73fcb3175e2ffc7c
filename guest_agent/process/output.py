"""Output of one stream of an exec, kept as absolute byte offsets for lossless replay."""

from __future__ import annotations

import collections


class OutputBuffer:
    """Bytes ``[start, end)`` of one stream, held as the chunks the pipe gave.

    Lossless mode (a client is or may come back attached): nothing at or after ``floor``
    is dropped, and the reader of the pipe stops while ``end - floor`` reaches the capacity,
    so the pipe fills and the writer blocks. Lossy mode (detached): the oldest bytes go
    once more than ``capacity`` are held; ``start`` then tells readers what they lost.
    """

    __slots__ = ("_chunks", "capacity", "end", "eof", "floor", "start")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # Made on the first append: most execs of a busy agent print nothing while they run.
        self._chunks: collections.deque[bytes] | None = None
        self.start = 0
        self.end = 0
        self.floor = 0  # lossless mode: the lowest offset a client may still ask for
        self.eof = False

    def has_room(self, lossless: bool) -> bool:
        """Whether the pipe may be read now."""
        return not lossless or self.end - self.floor < self.capacity

    def append(self, data: bytes, lossless: bool) -> None:
        """Add bytes read from the pipe, then forget what no one can need any more."""
        if self._chunks is None:
            self._chunks = collections.deque()
        self._chunks.append(data)
        self.end += len(data)
        self._trim(lossless)

    def acknowledge(self, offset: int, lossless: bool) -> None:
        """The client has consumed up to ``offset``; it will not ask for earlier bytes."""
        if offset > self.floor:
            self.floor = min(offset, self.end)
            self._trim(lossless)

    def _trim(self, lossless: bool) -> None:
        keep_from = self.floor if lossless else self.end
        # Drop whole chunks that no one needs while at least ``capacity`` bytes stay held,
        # so a late attach always gets the last ``capacity`` bytes.
        while self._chunks:
            first = len(self._chunks[0])
            if self.start + first > keep_from or self.held - first < self.capacity:
                break
            self._chunks.popleft()
            self.start += first

    def read(self, offset: int, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` from ``offset`` (clamped to ``start``); b"" when caught up."""
        offset = max(offset, self.start)
        position = self.start
        for chunk in self._chunks or ():
            chunk_end = position + len(chunk)
            if offset < chunk_end:
                skip = offset - position
                return chunk[skip : skip + max_bytes]
            position = chunk_end
        return b""

    @property
    def held(self) -> int:
        """Bytes in memory."""
        return self.end - self.start
