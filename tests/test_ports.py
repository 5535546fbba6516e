"""``launch.ports``: a port from ``$AUTOTUNE_PORT_RANGE`` taken in turn, busy ones skipped, a bad range one error."""

from __future__ import annotations

import socket

import pytest

from autotune.errors import ConfigError
from autotune.launch import ports


@pytest.fixture
def span(monkeypatch):
    """Four ports of the worker's own range (conftest gives each worker one), as the whole range."""
    low = ports.port_range()[0]
    monkeypatch.setattr(ports, "_turns", {})
    monkeypatch.setenv(ports.PORT_RANGE_ENV, f"{low}-{low + 3}")
    return low


def test_ports_come_in_turn_from_the_range_and_a_busy_one_is_skipped(span):
    first = [ports.free_port() for _ in range(4)]
    assert sorted(first) == [span, span + 1, span + 2, span + 3]  # each once before any again
    assert [first[(i + 1) % 4] - first[i] for i in range(3)] in ([1, 1, 1], [1, 1, -3], [1, -3, 1], [-3, 1, 1])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first[0]))
        holder.listen()
        assert first[0] not in [ports.free_port() for _ in range(6)]
        assert not ports.port_is_free("127.0.0.1", first[0])


def test_a_range_with_every_port_busy_is_one_error_naming_the_variable(span, monkeypatch):
    monkeypatch.setattr(ports, "port_is_free", lambda host, port: False)
    with pytest.raises(ConfigError, match=f"{ports.PORT_RANGE_ENV}: no free port in {span}-{span + 3}"):
        ports.free_port()


@pytest.mark.parametrize("raw", ["20000", "20010-20000", "a-b", "80-90", "20000-70000"])
def test_a_malformed_range_is_one_error_with_the_fix(raw):
    with pytest.raises(ConfigError, match=f"{ports.PORT_RANGE_ENV}: .*not a port range.*LOW-HIGH"):
        ports.port_range(raw)


def test_without_a_range_the_os_picks(monkeypatch):
    monkeypatch.delenv(ports.PORT_RANGE_ENV, raising=False)
    assert ports.port_range() is None
    port = ports.free_port()
    assert 1024 <= port <= 65535 and ports.port_is_free("127.0.0.1", port)
