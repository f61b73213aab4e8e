"""How `make test`'s two pytest-xdist workers share the suite (`-n 2 --dist loadscope`, with the scopes of
`scope_of`): a worker runs every test of a scope, in collection order (tests/conftest.py hands the heaviest tier out
first). Tests that share something expensive stay on one worker, so it is set up once: the distributed tier's kept
ranks (helpers.worlds), the test run's Ray (the integration and GPU tiers' ray_session, and the Ray clusters the
launch script starts: `RAY_CLUSTER_FILES`), the e2e demo run (`DEMO_RUN_FILES`), a module's fixtures (its file);
every other test goes wherever a worker is free."""
import functools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
# Whole tiers that share a session resource: the kept ranks, the test run's Ray.
TIER_SCOPES = {"distributed": "distributed", "integration": "ray_session", "gpu": "ray_session"}
# The files whose tests read the e2e tier's demo run (tests/e2e/conftest.py's demo_run).
DEMO_RUN_FILES = ("e2e/test_train_cli.py", "e2e/test_observability.py")
# Files that start Ray clusters with `ray start`: it writes the machine's /tmp/ray/ray_current_cluster, which
# ray.address=auto reads, as the multi-node test's Cluster (tests/integration) does. One at a time: on that worker.
RAY_CLUSTER_FILES = ("e2e/test_launch_script.py",)
SHARED_SCOPES = ("module", "class", "package")
_SHARED_FIXTURE = re.compile(rf"scope=[\"'](?:{'|'.join(SHARED_SCOPES)})[\"']")


@functools.cache
def _defines_shared_fixture(path: Path) -> bool:
    return bool(_SHARED_FIXTURE.search(path.read_text()))


def scope_of(nodeid: str, rootpath: Path) -> str:
    """The scope of the test `nodeid` (relative to `rootpath`, as pytest writes it)."""
    path = (rootpath / nodeid.split("::")[0]).resolve()
    relative = path.relative_to(TESTS).as_posix()
    if relative.split("/")[0] in TIER_SCOPES:
        return TIER_SCOPES[relative.split("/")[0]]
    if relative in DEMO_RUN_FILES:
        return "demo_run"
    if relative in RAY_CLUSTER_FILES:
        return TIER_SCOPES["integration"]
    return relative if _defines_shared_fixture(path) else nodeid


def misplaced(item) -> str | None:
    """Why `scope_of` would split what `item` shares with other tests (a fixture set up once per worker would then
    be set up twice), or None."""
    scope = scope_of(item.nodeid, item.config.rootpath)
    fixtures = getattr(item, "fixturenames", ())
    if "demo_run" in fixtures and scope != "demo_run":
        return f"{item.nodeid} uses demo_run: add its file to DEMO_RUN_FILES in {Path(__file__).relative_to(TESTS.parent)}"
    if "ray_session" in fixtures and scope != "ray_session":
        return f"{item.nodeid} uses ray_session: move it to tests/integration, whose tests one worker runs"
    definitions = getattr(item, "_fixtureinfo", None)
    scopes = {d.scope for defs in (definitions.name2fixturedefs.values() if definitions else ()) for d in defs}
    if scope == item.nodeid and scopes & set(SHARED_SCOPES):
        return (f"{item.nodeid} uses a fixture of {'/'.join(sorted(scopes & set(SHARED_SCOPES)))} scope that its file "
                f"does not define: define it there (scope_of reads the file) or give the file a scope in "
                f"{Path(__file__).relative_to(TESTS.parent)}")
    return None
