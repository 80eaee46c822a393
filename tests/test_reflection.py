"""What grpcurl does, with no generated stubs and no .proto file: server
reflection to list and describe the services, a request built from JSON,
and the stream read back as JSON."""

from __future__ import annotations

import json

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def reflect(address: str):
    channel = grpc.insecure_channel(address)
    database = ProtoReflectionDescriptorDatabase(channel)
    return channel, database, descriptor_pool.DescriptorPool(database)


def test_list_describe_and_stream_generate_by_reflection_only(llama_cluster, llama_ref):
    channel, database, pool = reflect(llama_cluster.router_address)
    with channel:
        services = set(database.get_services())
        assert {"disagg.v1.GenerationService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services

        # `grpcurl describe disagg.v1.GenerationService.Generate` resolves the method by its full name.
        assert database.FindFileContainingSymbol("disagg.v1.GenerationService.Generate").name == "disagg/v1/generation.proto"
        service = pool.FindServiceByName("disagg.v1.GenerationService")
        generate = service.methods_by_name["Generate"]
        assert generate.server_streaming and not generate.client_streaming
        assert generate.input_type.full_name == "disagg.v1.GenerateRequest"
        assert {"prompt", "prompt_token_ids", "sampling", "stopping", "request_id"} <= set(generate.input_type.fields_by_name)

        request_class = message_factory.GetMessageClass(generate.input_type)
        response_class = message_factory.GetMessageClass(generate.output_type)
        body = '{"request_id": "by-reflection", "prompt": "The cat slept", "stopping": {"max_new_tokens": 12}}'
        request = json_format.Parse(body, request_class())
        call = channel.unary_stream(
            "/disagg.v1.GenerationService/Generate",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        replies = [json.loads(json_format.MessageToJson(m)) for m in call(request, timeout=60)]

    assert all(r["requestId"] == "by-reflection" for r in replies)
    ids = [int(t) for r in replies for t in r.get("tokenIds", [])]
    assert ids == llama_ref.greedy("The cat slept", 12)
    assert replies[-1]["finishReason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    assert replies[-1]["usage"]["completionTokens"] == len(ids)


def test_workers_expose_reflection_and_their_internal_services(llama_cluster):
    expected = {"prefill": "disagg.v1.PrefillService", "decode": "disagg.v1.DecodeService"}
    for process in llama_cluster.processes:
        role = process.name.split("-")[0]
        if role not in expected:
            continue
        channel, database, _ = reflect(process.address)
        with channel:
            assert expected[role] in set(database.get_services())
