"""Knowledge bases: upload files, parse, chunk, embed and index them into Milvus as durable tasks."""

import os

# pymilvus speaks gRPC, whose fork handlers (on unless this is off) restart gRPC's poller in every
# child a process forks once gRPC is loaded: a child that then closes its descriptors before exec
# (subprocess with user=, group=: how embedded PostgreSQL starts as root) crashed in about one
# fork in 300 before it could exec (https://github.com/grpc/grpc/issues/43055). We only ever fork
# to exec, never to go on using gRPC in the child, so the handlers are not needed. Set before
# anything here imports gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
