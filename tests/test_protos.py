"""The committed stubs are exactly what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

from specdec import protogen


def test_committed_stubs_match_the_protos(tmp_path: Path):
    generated = {p.name: p.read_bytes() for p in protogen.generate(tmp_path)}
    committed_dir = protogen.REPO / "specdec" / "v1"
    committed = {p.name: p.read_bytes() for p in committed_dir.glob("*_pb2*.py*")}
    assert sorted(generated) == sorted(committed), "stub files added or missing: run python -m specdec.protogen"
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"stubs out of date ({stale}): run python -m specdec.protogen"


def test_every_proto_field_and_rpc_is_commented():
    """The .proto files are the contract: a comment line precedes every field and rpc."""
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "option"))
            if is_field or stripped.startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {stripped}"
