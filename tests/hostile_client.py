"""A hostile client in a process of its own, sending 3.9 MiB text prompts to the gateway
when told to.

    python -m tests.hostile_client <gateway address>

It reads commands on stdin, one a line: `pair` sends two such prompts at once, on two
connections, without waiting for them; `wait` waits for every call sent and then echoes
`wait`. At the end of stdin it prints how the calls ended, as JSON ({status code name:
count}).

A process of its own, so that its work does not take the interpreter lock from the
test's client whose stream is measured.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter

import grpc

from specdec.v1 import generation_pb2

LINE = "def speculative_decode(prompt, draft, target, k=4):  # the draft guesses, the target keeps\n"
HUGE = LINE * (int(3.9 * 2**20) // len(LINE))  # 3.9 MiB: under the gateway's 4 MiB message limit
GENERATE = "/specdec.v1.Generation/Generate"


def send(call: grpc.UnaryStreamMultiCallable, message: bytes, ended: Counter, lock: threading.Lock) -> None:
    try:
        list(call(message, timeout=60))
        code = "OK"
    except grpc.RpcError as err:
        code = err.code().name
    with lock:
        ended[code] += 1


def main(address: str) -> None:
    message = generation_pb2.GenerateRequest(text=HUGE, max_new_tokens=8).SerializeToString()  # once, not per call
    channels = [grpc.insecure_channel(address) for _ in range(2)]
    calls = [channel.unary_stream(GENERATE) for channel in channels]  # they send bytes as they are
    ended: Counter = Counter()
    lock = threading.Lock()  # guards ended
    sent: list[threading.Thread] = []
    for line in sys.stdin:
        if line.strip() == "pair":
            pair = [threading.Thread(target=send, args=(call, message, ended, lock)) for call in calls]
            for thread in pair:
                thread.start()
            sent += pair
        elif line.strip() == "wait":
            for thread in sent:
                thread.join()
            sent = []
            print("wait", flush=True)
    for thread in sent:
        thread.join()
    for channel in channels:
        channel.close()
    print(json.dumps(dict(ended)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
