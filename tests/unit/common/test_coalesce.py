"""``Coalesced``: the first write of a loop turn goes out at once, the rest of that turn
together at the next, in order; a connection that closed meanwhile gets nothing more.
Over a real socket pair (what the peer receives is what a server would), the writes
that reach the transport counted on the way."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from services.common.coalesce import Coalesced


class Recorder(asyncio.Protocol):
    def __init__(self) -> None:
        self.reads: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.reads.append(data)


class Counted:
    """The real transport, its writes recorded."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.transport.write(data)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.transport.close()


@pytest.fixture
async def wired() -> AsyncIterator[tuple[Coalesced, Counted, Recorder]]:
    """A ``Coalesced`` on one end of a socket pair, what reaches the other end recorded."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    writer, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
    peer = Recorder()
    reader, _ = await loop.create_connection(lambda: peer, sock=theirs)
    counted = Counted(writer)
    try:
        yield Coalesced(counted, loop), counted, peer
    finally:
        writer.close()
        reader.close()


async def settle(peer: Recorder, total: int) -> None:
    for _ in range(200):
        if sum(map(len, peer.reads)) >= total:
            return
        await asyncio.sleep(0.005)


async def test_one_turns_writes_after_the_first_go_out_together_next_turn(wired) -> None:
    out, writer, peer = wired
    out.write(b"a")  # at once
    out.write(b"b")
    out.write(b"c")
    assert writer.writes == [b"a"]
    await settle(peer, 3)
    assert writer.writes == [b"a", b"bc"]
    out.write(b"d")  # a new turn: at once again
    assert writer.writes == [b"a", b"bc", b"d"]
    await settle(peer, 4)
    assert b"".join(peer.reads) == b"abcd"


async def test_a_lone_write_is_not_held(wired) -> None:
    out, writer, peer = wired
    out.write(b"only")
    assert writer.writes == [b"only"]  # by the call itself
    await settle(peer, 4)
    assert writer.writes == [b"only"] and b"".join(peer.reads) == b"only"


async def test_held_writes_are_dropped_once_the_connection_closes(wired) -> None:
    out, writer, peer = wired
    out.write(b"first")
    out.write(b"held")
    writer.close()
    await asyncio.sleep(0.05)  # the flush ran on a closing transport: nothing raised
    assert writer.writes == [b"first"]
    assert b"".join(peer.reads) == b"first"
