"""TLS, mutual TLS and bearer tokens against real servers with real certificates.

A CA signs the server's certificate (localhost, 127.0.0.1, ::1) and a client
certificate; a second, unrelated CA stands for "trusting the wrong authority".
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import socket
from collections.abc import Iterator
from unittest import mock

import grpc
import pytest
import torch
from certs import Authority, Issued, make_authority
from conftest import start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchwire.cli import build_parser, main
from batchwire.cli._serve import resolve_config
from batchwire.client import AuthenticationError, RemoteLoader, UnavailableError
from batchwire.client._transport import GrpcTransport, read_bulk_grant
from batchwire.common.tls import tls_context
from batchwire.server import BatchwireServer
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc as pb_grpc

TOKEN = "s3cret-token-for-tests"
OTHER_TOKEN = "second-token"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


class Pki:
    """PEM files: a CA, its server and client certificates, an unrelated CA, and
    a token file holding ``TOKEN`` and ``OTHER_TOKEN`` among comments."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.ca: Authority = make_authority(directory, "batchwire-test")
        self.server: Issued = self.ca.issue("server", hosts=("localhost", "127.0.0.1", "::1"))
        self.client: Issued = self.ca.issue("trainer", client=True)
        self.other_ca: Authority = make_authority(directory, "unrelated")
        self.token_file = directory / "tokens"
        self.token_file.write_text(f"# trainers\n\n{TOKEN}\n  {OTHER_TOKEN}  \n# old: retired\n")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(data_dir: pathlib.Path, pki: Pki) -> Iterator[BatchwireServer]:
    """TLS and tokens; the health service needs a token too."""
    server = start_server(
        data_dir, tls_cert=pki.server.cert, tls_key=pki.server.key, token_file=pki.token_file
    )
    yield server
    server.stop(grace=1.0)


@pytest.fixture(scope="module")
def mtls_server(data_dir: pathlib.Path, pki: Pki) -> Iterator[BatchwireServer]:
    """Mutual TLS and tokens, with the health service open for probes."""
    server = start_server(
        data_dir,
        tls_cert=pki.server.cert,
        tls_key=pki.server.key,
        tls_client_ca=pki.ca.cert,
        token_file=pki.token_file,
        health_open=True,
    )
    yield server
    server.stop(grace=1.0)


def secure_channel(
    server: BatchwireServer, ca: pathlib.Path, client: Issued | None = None
) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )
    return grpc.secure_channel(server.target, credentials, options=[("grpc.so_reuseport", 0)])


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def stream_request(batch_size: int = 8) -> pb.StreamBatchesRequest:
    return pb.StreamBatchesRequest(
        dataset="shapes", pipeline="val", batch_size=batch_size, params={"size": 32}
    )


def loader(server: BatchwireServer, **security: object) -> RemoteLoader:
    return RemoteLoader(
        server.target,
        dataset="shapes",
        pipeline="val",
        batch_size=8,
        params={"size": 32},
        timeout=30,
        **security,  # type: ignore[arg-type]
    )


@pytest.fixture(autouse=True)
def no_token_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHWIRE_TOKEN", raising=False)


# -- tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_loader_without_the_right_token_is_unauthenticated(
    tls_server: BatchwireServer, pki: Pki, token: str | None
) -> None:
    with (
        loader(tls_server, token=token, tls_ca=pki.ca.cert) as refused,
        pytest.raises(AuthenticationError) as caught,
    ):
        next(iter(refused))
    assert caught.value.code == UNAUTHENTICATED
    assert "Bearer" in caught.value.details  # says what to send


@pytest.mark.parametrize("metadata", [(), bearer("wrong-token"), (("authorization", TOKEN),)])
def test_raw_calls_without_the_right_token_are_unauthenticated(
    tls_server: BatchwireServer, pki: Pki, metadata: tuple[tuple[str, str], ...]
) -> None:
    with secure_channel(tls_server, pki.ca.cert) as channel:
        stub = pb_grpc.BatchwireStub(channel)
        calls = {
            "StreamBatches": lambda: list(stub.StreamBatches(stream_request(), metadata=metadata)),
            "DescribeDataset": lambda: stub.DescribeDataset(
                pb.DescribeDatasetRequest(dataset="shapes"), metadata=metadata
            ),
            "ListDatasets": lambda: stub.ListDatasets(pb.ListDatasetsRequest(), metadata=metadata),
            "Health": lambda: health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), metadata=metadata
            ),
            # A bidirectional stream: the interceptor refuses every handler shape.
            "Reflection": lambda: list(
                reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                    metadata=metadata,
                )
            ),
            # Unknown methods are refused alike: no probing for what exists.
            "unknown": lambda: channel.unary_unary("/batchwire.v1.Batchwire/Nope")(
                b"", metadata=metadata
            ),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == UNAUTHENTICATED, name  # type: ignore[attr-defined]


