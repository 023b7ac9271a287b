"""The server's sockets have Nagle's algorithm off: with it on, a reply's second write (a body
after its headers) waits for the client's delayed ACK, 40 ms on every reply with a body
of a kept-alive connection."""

from __future__ import annotations

import asyncio
import socket

from aserve.server.launch import bind


def accepted_has_nodelay(sock: socket.socket) -> bool:
    """Serve `sock` with asyncio (as uvicorn does with `sockets=[sock]`), connect to it and say
    whether the accepted connection has TCP_NODELAY."""
    async def main() -> bool:
        accepted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            result = await asyncio.wait_for(accepted, 10)
            writer.close()
            return result

    return asyncio.run(main())


def test_connections_accepted_on_the_bound_socket_have_nagle_off():
    assert accepted_has_nodelay(bind("127.0.0.1", 0))


def test_a_plain_socket_would_not_have_it():
    """What the test above guards against: asyncio leaves Nagle on where the listener's proto
    is not IPPROTO_TCP, as a plain socket(AF_INET, SOCK_STREAM)'s (0) is not."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    assert not accepted_has_nodelay(sock)
