"""Which CPU cores each tensor-parallel rank computes on (`--tp N`): disjoint sets, so that no two ranks' ggml thread
pools share a core (a pool that shares its cores collapses: DESIGN.md). Whole NUMA nodes per rank where there are
at least as many nodes as ranks, else an even share of the cores, node by node; one hardware thread per physical
core, unless that leaves fewer cores than ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True, order=True)
class CPU:
    node: int  # NUMA node
    core: int  # physical core id within the package (hardware threads of a core share it)
    package: int
    cpu: int  # the logical CPU number the OS schedules on


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def _node_of(cpu: int) -> int:
    for entry in (SYS_CPU / f"cpu{cpu}").glob("node*"):
        if entry.name[4:].isdigit():
            return int(entry.name[4:])
    return 0


def host_cpus(allowed: set[int] | None = None) -> list[CPU]:
    """The CPUs this process may run on, with their NUMA node and physical core (from sysfs; one node and one core
    per CPU where it is not readable)."""
    allowed = allowed if allowed is not None else set(os.sched_getaffinity(0))
    cpus = []
    for cpu in sorted(allowed):
        topology = SYS_CPU / f"cpu{cpu}" / "topology"
        cpus.append(
            CPU(
                node=_node_of(cpu),
                core=_read_int(topology / "core_id", cpu),
                package=_read_int(topology / "physical_package_id", 0),
                cpu=cpu,
            )
        )
    return cpus


def rank_cores(cpus: list[CPU], size: int) -> list[list[int]]:
    """Disjoint CPU sets for `size` ranks: whole NUMA nodes when there are at least as many nodes as ranks, else an
    even share of the physical cores in node order. With fewer CPUs than ranks, ranks share them round-robin."""
    if not cpus:
        raise ValueError("no CPUs to share between the ranks")
    physical: dict[tuple[int, int, int], CPU] = {}
    for c in sorted(cpus):
        physical.setdefault((c.node, c.package, c.core), c)  # the first hardware thread of each core
    pool = sorted(physical.values()) if len(physical) >= size else sorted(cpus)
    if len(pool) < size:
        return [[pool[r % len(pool)].cpu] for r in range(size)]
    nodes = sorted({c.node for c in pool})
    if len(nodes) >= size:
        share = [nodes[r * len(nodes) // size : (r + 1) * len(nodes) // size] for r in range(size)]
        return [[c.cpu for c in pool if c.node in mine] for mine in share]
    return [[c.cpu for c in pool[r * len(pool) // size : (r + 1) * len(pool) // size]] for r in range(size)]


def pin_process(cpus: list[int]) -> set[int]:
    """Pin this process to `cpus`: every thread it has now (each OS thread's mask) and every thread started later
    (they inherit it). Returns the CPU set it had before."""
    before = set(os.sched_getaffinity(0))
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass
    os.sched_setaffinity(0, cpus)
    return before
