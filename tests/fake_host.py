"""Runs a draft or verify service that plays another machine, or a fuller one: the test
suite's stand-in for hardware it does not have. Production code has no such switch: the
services read host facts from the kernel only (specdec.host).

    python tests/fake_host.py {draft,verify} [--boot-id ID] [--hostname NAME]
        [--memory-total-bytes N] -- <the service's own flags>
"""

from __future__ import annotations

import argparse
import sys

import torch

from specdec.flags import parse_config
from specdec.host import HostProbe
from specdec.v1 import pairing_pb2


class FakeHost(HostProbe):
    def __init__(self, boot_id: str, hostname: str, memory_total_bytes: int) -> None:
        self._boot_id = boot_id
        self._hostname = hostname
        self._memory_total_bytes = memory_total_bytes

    def identity(self) -> pairing_pb2.HostIdentity:
        real = super().identity()
        return pairing_pb2.HostIdentity(
            boot_id=self._boot_id or real.boot_id, hostname=self._hostname or real.hostname, pid=real.pid
        )

    def memory(self, device: torch.device) -> tuple[str, int, int]:
        kind, total, used = super().memory(device)
        return kind, self._memory_total_bytes or total, used


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("service", choices=["draft", "verify"])
    parser.add_argument("--boot-id", default="")
    parser.add_argument("--hostname", default="")
    parser.add_argument("--memory-total-bytes", type=int, default=0)
    args, rest = parser.parse_known_args()
    probe = FakeHost(args.boot_id, args.hostname, args.memory_total_bytes)
    if args.service == "draft":
        from draft_service.server import DraftConfig, serve

        return serve(parse_config(DraftConfig, rest, "fake draft", "", "SPECDEC_DRAFT"), probe)
    from verify_service.server import VerifyConfig, serve

    return serve(parse_config(VerifyConfig, rest, "fake verify", "", "SPECDEC_VERIFY"), probe)


if __name__ == "__main__":
    sys.exit(main())
