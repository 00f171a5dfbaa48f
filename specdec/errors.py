"""Errors that map to gRPC status codes; servicers abort with `err.code` and `str(err)`."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(ServiceError):
    """A bug or an unexpected failure. Its message is written for the client: a short
    reason and where the service logged the exception, never the exception's own text."""

    code = grpc.StatusCode.INTERNAL
