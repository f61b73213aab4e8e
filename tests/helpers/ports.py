"""A port that nothing answers on, for the checks that a connection is refused."""
import contextlib
import socket


@contextlib.contextmanager
def closed_port():
    """A local port bound without listening, for the duration: connections to it are refused, and no other process
    (the suite runs two workers) can take it meanwhile, as it could a port found free and let go of."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    try:
        yield held.getsockname()[1]
    finally:
        held.close()
