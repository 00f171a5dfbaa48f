"""The pairing handshake between real services: topology, same-origin and memory guards,
their overrides, what Info and every stream say about them, and what `specdec doctor`
makes of them and of the traffic."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from specdec import defaults
from specdec.client import Completion
from specdec.defaults import NUM_DRAFT_TOKENS
from specdec.doctor import ACCEPTANCE_FLOOR, ALPHA_FLOOR, load
from specdec.launcher import Stack, free_port
from specdec.speculation_gain import alpha_for_acceptance_rate, expected_acceptance_rate
from specdec.toy_models import foreign_tokenizer_copy
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, pairing_pb2, verify_pb2
from tests.helpers import request, run, verify_info
from verify_service.load_bands import BANDS

PROMPT = "def speculative_decode(prompt, draft, target, k=4):"
REFUSED = common_pb2.TARGET_ONLY_REASON_DRAFT_REFUSED
FAKE = [sys.executable, "tests/fake_host.py"]
ELSEWHERE = ["--boot-id", "0123456789abcdef-another-kernel", "--hostname", "gpu-node-7"]


def draft_stub(stack: Stack) -> draft_pb2_grpc.DraftStub:
    return draft_pb2_grpc.DraftStub(grpc.insecure_channel(stack.config.draft_address))


def doctor(*args: str) -> tuple[int, dict]:
    done = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "doctor", "--json", *args], capture_output=True, text=True, timeout=120
    )
    return done.returncode, json.loads(done.stdout)


def assert_refused_streams(stack: Stack, *needles: str) -> None:
    """Requests still complete, target-only, exactly as without speculation, and every
    message says the draft was refused and why."""
    spec = run(stack, request(PROMPT, max_new_tokens=24))
    alone = run(stack, request(PROMPT, max_new_tokens=24, speculation=False))
    assert spec.token_ids == alone.token_ids
    for message in spec.messages:
        assert not message.speculation.speculating
        assert message.speculation.reason == REFUSED
        assert all(n in message.speculation.detail for n in needles), message.speculation.detail
        assert message.round.draft_tokens == 0


def assert_acceptance_figure(check: dict, completions: list[Completion]) -> float:
    """Doctor's acceptance figure is these completions' α̂ and acceptance rate; returns α̂."""
    proposed = sum(c.usage.draft_tokens_proposed for c in completions)
    accepted = sum(c.usage.draft_tokens_accepted for c in completions)
    rejections = sum(c.usage.rejections for c in completions)
    alpha = accepted / (accepted + rejections)
    assert check["figure"].startswith(
        f"α̂ {alpha:.3f} (acceptance {accepted / proposed:.3f} at the k clients used: "
        f"{accepted}/{proposed} draft tokens, {rejections} rejections"
    ), check["figure"]
    assert f"{ALPHA_FLOOR:.2f} = the guide's 0.4 acceptance at k = {NUM_DRAFT_TOKENS}" in check["detail"]
    return alpha


def test_unix_socket_draft_pairs(toy, shared_stack):
    stack = shared_stack
    pairing = verify_info(stack).pairing
    assert pairing.state == pairing_pb2.PAIRING_STATE_PAIRED
    assert pairing.transport == pairing_pb2.TRANSPORT_UNIX_SOCKET
    assert pairing.same_host and pairing.tokenizer_match
    assert pairing.link == pairing_pb2.GPU_LINK_NONE_CPU and "CPU" in pairing.link_detail
    assert pairing.target_memory.kind == "host"
    assert 0 < pairing.target_memory_share < 0.7
    assert pairing.target_memory.kv_budget_bytes > 0 and pairing.target_memory.weights_bytes > 0
    assert pairing.draft.model.name == str(toy.close)
    assert not pairing.overrides and not pairing.status
    assert all(m.speculation.speculating for m in run(stack, request(PROMPT, max_new_tokens=16)).messages)

    # specdec doctor over the last two requests, through the gateway and directly.
    last = [run(stack, request(PROMPT, max_new_tokens=n)) for n in (40, 60)]
    code, report = doctor("--gateway", stack.config.gateway_address, "--requests", "2")
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == [
        "output length", "target memory", "same-origin draft", "same card or host", "acceptance rate", "load"
    ]  # fmt: skip
    assert checks["load"]["verdict"] == "warn" and checks["load"]["figure"] == "no AUTO rounds in the window"
    assert checks["output length"]["verdict"] == "warn"
    mean = sum(len(c.token_ids) for c in last) / 2
    assert checks["output length"]["figure"].startswith(f"{mean:.0f} tokens on average over the last 2 requests")
    assert checks["target memory"]["verdict"] == "pass"
    # A draft that misses a deadline is paired again, with fresh memory figures: compare loosely.
    assert float(checks["target memory"]["figure"].split("%")[0]) / 100 == pytest.approx(pairing.target_memory_share, abs=0.05)
    assert checks["same-origin draft"]["verdict"] == "pass"
    assert checks["same card or host"]["verdict"] == "pass" and "CPU" in checks["same card or host"]["figure"]
    alpha = assert_acceptance_figure(checks["acceptance rate"], last)
    assert checks["acceptance rate"]["verdict"] == ("pass" if alpha >= ALPHA_FLOOR else "fail")
    assert code == (0 if alpha >= ALPHA_FLOOR else 1) and report["ok"] == (code == 0)
    assert doctor("--verify", stack.config.verify_address, "--requests", "2") == (code, report)


def test_doctors_load_check_judges_holds_and_acceptance_by_band():
    def recent(*bands: tuple[int, int, int, int, int]) -> verify_pb2.RecentRequests:
        rows = [
            verify_pb2.LoadBand(
                min_sessions=low, max_sessions=high, auto_rounds=auto, held_by_load=held,
                draft_tokens_proposed=proposed, draft_tokens_accepted=int(proposed * alpha / 100),
                rejections=1, alpha_hat=alpha / 100,
            )
            for (low, high), (auto, held, proposed, alpha) in zip(BANDS, bands)
        ]  # fmt: skip
        return verify_pb2.RecentRequests(load_bands=rows)

    fine = load(recent((100, 0, 400, 80), (300, 30, 900, 78), (0, 0, 0, 0), (0, 0, 0, 0)))
    assert fine.verdict == "pass"
    assert fine.figure == (
        "8% of 400 AUTO rounds held at k = 0 by load (sessions per step 1: 0/100 held, α̂ 0.80, 2-4: 30/300 held, α̂ 0.78)"
    )
    assert load(recent((10, 0, 40, 80), (300, 200, 900, 78), (0, 0, 0, 0), (0, 0, 0, 0))).verdict == "warn"
    dropping = load(recent((100, 0, 400, 80), (300, 30, 900, 60), (0, 0, 0, 0), (0, 0, 0, 0)))
    assert dropping.verdict == "warn" and "α̂ falls" in dropping.detail
    # A band too thin to compare does not warn.
    assert load(recent((100, 0, 400, 80), (300, 30, 100, 60), (0, 0, 0, 0), (0, 0, 0, 0))).verdict == "pass"
    assert load(recent((0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0))).verdict == "warn"


def test_doctors_floor_is_the_guides_acceptance_rate_at_the_default_k():
    k = NUM_DRAFT_TOKENS
    assert sum(ALPHA_FLOOR**i for i in range(1, k + 1)) / k == pytest.approx(ACCEPTANCE_FLOOR, abs=1e-6)
    assert expected_acceptance_rate(ALPHA_FLOOR, k) == pytest.approx(ACCEPTANCE_FLOOR, abs=1e-6)
    # docs/design.md's example: an acceptance rate of 0.6 at k = 4 is α̂ ≈ 0.8.
    assert alpha_for_acceptance_rate(0.6, 4) == pytest.approx(0.8, abs=0.01)
    # The same α̂ shows a lower acceptance rate to clients who ask for more draft tokens.
    assert expected_acceptance_rate(ALPHA_FLOOR, 8) < ACCEPTANCE_FLOOR < expected_acceptance_rate(ALPHA_FLOOR, 1)


def speculate(stack: Stack, prompts: list[str], k: int, max_new_tokens: int) -> list[Completion]:
    return [run(stack, request(p, max_new_tokens=max_new_tokens, k=k), timeout=120) for p in prompts]


def test_doctor_passes_the_embedded_pair_at_k_8(default_pair_stack):
    """At k = 8 the embedded pair's acceptance rate sits near 0.4 (it falls with k); its
    α̂, which does not, clears the floor."""
    prompts = defaults.heldout_prompts()[:4]
    done = speculate(default_pair_stack, prompts, k=8, max_new_tokens=96)
    _, report = doctor("--verify", default_pair_stack.config.verify_address, "--requests", str(len(prompts)))
    check = next(c for c in report["checks"] if c["name"] == "acceptance rate")
    alpha = assert_acceptance_figure(check, done)
    assert check["verdict"] == "pass" and alpha >= ALPHA_FLOOR


def test_doctor_fails_a_same_tokenizer_draft_with_unrelated_weights(far_stack):
    prompts = [PROMPT, "The quick brown fox", "Speculative decoding keeps"]
    done = speculate(far_stack, prompts, k=NUM_DRAFT_TOKENS, max_new_tokens=32)
    code, report = doctor("--verify", far_stack.config.verify_address, "--requests", str(len(prompts)))
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["same-origin draft"]["verdict"] == "pass"  # only the acceptance check can tell
    alpha = assert_acceptance_figure(checks["acceptance rate"], done)
    assert checks["acceptance rate"]["verdict"] == "fail" and alpha < ALPHA_FLOOR
    assert code == 1 and not report["ok"]


def test_tcp_draft_on_this_host_pairs(toy, stack_factory):
    stack = stack_factory(toy.target, toy.close, draft_tcp=f"127.0.0.1:{free_port()}")
    pairing = verify_info(stack).pairing
    assert pairing.state == pairing_pb2.PAIRING_STATE_PAIRED
    assert pairing.transport == pairing_pb2.TRANSPORT_TCP
    assert pairing.same_host
    assert pairing.draft.host.boot_id == open("/proc/sys/kernel/random/boot_id").read().strip()


def test_draft_on_another_machine_is_refused(toy, stack_factory):
    stack = stack_factory(
        toy.target, toy.close, draft_tcp=f"127.0.0.1:{free_port()}", programs={"draft": [*FAKE, "draft", *ELSEWHERE]}
    )
    pairing = verify_info(stack).pairing
    assert pairing.state == pairing_pb2.PAIRING_STATE_REFUSED
    assert pairing.status == "FAILED_PRECONDITION"
    # Both hosts are named: the draft's claimed one and this one.
    assert "gpu-node-7" in pairing.detail
    assert pairing.verifier_host.split()[0] in pairing.detail
    assert_refused_streams(stack, "another machine")

    # The draft's own check, through the real handshake, from this (another) host.
    stub = draft_stub(stack)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Pair(pairing_pb2.PairRequest(verifier=pairing_pb2.PeerFacts(host=pairing_pb2.HostIdentity(
            boot_id=open("/proc/sys/kernel/random/boot_id").read().strip(), hostname="here"))), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "gpu-node-7" in refused.value.details() and "here" in refused.value.details()
    # No session ever reached it, and it takes none without a pairing.
    with pytest.raises(grpc.RpcError) as unpaired:
        stub.OpenSession(draft_pb2.OpenSessionRequest(session_id="x", prompt_ids=[1, 2]), timeout=10)
    assert unpaired.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=10)
    assert info.proposals == 0 and info.forwards == 0


def test_draft_with_another_tokenizer_is_refused_unless_overridden(toy, stack_factory, tmp_path):
    foreign = foreign_tokenizer_copy(toy.close, tmp_path / "foreign")
    stack = stack_factory(toy.target, foreign)
    pairing = verify_info(stack).pairing
    assert pairing.state == pairing_pb2.PAIRING_STATE_REFUSED
    assert not pairing.tokenizer_match
    assert "tokenizers differ: vocabulary: token ids" in pairing.detail
    assert_refused_streams(stack, "tokenizers differ")
    code, report = doctor("--verify", stack.config.verify_address)
    origin = next(c for c in report["checks"] if c["name"] == "same-origin draft")
    assert code == 1 and origin["verdict"] == "fail" and "vocabulary: token ids" in origin["figure"]

    overridden = stack_factory(toy.target, foreign, args={"verify": ["--allow-different-tokenizer"]})
    pairing = verify_info(overridden).pairing
    assert pairing.state == pairing_pb2.PAIRING_STATE_PAIRED
    assert list(pairing.overrides) == ["same-origin"]
    assert not pairing.tokenizer_match and pairing.tokenizer_difference.startswith("tokenizers differ")
    assert any("same-origin guard overridden" in w for w in pairing.warnings)
    messages = run(overridden, request(PROMPT, max_new_tokens=16)).messages
    assert all(m.speculation.speculating and "same-origin" in m.speculation.detail for m in messages)


def test_memory_guard_refuses_a_full_target_unless_overridden(toy, stack_factory):
    tiny_machine = {"verify": [*FAKE, "verify", "--memory-total-bytes", str(64 * 2**20)]}
    stack = stack_factory(toy.target, toy.close, programs=tiny_machine)
    pairing = verify_info(stack).pairing
    assert pairing.state == pairing_pb2.PAIRING_STATE_REFUSED
    assert pairing.target_memory.total_bytes == 64 * 2**20
    assert pairing.target_memory_share > 0.7
    assert "above 70%" in pairing.detail
    assert_refused_streams(stack, "above 70%")

    overridden = stack_factory(
        toy.target, toy.close, programs=tiny_machine, args={"verify": ["--allow-memory-pressure", "--max-sessions", "1"]}
    )
    info = verify_info(overridden)
    assert info.pairing.state == pairing_pb2.PAIRING_STATE_PAIRED
    assert list(info.pairing.overrides) == ["memory-headroom"]
    assert info.max_sessions == 1
    messages = run(overridden, request(PROMPT, max_new_tokens=16)).messages
    assert all(m.speculation.speculating and "memory-headroom" in m.speculation.detail for m in messages)


def test_no_setting_offers_a_host_identity(capsys):
    import draft_service.server
    import gateway.server
    import specdec.cli
    import verify_service.server
    from draft_service.server import DraftConfig
    from gateway.server import GatewayConfig
    from specdec.launcher import StackConfig
    from verify_service.server import VerifyConfig

    words = ("boot", "hostname", "identity", "host_id", "host-id")
    for config in (DraftConfig, VerifyConfig, GatewayConfig, StackConfig):
        fields = " ".join(f"{f.name} {f.metadata.get('help', '')}" for f in config.__dataclass_fields__.values())
        assert not any(w in fields.lower() for w in words), config
    # Every --help, printed by the same entry points the commands run (in this process).
    commands = [(module.main, ["--help"]) for module in (draft_service.server, verify_service.server, gateway.server)]
    commands += [(specdec.cli.main, [sub, "--help"]) for sub in ("serve", "demo", "generate", "doctor")]
    for main, argv in commands:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 0
        text = capsys.readouterr().out.lower()
        assert "usage" in text
        assert not any(w in text for w in words), (argv, [w for w in words if w in text])
