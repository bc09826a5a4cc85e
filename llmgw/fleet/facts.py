"""Parsers for what an agent learns about its node: nvidia-smi's GPU list and power draw, and
/proc/meminfo."""

from __future__ import annotations

from llmgw.fleet.types import GpuInfo

__all__ = ["NVIDIA_SMI_POWER", "NVIDIA_SMI_QUERY", "parse_meminfo_mb", "parse_nvidia_smi", "parse_power_draw"]

NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
NVIDIA_SMI_POWER = ["nvidia-smi", "--query-gpu=power.draw", "--format=csv,noheader,nounits"]
MAX_GPUS = 64  # lines read of nvidia-smi's power answer


def parse_power_draw(text: str) -> float | None:
    """The sum of the GPUs' power.draw in watts (`412.35` a line; `[N/A]` or `[Not Supported]` for
    a GPU that cannot say is skipped); None when no line gives a figure. Only its form is checked:
    whether the figure is plausible is the router's to judge (llmgw.fleet.power)."""
    total, seen = 0.0, False
    for line in text.splitlines()[:MAX_GPUS]:
        try:
            w = float(line.strip())
        except ValueError:
            continue
        if w == w and 0 <= w < float("inf"):  # not NaN, not negative
            total += w
            seen = True
    return round(total, 1) if seen else None


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
