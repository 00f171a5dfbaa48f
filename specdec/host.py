"""What a service reads about the machine it runs on: host identity, memory, GPU identity.

Everything here comes from the kernel and the drivers. No flag or environment variable
can set it: a process that could claim another host's identity would defeat the
topology guard. Tests substitute a HostProbe subclass in the process they start.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from specdec.v1 import pairing_pb2

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
MEMINFO = Path("/proc/meminfo")
CPUINFO = Path("/proc/cpuinfo")
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


# The widest vector instructions a CPU has, widest first: forward costs on two threads move
# with them (the same pair measured c 0.118 on an AVX2-only EPYC, 0.092 on an AVX-512 one).
VECTOR_ISAS = (("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def cpu_model() -> str:
    """The CPU's model name as the kernel gives it, with its family and model numbers where
    it gives them and its widest vector instructions ("AMD EPYC (family 26, model 2),
    AVX-512 BF16"); "" where the kernel names none. A virtual machine may name two CPU
    generations alike ("AMD EPYC"): the committed target stepped in 3.0 ms on family 25 and
    1.4-1.7 ms on family 26, which moved the report's c from 0.100 to 0.121."""
    lines = (_read(CPUINFO) or "").splitlines()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)  # every CPU repeats the same fields
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    name = fields.get("model name", "")
    if name and "cpu family" in fields and "model" in fields:
        name = f"{name} (family {fields['cpu family']}, model {fields['model']})"
    isa = next((label for flag, label in VECTOR_ISAS if flag in fields.get("flags", "").split()), "")
    return f"{name}, {isa}" if name and isa else name


def machine_memory_bytes() -> int:
    """The lower of the machine's memory and this process's cgroup limit."""
    total = UNLIMITED
    for line in (_read(MEMINFO) or "").splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
    for path in CGROUP_LIMITS:
        text = _read(path)
        if text and text.isdigit() and int(text) < UNLIMITED:
            total = min(total, int(text))
    return total


def resident_bytes() -> int:
    """Resident set size of this process."""
    statm = _read(Path("/proc/self/statm"))
    return int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE") if statm else 0


class HostProbe:
    """Reads host facts. Subclassed only by tests, to play another machine."""

    def identity(self) -> pairing_pb2.HostIdentity:
        return pairing_pb2.HostIdentity(boot_id=_read(BOOT_ID) or "", hostname=socket.gethostname(), pid=os.getpid())

    def device(self, device: torch.device) -> pairing_pb2.DeviceFacts:
        facts = pairing_pb2.DeviceFacts(device=str(device))
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            uuid = str(props.uuid)
            facts.gpu_uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            facts.gpu_name = props.name
        return facts

    def memory(self, device: torch.device) -> tuple[str, int, int]:
        """(kind, capacity in bytes, bytes in use by this process) of the model's device."""
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            return "cuda", total, torch.cuda.memory_allocated(device)
        return "host", machine_memory_bytes(), resident_bytes()
