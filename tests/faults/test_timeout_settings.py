"""The fault-related settings: defaults, and refusal of nonsense (pure, no network)."""
from __future__ import annotations

import pytest

from cubegate.settings import SettingsError, load_settings


def _load(tmp_path, text: str):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return load_settings(p)


def test_timeouts_have_bounded_defaults(tmp_path):
    proxy = _load(tmp_path, "{}").proxy
    for name in ("connect_timeout", "idle_timeout", "header_timeout", "upstream_timeout"):
        assert 0 < getattr(proxy, name) <= 600, name
    assert proxy.header_timeout < proxy.idle_timeout


@pytest.mark.parametrize("name", ["connect_timeout", "idle_timeout", "header_timeout", "upstream_timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "'soon'", "true"])
def test_timeouts_must_be_positive_numbers(tmp_path, name, value):
    with pytest.raises(SettingsError, match=f"proxy.{name}"):
        _load(tmp_path, f"proxy: {{{name}: {value}}}")
