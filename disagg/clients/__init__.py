"""Clients of the public APIs: gRPC (`Client`, `AsyncClient`) and the OpenAI HTTP API."""

from disagg.clients.grpc_client import AsyncClient, Client, Generation, GenerationChunk

__all__ = ["AsyncClient", "Client", "Generation", "GenerationChunk"]
