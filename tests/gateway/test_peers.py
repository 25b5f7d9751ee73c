"""Gateway to gateway: one key per ordered pair of nodes and hour, taken from the sending node's address only,
and TLS between the gateways when GATEWAY_TLS_CERT is set (two real gateways, a real CA and certificates)."""
import datetime as dt
import ipaddress
import json

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from deployments.gateway import config, peers
from deployments.models import Node
from tests.gateway.conftest import GatewayThread, make_deployment, make_key

CHAT = {"model": "sched", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 8}


def as_peer(gw, token, source, body=CHAT, **headers):
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {token}", peers.HEADER: source, **headers})


def test_a_key_is_one_pairs_one_direction_and_holds_an_hour_either_side(settings):
    settings.SECRET_KEY = "s" * 50
    now = 1_800_000_000.0
    hour = peers.epoch(now)
    key = peers.current("a", "b", now)
    assert key.startswith(peers.PREFIX) and key == peers.secret("a", "b", hour)
    assert peers.valid(key, "a", "b", now)
    assert peers.valid(key, "a", "b", now + peers.PERIOD_S) and peers.valid(key, "a", "b", now - peers.PERIOD_S)
    assert not peers.valid(key, "a", "b", now + 2 * peers.PERIOD_S)  # two hours on: rotated out
    assert not peers.valid(key, "b", "a", now)  # the other direction
    assert not peers.valid(key, "a", "c", now) and not peers.valid(key, "c", "b", now)  # another pair
    assert len({peers.current(s, d, now) for s in "abc" for d in "abc"}) == 9
    settings.SECRET_KEY = "t" * 50
    assert not peers.valid(key, "a", "b", now)  # a new SECRET_KEY: every key changes at once


def test_a_peer_key_is_taken_from_its_own_nodes_address_for_this_node_within_its_hour(node, sched):
    make_deployment(node, sched.port)
    far = Node.objects.create(name="gw-peer", address="10.9.9.9")  # not where this test calls from
    with GatewayThread(node.name, ready_wait_s=1.0) as gw:
        key = peers.current("gw-peer", node.name)
        refused = as_peer(gw, key, "gw-peer")
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["message"] == "A gateway's key is taken from its own node's address only."
        assert as_peer(gw, key, "no-such-node").status_code == 403
        far.address = "127.0.0.1"
        far.save()
        gw.reload()
        assert as_peer(gw, key, "gw-peer").status_code == 200
        hour = peers.epoch()
        assert as_peer(gw, peers.secret("gw-peer", node.name, hour - 1), "gw-peer").status_code == 200
        served = sched.server.requests_total
        for stale in (peers.secret("gw-peer", node.name, hour - 2),  # rotated out
                      peers.secret(node.name, "gw-peer", hour),  # the other direction
                      peers.secret("gw-peer", "gw-third", hour),  # a key for another node
                      make_key()):  # a caller's key does not make its holder a gateway
            reply = as_peer(gw, stale, "gw-peer")
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", reply.text
        assert as_peer(gw, key, node.name).status_code == 403  # nobody speaks for this node to itself
        assert sched.server.requests_total == served
        reply = httpx.get(gw.url + f"/engines/{node.deployments.get().pk}/metrics",
                          headers={"Authorization": f"Bearer {key}", peers.HEADER: "gw-peer"})
        assert reply.status_code == 403


def test_the_earlier_shared_gateway_key_opens_nothing(node, sched):
    """A release before this one kept one internal key for every pair of gateways; a copy of it is refused."""
    make_deployment(node, sched.port)
    shared = make_key(internal=True, name="gateway")
    Node.objects.create(name="gw-peer", address="127.0.0.1")
    with GatewayThread(node.name, ready_wait_s=1.0) as gw:
        reply = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {shared}"})
        assert reply.status_code == 401
        assert as_peer(gw, shared, "gw-peer").status_code == 401
    assert config.digest(shared) not in config.load_keys()


def _pem_pair(name, issuer=None, issuer_key=None, ca=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                      content_commitment=False, key_encipherment=False,
                                                      data_encipherment=False, key_agreement=False,
                                                      encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(name))]),
                                        critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return cert, key


def _write(folder, stem, cert, key=None):
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (folder / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    return str(folder / f"{stem}.pem")


@pytest.fixture
def tls(tmp_path, settings):
    """A CA, and a certificate for 127.0.0.1 it signed: every gateway of the panel serves TLS."""
    ca_cert, ca_key = _pem_pair("panel test CA", ca=True)
    cert, key = _pem_pair("127.0.0.1", issuer=ca_cert.subject, issuer_key=ca_key)
    settings.GATEWAY_TLS_CA = _write(tmp_path, "ca", ca_cert)
    settings.GATEWAY_TLS_CERT = _write(tmp_path, "node", cert, key)
    settings.GATEWAY_TLS_KEY = str(tmp_path / "node.key")
    return settings.GATEWAY_TLS_CA


def test_gateways_speak_tls_to_callers_and_to_each_other(node, sched, tls, tmp_path, settings):
    other = Node.objects.create(name="gw-other", address="127.0.0.1")
    d = make_deployment(other, sched.port, aliases=["far"])
    key = make_key()
    with GatewayThread(other.name, ready_wait_s=1.0) as there, GatewayThread(node.name, ready_wait_s=1.0) as here:
        here.reload()
        url = f"https://127.0.0.1:{here.gateway.port}/v1/chat/completions"
        auth = {"Authorization": f"Bearer {key}"}
        answer = httpx.post(url, json={**CHAT, "model": "far"}, headers=auth, verify=tls, timeout=30)
        assert answer.status_code == 200 and answer.json()["choices"], answer.text
        stream = httpx.post(url, json={**CHAT, "model": "far", "stream": True}, headers=auth, verify=tls, timeout=30)
        chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
        assert stream.status_code == 200 and chunks and stream.text.rstrip().endswith("data: [DONE]")
        assert sched.server.requests_total == 2  # both went through `there`, over TLS
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS gateway
            httpx.post(f"http://127.0.0.1:{there.gateway.port}/v1/chat/completions", json=CHAT, headers=auth)
        assert d.base_url.startswith("https://")
    # A gateway that does not trust the peer's certificate does not send it the request (nor its key).
    stranger, _ = _pem_pair("another CA", ca=True)
    settings.GATEWAY_TLS_CA = _write(tmp_path, "stranger", stranger)
    with GatewayThread(other.name, ready_wait_s=1.0) as there, GatewayThread(node.name, ready_wait_s=1.0) as here:
        here.reload()
        url = f"https://127.0.0.1:{here.gateway.port}/v1/chat/completions"
        for stream in (False, True):
            refused = httpx.post(url, json={**CHAT, "model": "far", "stream": stream},
                                 headers={"Authorization": f"Bearer {key}"}, verify=tls, timeout=30)
            assert refused.status_code == 503, refused.text
        assert sched.server.requests_total == 2