def test_refusals_are_logged_without_the_token(
    tls_server: BatchwireServer, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    presented = "not-the-token-1234"
    with (
        caplog.at_level(logging.WARNING, logger="batchwire.server.serving._security"),
        secure_channel(tls_server, pki.ca.cert) as channel,
        pytest.raises(grpc.RpcError),
    ):
        pb_grpc.BatchwireStub(channel).ListDatasets(
            pb.ListDatasetsRequest(), metadata=bearer(presented)
        )
    assert "ListDatasets" in caplog.text
    assert presented not in caplog.text
    assert TOKEN not in caplog.text


@pytest.mark.parametrize("token", [TOKEN, OTHER_TOKEN])
def test_a_token_from_the_file_over_tls_streams(
    tls_server: BatchwireServer, pki: Pki, token: str
) -> None:
    with loader(tls_server, token=token, tls_ca=pki.ca.cert) as accepted:
        images, labels = next(iter(accepted))
    assert images.shape == (8, 3, 32, 32)
    assert labels.shape == (8,)


def bulk_bytes(server: BatchwireServer) -> float:
    labels = {"dataset": "shapes", "pipeline": "val"}
    return server.metrics.registry.get_sample_value("batchwire_bulk_bytes_total", labels) or 0.0


def test_a_trainer_on_another_host_gets_its_images_on_a_tls_bulk_connection(
    tls_server: BatchwireServer, pki: Pki
) -> None:
    # A trainer on another host (no shared memory): its images on the stream's bulk
    # connection, which speaks TLS as the call does; the same batches as in the messages.
    def epoch(bulk: bool) -> list[tuple[torch.Tensor, ...]]:
        secured = loader(
            tls_server, token=TOKEN, tls_ca=pki.ca.cert, shared_memory=False, bulk=bulk
        )
        with secured as tls:
            return list(tls)

    before = bulk_bytes(tls_server)
    on_bulk = epoch(True)
    # Most of them: the first batches, asked for with the call's first message, may be
    # made before the handshake and come in their messages.
    assert bulk_bytes(tls_server) - before > 0
    in_messages = epoch(False)
    assert len(on_bulk) == len(in_messages) == 65
    for (images, labels), (want_images, want_labels) in zip(on_bulk, in_messages, strict=True):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


def test_a_bulk_port_with_tls_refuses_a_plaintext_claim_and_a_wrong_certificate(
    tls_server: BatchwireServer, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    # A raw claim in plaintext, with a live key: the server's handshake fails, nothing is
    # answered, and the key cannot have been read.
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert.read_bytes())
    with grpc.secure_channel(tls_server.target, credentials) as channel:
        pull = channel.stream_stream(
            "/batchwire.v1.Batchwire/PullBatches",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=None,
        )
        stream = pb.StreamBatchesRequest(
            dataset="shapes", pipeline="val", batch_size=8, params={"size": 32}
        )
        asks = [pb.PullRequest(stream=stream, bulk=True)]
        call = pull(iter(asks), metadata=(("authorization", f"Bearer {TOKEN}"),))
        grant = read_bulk_grant(call.initial_metadata())
        assert grant is not None
        with socket.create_connection(("localhost", grant.port), timeout=10) as plain:
            plain.sendall(grant.key)
            with contextlib.suppress(ConnectionResetError):
                assert plain.recv(1) == b""  # closed (or reset) without an answer
        call.cancel()
    # A trainer that trusts another CA refuses the bulk connection's certificate, as it
    # would the call's: here it trusts the server's CA for the call and another for the
    # connection, and its images come in the messages, said once.
    elsewhere = tls_context(server=False, ca=pki.other_ca.cert.read_bytes())
    secured = loader(tls_server, token=TOKEN, tls_ca=pki.ca.cert, shared_memory=False)
    before = bulk_bytes(tls_server)
    with (
        mock.patch.object(GrpcTransport, "tls_context", return_value=elsewhere),
        caplog.at_level(logging.WARNING, logger="batchwire.client"),
        secured as tls,
    ):
        assert sum(len(labels) for _, labels in tls) == 520
    assert bulk_bytes(tls_server) == before
    assert caplog.text.count("could not claim a bulk connection") == 1, caplog.text


def test_reflection_works_with_the_token(tls_server: BatchwireServer, pki: Pki) -> None:
    with secure_channel(tls_server, pki.ca.cert) as channel:
        replies = list(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=bearer(TOKEN),
            )
        )
    names = {s.name for s in replies[0].list_services_response.service}
    assert "batchwire.v1.Batchwire" in names


