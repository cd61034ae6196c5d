"""Command-line errors a user can act on (issue 49): flags named as flags, sizes with what
they hold, the URL that could not be reached. Each runs the real entry point's ``main``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcentric import cli
from kvcentric.router import cli as router_cli
from kvcentric.testing.servers import free_port


@pytest.mark.parametrize("flags, words", [
    (["--disk-path", "/tmp/kvc-disk"], "kvcentric store serve: --disk-path needs "
                                       "--disk-capacity, the disk tier's bound (e.g. "
                                       "--disk-capacity 500gb)"),
    (["--disk-capacity", "2tb"], "kvcentric store serve: --disk-capacity needs --disk-path"),
])
def test_store_serve_names_the_missing_flag(flags: list[str], words: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["store", "serve", "--name", "kvc-flag-test", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "store.disk" not in err


def test_a_tiny_store_capacity_is_warned(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["store", "serve", "--capacity", "8"])
    assert cli._store_cfg(args).local.capacity_bytes == 8
    err = capsys.readouterr().err
    assert "warning: --capacity 8 is 8 bytes" in err and "give it a few GiB" in err
    assert "--capacity 8gb" in err
    args = cli.build_parser().parse_args(["store", "serve", "--capacity", "4gb"])
    cli._store_cfg(args)
    assert capsys.readouterr().err == ""


def test_profile_against_a_down_engine_names_its_url(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = tmp_path / "profile.json"
    assert router_cli.main(["profile", "--url", url, "--model", "tiny", "--out",
                            str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcentric-router: cannot reach the engine at {url}: "), err
    assert "Connection refused" in err
    assert not out.exists()


def test_profile_without_a_scheme_says_the_expected_form(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert router_cli.main(["profile", "--url", "127.0.0.1:8100", "--model", "tiny",
                            "--out", str(tmp_path / "p.json")]) == 2
    assert "--url '127.0.0.1:8100' must be an engine's http://HOST:PORT" \
        in capsys.readouterr().err


def test_store_and_layout_names_say_the_form_not_the_pattern() -> None:
    from kvcentric.config import StoreConfig
    from kvcentric.stored_layout import KVLayout

    with pytest.raises(ValueError) as err:
        StoreConfig.from_dict({"name": "my store"})
    assert str(err.value) == ("store name 'my store' must be 1 to 64 letters, digits, '_', "
                              "'.' or '-'")
    with pytest.raises(ValueError) as err:
        KVLayout(2, 128, 2, 64, "float32", "a b")
    assert "layout name 'a b' must be 1 to 64 letters" in str(err.value)
    assert "{1,64}" not in str(err.value)
