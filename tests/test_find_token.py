"""The one token rule every front end uses (kernel_probe.find_token): given, else the
named variable, else PROBING_AUTH_TOKEN."""

from __future__ import annotations

import pytest

import kernel_probe


def test_given_then_named_variable_then_the_default(monkeypatch):
    monkeypatch.delenv("PROBING_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("MY_TOKEN", raising=False)
    assert kernel_probe.find_token() is None
    monkeypatch.setenv("PROBING_AUTH_TOKEN", "default")
    assert kernel_probe.find_token() == "default"
    monkeypatch.setenv("MY_TOKEN", "named")
    assert kernel_probe.find_token(token_env="MY_TOKEN") == "named"
    assert kernel_probe.find_token("given", token_env="MY_TOKEN") == "given"


def test_a_named_variable_that_is_not_set_is_an_error(monkeypatch):
    monkeypatch.setenv("PROBING_AUTH_TOKEN", "default")  # never a silent fallback
    monkeypatch.setenv("EMPTY_TOKEN", "")
    for var in ("PROBING_TEST_UNSET_VAR", "EMPTY_TOKEN"):
        monkeypatch.delenv("PROBING_TEST_UNSET_VAR", raising=False)
        with pytest.raises(ValueError, match=f"{var} is not set"):
            kernel_probe.find_token(token_env=var)


def test_resolve_signs_with_the_same_rule(monkeypatch, tmp_path):
    from kernel_probe import wire
    from kernel_probe.client.targets import resolve

    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("PROBING_AUTH_TOKEN", "default")
    assert resolve("tcp://127.0.0.1:9").key == wire.derive_key("default", "")
    assert resolve("tcp://127.0.0.1:9", "given").key == wire.derive_key("given", "")