# -- TLS ------------------------------------------------------------------------------


def test_a_client_trusting_another_ca_is_unavailable(tls_server: BatchwireServer, pki: Pki) -> None:
    with (
        loader(tls_server, token=TOKEN, tls_ca=pki.other_ca.cert) as untrusting,
        pytest.raises(UnavailableError) as caught,
    ):
        next(iter(untrusting))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_gets_no_answer(tls_server: BatchwireServer) -> None:
    with (
        grpc.insecure_channel(tls_server.target) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        pb_grpc.BatchwireStub(channel).ListDatasets(
            pb.ListDatasetsRequest(), metadata=bearer(TOKEN), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_mutual_tls_refuses_a_client_without_certificate(
    mtls_server: BatchwireServer, pki: Pki
) -> None:
    with (
        secure_channel(mtls_server, pki.ca.cert) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        pb_grpc.BatchwireStub(channel).ListDatasets(
            pb.ListDatasetsRequest(), metadata=bearer(TOKEN), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    with (
        loader(mtls_server, token=TOKEN, tls_ca=pki.ca.cert) as certless,
        pytest.raises(UnavailableError),
    ):
        next(iter(certless))


def test_mutual_tls_refuses_a_certificate_from_another_ca(
    mtls_server: BatchwireServer, pki: Pki
) -> None:
    stranger = pki.other_ca.issue("stranger", client=True)
    with (
        secure_channel(mtls_server, pki.ca.cert, stranger) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        pb_grpc.BatchwireStub(channel).ListDatasets(
            pb.ListDatasetsRequest(), metadata=bearer(TOKEN), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_mutual_tls_with_the_client_certificate_streams(
    mtls_server: BatchwireServer, pki: Pki
) -> None:
    mutual = {"tls_ca": pki.ca.cert, "tls_cert": pki.client.cert, "tls_key": pki.client.key}
    with loader(mtls_server, token=TOKEN, **mutual) as accepted:
        images, _ = next(iter(accepted))
    assert images.shape == (8, 3, 32, 32)
    # A trainer on another host: its images on a bulk connection with its certificate.
    before = bulk_bytes(mtls_server)
    with loader(mtls_server, token=TOKEN, shared_memory=False, **mutual) as remote:
        assert sum(len(labels) for _, labels in remote) == 520
    assert bulk_bytes(mtls_server) - before > 0
    # The certificate alone is not enough: the token is still required.
    with (
        loader(
            mtls_server, tls_ca=pki.ca.cert, tls_cert=pki.client.cert, tls_key=pki.client.key
        ) as tokenless,
        pytest.raises(AuthenticationError),
    ):
        next(iter(tokenless))


# -- health for probes ----------------------------------------------------------------


def test_health_open_serves_probes_without_a_token(
    mtls_server: BatchwireServer, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    client = ["--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key)]
    probe = ["health", "--address", mtls_server.target, "--tls-ca", str(pki.ca.cert), *client]
    assert main(probe) == 0
    assert "SERVING" in capsys.readouterr().out
    with (
        secure_channel(mtls_server, pki.ca.cert, pki.client) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        pb_grpc.BatchwireStub(channel).ListDatasets(pb.ListDatasetsRequest())
    assert caught.value.code() == UNAUTHENTICATED  # type: ignore[attr-defined]


def test_health_needs_the_token_unless_open(
    tls_server: BatchwireServer,
    pki: Pki,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe = ["health", "--address", tls_server.target, "--tls-ca", str(pki.ca.cert)]
    assert main(probe) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main([*probe, "--token-file", str(pki.token_file)]) == 0
    assert "SERVING" in capsys.readouterr().out
    monkeypatch.setenv("BATCHWIRE_TOKEN", TOKEN)
    assert main(probe) == 0
    # By IP address: the certificate lists 127.0.0.1 too.
    by_ip = ["health", "--address", f"127.0.0.1:{tls_server.port}", "--tls-ca", str(pki.ca.cert)]
    assert main(by_ip) == 0
    # Trusting the wrong CA: no answer, whatever the token.
    wrong = ["health", "--address", tls_server.target, "--tls-ca", str(pki.other_ca.cert)]
    assert main([*wrong, "--timeout", "5"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_health_reports_a_missing_credentials_file(
    pki: Pki, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.pem"
    assert main(["health", "--address", "localhost:1", "--tls-ca", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "tls_ca" in err and str(missing) in err


# -- start-up errors ------------------------------------------------------------------


def serve_error(
    data_dir: pathlib.Path, capsys: pytest.CaptureFixture[str], *flags: str | pathlib.Path
) -> str:
    """`batchwire serve` with ``flags``: it must exit 2 before listening; its message."""
    argv = ["serve", "--data-dir", str(data_dir), "--port", "0", "--device", "cpu"]
    assert main([*argv, *(str(f) for f in flags)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_serve_rejects_bad_security_settings(
    data_dir: pathlib.Path,
    pki: Pki,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith("BATCHWIRE_"):
            monkeypatch.delenv(name)
    cert, key = pki.server.cert, pki.server.key
    missing = tmp_path / "missing.pem"
    message = serve_error(data_dir, capsys, "--tls-cert", missing, "--tls-key", key)
    assert "--tls-cert" in message and str(missing) in message

    message = serve_error(data_dir, capsys, "--tls-cert", cert)
    assert "tls_key" in message

    message = serve_error(data_dir, capsys, "--tls-client-ca", pki.ca.cert)
    assert "--tls-client-ca" in message and "--tls-cert" in message

    empty = tmp_path / "tokens"
    empty.write_text("# nothing yet\n\n")
    message = serve_error(data_dir, capsys, "--token-file", empty)
    assert "--token-file" in message and "no token" in message

    bad_line = tmp_path / "bad-tokens"
    bad_line.write_text("two words\n")
    message = serve_error(data_dir, capsys, "--token-file", bad_line)
    assert "line 1" in message and "two words" not in message

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    message = serve_error(data_dir, capsys, "--tls-cert", garbage, "--tls-key", key)
    assert "--tls-cert" in message and str(garbage) in message

    # A certificate with somebody else's key.
    message = serve_error(data_dir, capsys, "--tls-cert", cert, "--tls-key", pki.client.key)
    assert "matching private key" in message

    message = serve_error(
        data_dir, capsys, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", garbage
    )
    assert "--tls-client-ca" in message

    monkeypatch.setenv("BATCHWIRE_HEALTH_OPEN", "maybe")
    assert "BATCHWIRE_HEALTH_OPEN" in serve_error(data_dir, capsys)


def test_security_settings_from_flags_environment_and_config_file(
    data_dir: pathlib.Path, pki: Pki, tmp_path: pathlib.Path
) -> None:
    config = tmp_path / "server.toml"
    config.write_text(
        "[server]\n"
        f'tls_cert = "{pki.other_ca.cert}"\n'
        f'tls_client_ca = "{pki.ca.cert}"\n'
        f'token_file = "{pki.token_file}"\n'
        "health_open = false\n"
    )
    args = build_parser().parse_args(
        ["serve", "--data-dir", str(data_dir), "--config", str(config), "--health-open"]
    )
    environ = {"BATCHWIRE_TLS_CERT": str(pki.server.cert), "BATCHWIRE_TLS_KEY": str(pki.server.key)}
    resolved = resolve_config(args, environ)
    assert resolved.tls_cert == pki.server.cert  # environment over file
    assert resolved.tls_key == pki.server.key
    assert resolved.tls_client_ca == pki.ca.cert
    assert resolved.token_file == pki.token_file
    assert resolved.health_open is True  # flag over file
    assert resolve_config(args, {**environ, "BATCHWIRE_HEALTH_OPEN": "0"}).health_open is True
    plain = build_parser().parse_args(["serve", "--data-dir", str(data_dir)])
    assert resolve_config(plain, {"BATCHWIRE_HEALTH_OPEN": "yes"}).health_open is True
