"""ps-server --reflection: gRPC reflection (what `grpcurl list` and `grpcurl describe` use) names the
service and describes its methods; without the flag a shard does not answer it."""

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def _address(local) -> str:
    return local.cluster.ps[0]


def test_a_shard_with_reflection_lists_and_describes_its_service(local_cluster):
    local = local_cluster(1, server_args=["--reflection"])
    with grpc.insecure_channel(_address(local)) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"torchps.v1.ParameterServer", "grpc.health.v1.Health"} <= services
        service = DescriptorPool(database).FindServiceByName("torchps.v1.ParameterServer")
        methods = {m.name: m for m in service.methods}
        assert {"Push", "Pull", "PushPull", "GetStatus", "Shutdown"} <= set(methods)
        assert methods["Push"].input_type.full_name == "torchps.v1.PushRequest"


def test_a_shard_without_the_flag_does_not_answer_reflection(local_cluster):
    local = local_cluster(1)
    with grpc.insecure_channel(_address(local)) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            ProtoReflectionDescriptorDatabase(channel).get_services()
    assert raised.value.code() is grpc.StatusCode.UNIMPLEMENTED
