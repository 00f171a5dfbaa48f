"""Container health check: exits 0 when the gRPC server at ADDRESS reports SERVING on
grpc.health.v1 (the overall "" service), else 1. Usage: python deploy/healthcheck.py ADDRESS"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return 1
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
