"""The service as any gRPC client sees it: reflection and the dataset listing."""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from batchwire.server import BatchwireServer


def test_reflection_lists_the_services(server: BatchwireServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"batchwire.v1.Batchwire", "grpc.health.v1.Health"} <= services
        method_names = {
            m.name
            for m in database.FindFileContainingSymbol("batchwire.v1.Batchwire").service[0].method
        }
    assert method_names == {
        "ListDatasets",
        "DescribeDataset",
        "StreamBatches",
        "PullBatches",
        "Preprocess",
    }
