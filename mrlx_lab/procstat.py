"""What Linux's /proc says about a process: its memory, open files and CPU time (for the
benchmarks, the demos' summaries and the fault tests). Each raises OSError once the process is gone."""

from __future__ import annotations

import os


def memory_mib(pid: int | str = "self") -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MiB."""
    rss = peak = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return rss, peak


def open_fds(pid: int | str = "self") -> int:
    """How many file descriptors the process has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds the process (all its threads) has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
