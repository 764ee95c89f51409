"""The keys file: parsing, reloading on a fake clock, and what happens when it cannot be read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from carpool.runtime.api.auth import bearer_token, open_paths
from carpool.runtime.api.keys import KeyFile, KeyFileError, parse_keys
from carpool.runtime.config import ServerConfig
from tests.runtime.factories import FakeClock


def test_parse_keys_skips_blank_lines_and_comments() -> None:
    text = "# rotated 2026-01\n\n  key-one  \nkey-two\n   # indented comment\nkey-three\r\n"
    assert parse_keys(text) == ["key-one", "key-two", "key-three"]


def test_every_key_of_the_file_is_accepted_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("a-key\nb-key\nc-key\n")
    keys = KeyFile(tmp_path / "keys")
    assert keys.count == 3
    assert all(keys.accepts(key) for key in ("a-key", "b-key", "c-key"))
    assert not any(keys.accepts(guess) for guess in ("a-ke", "a-key ", "A-KEY", "", "b-keyc-key"))


def test_the_file_is_checked_at_most_once_per_interval(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("old\n")
    clock = FakeClock(100.0)
    keys = KeyFile(path, check_interval_s=1.0, clock=clock)
    path.write_text("new-and-longer\n")
    clock.advance(0.5)
    assert keys.accepts("old") and not keys.accepts("new-and-longer")  # not checked yet
    clock.advance(0.5)
    assert keys.accepts("new-and-longer") and not keys.accepts("old")


def test_an_unreadable_file_keeps_the_last_keys_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text("kept\n")
    clock = FakeClock()
    keys = KeyFile(path, clock=clock)
    path.unlink()
    with caplog.at_level(logging.WARNING, logger="carpool.runtime.api.keys"):
        for _ in range(3):
            clock.advance(1.0)
            assert keys.accepts("kept")
    assert len(caplog.records) == 1 and "keeping the previous keys" in caplog.text
    path.write_text("back\n")
    clock.advance(1.0)
    assert keys.accepts("back") and not keys.accepts("kept")


def test_an_emptied_file_revokes_every_key(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("gone-soon\n")
    clock = FakeClock()
    keys = KeyFile(path, clock=clock)
    path.write_text("# all revoked\n")
    clock.advance(1.0)
    assert not keys.accepts("gone-soon") and keys.count == 0


def test_keys_never_reach_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-secret-one\n")
    clock = FakeClock()
    with caplog.at_level(logging.DEBUG):
        keys = KeyFile(path, clock=clock)
        path.write_text("sk-secret-two\n")
        clock.advance(1.0)
        keys.accepts("sk-secret-one")
    assert caplog.records and "sk-secret" not in caplog.text


def test_start_up_refuses_a_missing_or_keyless_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match=r"absent: cannot read it"):
        KeyFile(tmp_path / "absent")
    (tmp_path / "blank").write_text("\n# nothing\n")
    with pytest.raises(KeyFileError, match="holds no key"):
        KeyFile(tmp_path / "blank")


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER  abc ", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("abc", None),
        (None, None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_metrics_is_open_only_while_it_shares_the_api_port() -> None:
    assert "/metrics" in open_paths(ServerConfig())
    assert "/metrics" not in open_paths(ServerConfig(metrics_port=9100))
    with pytest.raises(ValueError, match="must differ"):
        ServerConfig(port=9100, metrics_port=9100)
