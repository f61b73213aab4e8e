"""Worker classes for a real WorkerGroup in tests."""


def set_up_only_worker() -> type:
    """The base of a test's worker class: it takes part in WorkerGroup's set-up (rendezvous, init, mesh, close) and
    does nothing else; `self.rank` is its rank. Made in a function, as the test's subclass must be (inside a
    function of the test module), so that Ray ships both by value: the workers cannot import the tests' modules."""

    class SetUpOnly:
        def __init__(self, rank: int, world_size: int):
            self.rank = rank

        def rendezvous(self):
            return "127.0.0.1", 0

        def init(self, master_addr: str, master_port: int) -> None:
            pass

        def mesh(self) -> dict:
            return {}

        def close(self) -> None:
            pass

    return SetUpOnly
