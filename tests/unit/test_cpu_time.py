"""helpers.cpu_time reads a control group's CPU time from cgroup v1's cpuacct or cgroup v2's cpu.stat."""
from helpers.cpu_time import cpu_seconds


def test_a_v1_group_counts_nanoseconds(tmp_path):
    (tmp_path / "cpuacct.usage").write_text("2500000000\n")
    assert cpu_seconds(tmp_path) == 2.5


def test_a_v2_group_counts_its_usage_in_microseconds(tmp_path):
    (tmp_path / "cpu.stat").write_text("usage_usec 1750000\nuser_usec 1500000\nsystem_usec 250000\n")
    assert cpu_seconds(tmp_path) == 1.75
