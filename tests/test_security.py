"""TLS on the public port, mutual TLS between the router and the workers (and
for the KV hand-off), and the bearer token."""

from __future__ import annotations

import pathlib

import grpc
import pytest
from certs import CertificateAuthority
from conftest import start_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg.clients.grpc_client import Client
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(directory, "ca"), CertificateAuthority(directory, "rogue-ca")
    return {
        "ca": ca.cert_path, "rogue_ca": rogue.cert_path, "internal": ca.issue("internal"), "public": ca.issue("public"),
        "client": ca.issue("client"), "rogue_client": rogue.issue("rogue-client"),
    }


@pytest.fixture(scope="module")
def secure_cluster(cluster_logs, pki):
    cert, key = pki["internal"]
    public_cert, public_key = pki["public"]
    internal = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", pki["ca"]]
    cluster = start_cluster(
        cluster_logs,
        "llama",
        worker_args=internal,
        router_args=[*internal, "--public-tls-cert", public_cert, "--public-tls-key", public_key, "--auth-token", TOKEN],
        public_tls_ca=pki["ca"],
        http_port=0,  # the HTTP API: the same TLS certificate and token
    )
    yield cluster
    cluster.stop()


def test_tls_and_token_serve_exact_tokens(secure_cluster, pki, llama_ref):
    # Router -> workers and prefill -> decode (KV) all ran over mutual TLS here.
    with Client(secure_cluster.router_address, timeout=60, tls_ca=pki["ca"], token=TOKEN) as client:
        assert client.complete("The cat slept", max_new_tokens=12).token_ids == llama_ref.greedy("The cat slept", 12)


@pytest.mark.parametrize("token,message", [(None, "missing authorization"), ("wrong", "not valid")])
def test_missing_or_wrong_token_is_unauthenticated(secure_cluster, pki, token, message):
    with Client(secure_cluster.router_address, timeout=30, tls_ca=pki["ca"], token=token) as client:
        for call in (lambda: client.complete("The cat", max_new_tokens=2), client.model_info):
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in error.value.details()


def test_health_stays_open_without_a_token(secure_cluster, pki):
    credentials = grpc.ssl_channel_credentials(pathlib.Path(pki["ca"]).read_bytes())
    with grpc.secure_channel(secure_cluster.router_address, credentials) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_http_api_over_tls_takes_the_same_token_and_answers_401_without_it(secure_cluster, pki, llama_ref):
    import ssl

    import httpx
    import openai

    url = secure_cluster.http_url
    assert url.startswith("https://")
    tls = ssl.create_default_context(cafile=pki["ca"])
    with httpx.Client(base_url=url, verify=tls, timeout=30) as http:
        assert http.get("/health").status_code == 200  # open, as the gRPC health check
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for method, path, body in (("POST", "/v1/completions", {"prompt": "The cat", "max_tokens": 2}), ("GET", "/v1/models", None)):
                response = http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (headers, path)
                assert response.json()["error"]["code"] == "invalid_api_key"
    with httpx.Client(verify=tls) as http_client:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, http_client=http_client, max_retries=0)
        out = client.completions.create(prompt="The cat slept", max_tokens=12, temperature=0, model=client.models.list().data[0].id)
        assert out.choices[0].text == llama_ref.tokenizer.decode(llama_ref.greedy("The cat slept", 12), skip_special_tokens=True)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", http_client=http_client, max_retries=0).models.list()


def test_plaintext_to_the_tls_port_fails(secure_cluster):
    with Client(secure_cluster.router_address, timeout=5, token=TOKEN) as client, pytest.raises(grpc.RpcError) as error:
        client.model_info()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


def worker_load(address: str, credentials: grpc.ChannelCredentials) -> wpb.WorkerLoad:
    with grpc.secure_channel(address, credentials) as channel:
        return wgrpc.DecodeServiceStub(channel).GetLoad(wpb.LoadRequest(), timeout=5)


def test_a_worker_accepts_only_clients_with_a_certificate_from_its_ca(secure_cluster, pki):
    decode = secure_cluster.addresses("decode")[0]
    ca = pathlib.Path(pki["ca"]).read_bytes()
    cert, key = (pathlib.Path(p).read_bytes() for p in pki["client"])
    assert worker_load(decode, grpc.ssl_channel_credentials(ca, key, cert)).role == "decode"

    rogue_cert, rogue_key = (pathlib.Path(p).read_bytes() for p in pki["rogue_client"])
    refused = {
        "no client certificate": grpc.ssl_channel_credentials(ca),
        "certificate from another CA": grpc.ssl_channel_credentials(ca, rogue_key, rogue_cert),
    }
    for why, credentials in refused.items():
        with pytest.raises(grpc.RpcError) as error:
            worker_load(decode, credentials)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE, why
    with pytest.raises(grpc.RpcError):
        with grpc.insecure_channel(decode) as channel:
            wgrpc.DecodeServiceStub(channel).GetLoad(wpb.LoadRequest(), timeout=5)
