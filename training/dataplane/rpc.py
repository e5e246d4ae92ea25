"""What both ends of the data plane's gRPC agree on: the service's name, the message limit and
the channel options (keepalive pings, frame sizes). Light on purpose (grpc only, no torch): the
data server, the trainer's client and a data server's own launcher (its health watch) all read it.
"""

from __future__ import annotations

SERVICE_NAME = "training.dataplane.v1.DataPlane"
# Messages stay a few MB (a 32 x 224 px batch is 4.8 MB); the limit leaves room for big crops.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options both ends use: explicit message limits and keepalive pings, so a vanished
    peer is noticed in seconds rather than at the TCP timeout."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Multi-MB messages: bigger HTTP/2 frames and socket reads mean fewer trips through the
        # transport per batch (receive CPU on the trainer host is what the design saves).
        ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
        ("grpc.experimental.tcp_read_chunk_size", 4 * 1024 * 1024),
        ("grpc.experimental.tcp_min_read_chunk_size", 1024 * 1024),
        ("grpc.experimental.tcp_max_read_chunk_size", 16 * 1024 * 1024),
    ]
