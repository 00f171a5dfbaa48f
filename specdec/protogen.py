"""Regenerates the committed Python stubs from proto/ (run: python -m specdec.protogen).

The stubs live in specdec/v1/ so that generated imports (`from specdec.v1 import
common_pb2`) resolve inside the installed package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("specdec/v1/*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_root/specdec/v1/."""
    (out_root / "specdec" / "v1").mkdir(parents=True, exist_ok=True)
    # protoc's own well-known types (descriptor.proto etc.) ship inside grpc_tools.
    well_known = Path(protoc.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    rc = protoc.main(
        [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            *files,
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return sorted((out_root / "specdec" / "v1").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO, help="root to write specdec/v1/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
