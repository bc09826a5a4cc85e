"""Parsers for what an agent learns about its node: nvidia-smi's GPU list and /proc/meminfo."""

from __future__ import annotations

from llmgw.fleet.types import GpuInfo

__all__ = ["NVIDIA_SMI_QUERY", "parse_meminfo_mb", "parse_nvidia_smi"]

NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]


def parse_nvidia_smi(text: str) -> tuple[GpuInfo, ...]:
    """Lines like `0, NVIDIA H100 80GB HBM3, 81559` (memory in MiB); lines that do not parse are
    skipped (nvidia-smi prints `[N/A]` or errors for GPUs that fell off the bus)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        index, mem = parts[0], parts[-1]
        name = ",".join(parts[1:-1]).strip()
        if index.isdigit() and mem.isdigit():
            out.append(GpuInfo(int(index), name, int(mem)))
    return tuple(out)


def parse_meminfo_mb(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) // 1024  # kB
    return 0
