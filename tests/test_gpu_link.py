"""NVML link classification against fixtures written from NVML's documented answers
(nvml.h: nvmlDeviceGetP2PStatus returns NVML_P2P_STATUS_OK = 0 for a supported link and
e.g. NVML_P2P_STATUS_NOT_SUPPORTED = 5 otherwise; nvmlDeviceGetTopologyCommonAncestor
returns NVML_TOPOLOGY_* levels 0..50; MIG device handles map to their parent GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from specdec import gpu_link, pairing
from specdec.v1 import pairing_pb2

NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_SYSTEM = 50


@dataclass
class FixtureNvml:
    """Answers NVML calls from a table: GPUs, their MIG slices, NVLink pairs, PCIe levels."""

    gpus: list[str]
    mig_parent: dict[str, str] = field(default_factory=dict)  # MIG uuid -> parent GPU uuid
    nvlink: set[frozenset[str]] = field(default_factory=set)
    topology: int = NVML_TOPOLOGY_HOSTBRIDGE
    calls: list[str] = field(default_factory=list)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append("GetHandleByUUID")
        if uuid not in self.gpus and uuid not in self.mig_parent:
            raise LookupError(uuid)
        return ("handle", uuid)

    def nvmlDeviceIsMigDeviceHandle(self, handle):
        return 1 if handle[1] in self.mig_parent else 0

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle):
        return ("handle", self.mig_parent[handle[1]])

    def nvmlDeviceGetUUID(self, handle):
        return handle[1]

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index == gpu_link.NVML_P2P_CAPS_INDEX_NVLINK
        linked = frozenset([a[1], b[1]]) in self.nvlink
        return gpu_link.NVML_P2P_STATUS_OK if linked else NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.topology


GPU0, GPU1 = "GPU-0a1b2c3d-0000-0000-0000-000000000000", "GPU-9f8e7d6c-1111-1111-1111-111111111111"
MIG0, MIG1 = "MIG-aaaa0000-0000-0000-0000-000000000000", "MIG-bbbb1111-1111-1111-1111-111111111111"


def test_same_gpu_is_same_device():
    nvml = FixtureNvml([GPU0])
    assert gpu_link.classify(nvml, GPU0, GPU0)[0] == pairing_pb2.GPU_LINK_SAME_DEVICE


def test_mig_slices_of_one_gpu():
    nvml = FixtureNvml([GPU0], mig_parent={MIG0: GPU0, MIG1: GPU0})
    link, detail = gpu_link.classify(nvml, MIG0, MIG1)
    assert link == pairing_pb2.GPU_LINK_MIG_SLICE
    assert GPU0 in detail


def test_mig_slices_of_two_gpus_are_not_one_gpu():
    nvml = FixtureNvml([GPU0, GPU1], mig_parent={MIG0: GPU0, MIG1: GPU1}, nvlink={frozenset([GPU0, GPU1])})
    assert gpu_link.classify(nvml, MIG0, MIG1)[0] == pairing_pb2.GPU_LINK_NVLINK


def test_nvlink_peers():
    nvml = FixtureNvml([GPU0, GPU1], nvlink={frozenset([GPU0, GPU1])})
    assert gpu_link.classify(nvml, GPU0, GPU1)[0] == pairing_pb2.GPU_LINK_NVLINK


def test_pcie_only_names_the_path():
    nvml = FixtureNvml([GPU0, GPU1], topology=NVML_TOPOLOGY_SYSTEM)
    link, detail = gpu_link.classify(nvml, GPU0, GPU1)
    assert link == pairing_pb2.GPU_LINK_PCIE
    assert "inter-socket" in detail


def test_cpu_has_no_link():
    link, detail = gpu_link.classify_devices("", "")
    assert link == pairing_pb2.GPU_LINK_NONE_CPU
    assert "CPU" in detail


def test_missing_nvml_is_unknown_not_a_crash():
    # This machine has no NVIDIA driver: NVML cannot load its library.
    link, detail = gpu_link.classify_devices(GPU0, GPU1)
    assert link == pairing_pb2.GPU_LINK_UNKNOWN
    assert detail


@pytest.mark.parametrize("require_nvlink", [False, True])
def test_require_nvlink_refuses_a_pcie_pair(require_nvlink, facts):
    target, draft = facts(gpu=GPU0), facts(gpu=GPU1)
    nvml = FixtureNvml([GPU0, GPU1])
    record = pairing.decide(
        pairing_pb2.TRANSPORT_UNIX_SOCKET, target, draft,
        pairing.PairingPolicy(require_nvlink=require_nvlink),
        classify_link=lambda a, b: gpu_link.classify(nvml, a, b),
    )  # fmt: skip
    assert record.link == pairing_pb2.GPU_LINK_PCIE
    if require_nvlink:
        assert record.state == pairing_pb2.PAIRING_STATE_REFUSED
        assert "--require-nvlink" in record.detail
    else:
        assert record.state == pairing_pb2.PAIRING_STATE_PAIRED
        assert any("PCIe" in w for w in record.warnings)


def test_nvlink_pair_passes_require_nvlink(facts):
    nvml = FixtureNvml([GPU0, GPU1], nvlink={frozenset([GPU0, GPU1])})
    record = pairing.decide(
        pairing_pb2.TRANSPORT_UNIX_SOCKET, facts(gpu=GPU0), facts(gpu=GPU1),
        pairing.PairingPolicy(require_nvlink=True),
        classify_link=lambda a, b: gpu_link.classify(nvml, a, b),
    )  # fmt: skip
    assert record.state == pairing_pb2.PAIRING_STATE_PAIRED
    assert not record.warnings
