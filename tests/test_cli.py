"""The `specdec` command and each service's own entry point, run as users run them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from specdec.cli import build_parser, main
from specdec.defaults import RECENT_CAPACITY
from specdec.launcher import free_port
from tests.helpers import Lines

SPECDEC = [sys.executable, "-m", "specdec.cli"]


@pytest.mark.parametrize("module", ["draft_service", "verify_service", "gateway"])
def test_each_service_has_help(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--listen" in result.stdout and "(env SPECDEC_" in result.stdout


def test_serve_generate_and_sigterm(toy, tmp_path):
    port = free_port()
    serve = subprocess.Popen(
        [*SPECDEC, "serve", "--target", str(toy.target), "--draft", str(toy.close), "--port", str(port), "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = Lines(serve)
    try:
        ready = lines.wait_for("specdec ready", timeout=180)
        assert f"127.0.0.1:{port}" in ready and "draft.sock" in ready

        result = subprocess.run(
            [*SPECDEC, "generate", "-", "--gateway", f"127.0.0.1:{port}", "--json", "--max-new-tokens", "24", "--num-draft-tokens", "3"],
            input="The quick brown fox",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        *messages, summary = [json.loads(line) for line in result.stdout.splitlines()]
        assert summary["finish_reason"] == "length" and len(summary["token_ids"]) == 24
        assert summary["usage"]["rounds"] == len(messages)
        assert 0 <= summary["acceptance_rate"] <= 1
        assert [t for m in messages for t in m.get("token_ids", [])] == summary["token_ids"]
        assert messages[0]["speculation"]["speculating"] is True

        bad = subprocess.run(
            # In the CLI's range, past the server's limit: the server's refusal is shown.
            [*SPECDEC, "generate", "hi", "--gateway", f"127.0.0.1:{port}", "--max-new-tokens", "100000"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 1 and "INVALID_ARGUMENT: max_new_tokens: the prompt" in bad.stderr

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        stopped = lines.wait_for("specdec stopped", timeout=10)
        assert stopped.count("exit 0") == 3
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_demo_streams_both_ways_and_prints_the_figures(toy):
    result = subprocess.run(
        [*SPECDEC, "demo", "--target", str(toy.target), "--draft", str(toy.close), "--port", str(free_port()), "--max-new-tokens", "64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for mode in ("on", "auto", "off"):
        assert f"--- speculation {mode} ---" in out
        row = next(line for line in out.splitlines() if line.startswith(f"speculation {mode} "))
        tokens, seconds, tokens_per_s, acceptance, rounds, speedup = row.split()[2:]
        assert int(tokens) == 64 and float(tokens_per_s) > 0 and speedup.endswith("x")
        if mode == "on":
            assert 0 < float(acceptance) <= 1
    assert "on: k=4 every round; auto: k in" in out
    assert "outputs identical: yes" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "x", "--seed", "-1"],
        ["generate", "x", "--seed", str(2**64)],
        ["generate", "x", "--max-new-tokens", "0"],
        ["generate", "x", "--max-new-tokens", "99999999999"],
        ["generate", "x", "--temperature", "-0.5"],
        ["generate", "x", "--temperature", "nan"],
        ["generate", "x", "--temperature", "1e39"],  # inf once sent as a proto float
        ["generate", "x", "--top-k", "-1"],
        ["generate", "x", "--top-k", "1.5"],
        ["generate", "x", "--top-p", "0"],
        ["generate", "x", "--top-p", "1.01"],
        ["generate", "x", "--num-draft-tokens", "0"],
        ["generate", "x", "--num-draft-tokens", "17"],
        ["generate", "x", "--timeout", "0"],
        ["generate", "x", "--timeout", "1e10"],  # gRPC takes it as already passed
        ["doctor", "--requests", "-1"],
        ["doctor", "--requests", str(RECENT_CAPACITY + 1)],
        ["doctor", "--timeout", "inf"],
        ["serve", "--port", "0"],
        ["serve", "--port", "65536"],
        ["demo", "--port", "-5"],
        ["demo", "--max-new-tokens", "0"],
        ["demo", "--num-draft-tokens", "99"],
    ],
    ids=" ".join,
)
def test_out_of_range_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: specdec") and f"argument {argv[-2]}: " in err


def test_a_bad_port_in_the_environment_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_PORT", "http")
    with pytest.raises(SystemExit) as exited:
        main(["serve"])
    assert exited.value.code == 2
    assert "argument --port: not an integer: 'http'" in capsys.readouterr().err


def test_a_bad_argument_prints_no_traceback():
    done = subprocess.run([*SPECDEC, "generate", "x", "--seed", "-1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "usage: specdec generate" in done.stderr and "Traceback" not in done.stderr
    assert "argument --seed: -1 is outside 0..18446744073709551615" in done.stderr


def test_the_edges_of_each_range_are_accepted(monkeypatch):
    monkeypatch.delenv("SPECDEC_DEMO_PORT", raising=False)
    parser = build_parser()
    gen = parser.parse_args(
        ["generate", "x", "--seed", str(2**64 - 1), "--max-new-tokens", "1", "--temperature", "0", "--top-k", "0",
         "--top-p", "1", "--num-draft-tokens", "16", "--timeout", "0.001"]
    )  # fmt: skip
    assert (gen.seed, gen.max_new_tokens, gen.temperature, gen.top_k, gen.top_p) == (2**64 - 1, 1, 0.0, 0, 1.0)
    assert (gen.num_draft_tokens, gen.timeout) == (16, 0.001)
    assert parser.parse_args(["doctor", "--requests", str(RECENT_CAPACITY)]).requests == RECENT_CAPACITY
    assert parser.parse_args(["serve", "--port", "65535"]).port == 65535
    assert parser.parse_args(["demo"]).port == 50061  # a default given as text is converted too
