from helpers.worlds import close_worlds


def pytest_runtest_teardown(item, nextitem):
    """The ranks this tier's tests share live until its last test, not into the tiers after it. (A package-scoped
    fixture would not do: without an __init__.py this folder is no package, and the fixture would live as long as the
    session.)"""
    if nextitem is None or nextitem.path.parent != item.path.parent:
        close_worlds()
