"""Unit tests of the node side fake engine launches (made-up PIDs): the host firewall (deployments/host/firewall.py,
which changes this host's nftables and cgroups) is replaced at its boundary; tests/security/test_firewall.py tests
the real one."""
from unittest import mock

import pytest


@pytest.fixture(autouse=True)
def no_host_firewall():
    with mock.patch("deployments.host.firewall.check", autospec=True, return_value="Firewalled (test)."), \
         mock.patch("deployments.host.firewall.guard", autospec=True, return_value="Firewalled (test)."), \
         mock.patch("deployments.host.firewall.release", autospec=True, return_value=True), \
         mock.patch("deployments.host.firewall.sweep", autospec=True, return_value=[]):
        yield
