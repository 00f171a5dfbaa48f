"""Classifies the GPU link between the target's and the draft's devices through NVML.

Best first: one device (MPS clients of one GPU included), MIG slices of one GPU, NVLink
peers, PCIe only. NVML is asked through the handful of calls below, so that tests can
answer them from fixtures written from NVML's documented return values.
"""

from __future__ import annotations

from typing import Any, Protocol

from specdec.v1 import pairing_pb2

# NVML constants (nvml.h), as the nvidia-ml-py bindings define them.
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
TOPOLOGY_LEVELS = {
    0: "the same board",
    10: "a single PCIe switch",
    20: "several PCIe switches",
    30: "one PCIe host bridge",
    40: "one NUMA node's host bridges",
    50: "the inter-socket link (SMP)",
}


class Nvml(Protocol):
    """The NVML calls the classifier makes (names as in nvidia-ml-py's pynvml)."""

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any: ...
    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> int: ...
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetP2PStatus(self, a: Any, b: Any, index: int) -> int: ...
    def nvmlDeviceGetTopologyCommonAncestor(self, a: Any, b: Any) -> int: ...


def classify(nvml: Nvml, target_uuid: str, draft_uuid: str) -> tuple[pairing_pb2.GpuLink, str]:
    """The link between two GPUs named by their NVML UUIDs, and how it was found."""
    if target_uuid == draft_uuid:
        return pairing_pb2.GPU_LINK_SAME_DEVICE, f"both models on {target_uuid}"
    handles = [nvml.nvmlDeviceGetHandleByUUID(uuid) for uuid in (target_uuid, draft_uuid)]
    parents = [
        nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h) if nvml.nvmlDeviceIsMigDeviceHandle(h) else h
        for h in handles
    ]
    parent_uuids = [nvml.nvmlDeviceGetUUID(p) for p in parents]
    if parent_uuids[0] == parent_uuids[1]:
        return pairing_pb2.GPU_LINK_MIG_SLICE, f"MIG slices {target_uuid} and {draft_uuid} of {parent_uuids[0]}"
    if nvml.nvmlDeviceGetP2PStatus(parents[0], parents[1], NVML_P2P_CAPS_INDEX_NVLINK) == NVML_P2P_STATUS_OK:
        return pairing_pb2.GPU_LINK_NVLINK, f"{parent_uuids[0]} and {parent_uuids[1]} are NVLink peers"
    level = nvml.nvmlDeviceGetTopologyCommonAncestor(parents[0], parents[1])
    path = TOPOLOGY_LEVELS.get(level, f"topology level {level}")
    return pairing_pb2.GPU_LINK_PCIE, f"{parent_uuids[0]} and {parent_uuids[1]} have no NVLink; PCIe through {path}"


def classify_devices(target_uuid: str, draft_uuid: str) -> tuple[pairing_pb2.GpuLink, str]:
    """classify() against this machine's NVML; UNKNOWN, with the reason, when NVML is missing."""
    if not target_uuid or not draft_uuid:
        sides = [f"the {name} runs on the CPU" for name, uuid in (("target", target_uuid), ("draft", draft_uuid)) if not uuid]
        return pairing_pb2.GPU_LINK_NONE_CPU, f"{' and '.join(sides)}: no GPU link to check"
    try:
        import pynvml
    except ImportError:
        return pairing_pb2.GPU_LINK_UNKNOWN, "NVML bindings (nvidia-ml-py) are not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return pairing_pb2.GPU_LINK_UNKNOWN, f"NVML unavailable: {error}"
    try:
        return classify(pynvml, target_uuid, draft_uuid)
    except pynvml.NVMLError as error:
        return pairing_pb2.GPU_LINK_UNKNOWN, f"NVML could not classify the link: {error}"
    finally:
        pynvml.nvmlShutdown()
