"""``pdserve keys add`` / ``revoke`` (launch/keys.py) through the ``pdserve`` entry point: a key
printed once that then authenticates, the file kept byte for byte around its keys array, and
every refusal leaving the file as it was."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pdserve.gateway.tenancy.tenants import hash_key, load_tenants
from pdserve.launch import keys as keys_cli
from pdserve.launch.cli import main

OLD = "pdsk-old"
H_OLD = hash_key(OLD)
H_OTHER = hash_key("pdsk-other")
TEXT = f"""\
# tenants of the staging cluster
[tenants.acme]   # the big one
tier = "premium"
requests_per_minute = 600   # agreed in March
keys = [
    "{H_OLD}",  # alice's laptop
]

# batch jobs
[tenants.jobs]
tier = "batch"
keys = ["{H_OTHER}"]  # cron

[tenants.new]
max_tokens = 100
"""
KEY = re.compile(r"pdsk-[A-Za-z0-9_-]{43}")
Cap = pytest.CaptureFixture[str]
MP = pytest.MonkeyPatch


@pytest.fixture
def path(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(TEXT)
    path.chmod(0o640)
    return path


def keys(capsys: Cap, *argv: str) -> tuple[int, str, str]:
    rc = main(["keys", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def add(capsys: Cap, path: Path, tenant: str) -> str:
    rc, out, err = keys(capsys, "add", tenant, "--tenants", str(path))
    assert rc == 0, err
    assert KEY.fullmatch(out.strip()) and out.count("\n") == 1
    key = out.strip()
    assert f"a new key of tenant {tenant!r} ({hash_key(key)}), shown this once only" in err
    return key


def test_add_prints_a_key_that_then_authenticates(capsys: Cap, path: Path) -> None:
    key = add(capsys, path, "acme")
    tenants = load_tenants(path)
    assert tenants.lookup(key) is tenants["acme"]
    assert tenants["acme"].key_hashes == (H_OLD, hash_key(key))
    assert tenants.lookup(OLD) is tenants["acme"]
    text = path.read_text()
    assert key not in text
    laptop = "  # alice's laptop\n"
    assert text == TEXT.replace(f"{laptop}]", f'{laptop}    "{hash_key(key)}",\n]')


def test_add_keeps_every_other_byte_mode_and_no_stray_file(capsys: Cap, path: Path) -> None:
    first = add(capsys, path, "jobs")
    second = add(capsys, path, "new")
    assert first != second
    expected = TEXT.replace(
        f'keys = ["{H_OTHER}"]  # cron', f'keys = ["{H_OTHER}", "{hash_key(first)}"]  # cron'
    ).replace("[tenants.new]\n", f'[tenants.new]\nkeys = ["{hash_key(second)}"]\n')
    assert path.read_text() == expected
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in path.parent.iterdir()) == ["tenants.toml"]
    tenants = load_tenants(path)
    assert tenants.lookup(first) is tenants["jobs"] and tenants.lookup(second) is tenants["new"]
    assert tenants["new"].max_tokens == 100


def test_add_through_a_link_edits_the_file_it_points_to(capsys: Cap, path: Path) -> None:
    link = path.parent / "link.toml"
    link.symlink_to(path.name)
    key = add(capsys, link, "acme")
    assert link.is_symlink() and load_tenants(path).lookup(key) is not None


def test_revoke_by_key(capsys: Cap, path: Path) -> None:
    new = add(capsys, path, "acme")
    rc, out, err = keys(capsys, "revoke", OLD, "--tenants", str(path))
    assert (rc, err) == (0, "")
    assert out == f"pdserve keys: {path}: revoked {H_OLD} of tenant 'acme'\n"
    tenants = load_tenants(path)
    assert tenants.lookup(OLD) is None and tenants.lookup(new) is tenants["acme"]
    # the key's own line goes, with its comment; the rest stays
    assert path.read_text() == TEXT.replace(
        f'    "{H_OLD}",  # alice\'s laptop\n', f'    "{hash_key(new)}",\n'
    )


def test_revoke_by_hash(capsys: Cap, path: Path) -> None:
    rc, out, _ = keys(capsys, "revoke", "--tenants", str(path), H_OTHER)
    assert rc == 0 and out == f"pdserve keys: {path}: revoked {H_OTHER} of tenant 'jobs'\n"
    assert path.read_text() == TEXT.replace(f'keys = ["{H_OTHER}"]', "keys = []")
    assert load_tenants(path).lookup("pdsk-other") is None
    assert path.stat().st_mode & 0o777 == 0o640


def refused(capsys: Cap, path: Path, *argv: str) -> str:
    before = path.read_bytes()
    rc, out, err = keys(capsys, *argv, "--tenants", str(path))
    assert (rc, out) == (1, "")
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    return err


def test_an_unknown_tenant_is_refused(capsys: Cap, path: Path) -> None:
    err = refused(capsys, path, "add", "nobody")
    assert err == (
        f"pdserve keys add: {path}: no tenant 'nobody' (there are: acme, jobs, new); "
        "add its table first\n"
    )


def test_revoking_an_unknown_key_is_refused_and_never_shows_it(capsys: Cap, path: Path) -> None:
    err = refused(capsys, path, "revoke", "pdsk-SECRET")
    assert err == f"pdserve keys revoke: {path}: no tenant has the key {hash_key('pdsk-SECRET')}\n"
    unknown = "sha256:" + "0" * 64
    err = refused(capsys, path, "revoke", unknown)
    assert err == f"pdserve keys revoke: {path}: no tenant has the key {unknown}\n"


def test_a_malformed_file_is_refused_with_its_line(capsys: Cap, path: Path) -> None:
    path.write_text(TEXT.replace("max_tokens = 100", "max_tokens = 0"))
    err = refused(capsys, path, "add", "acme")
    assert err.startswith(f"pdserve keys add: {path}:15: tenant 'new': max_tokens must be")
    err = refused(capsys, path, "revoke", OLD)
    assert err.startswith(f"pdserve keys revoke: {path}:15: tenant 'new'")


def test_a_missing_file_is_refused(capsys: Cap, tmp_path: Path) -> None:
    rc, _, err = keys(capsys, "add", "acme", "--tenants", str(tmp_path / "nope.toml"))
    assert rc == 1
    missing = tmp_path / "nope.toml"
    assert err == f"pdserve keys add: {missing}: cannot read it: No such file or directory\n"
    assert not (tmp_path / "nope.toml").exists()


def test_a_tenant_not_written_as_a_table_is_left_to_the_hand(capsys: Cap, path: Path) -> None:
    path.write_text(f'[tenants]\nacme = {{ keys = ["{H_OLD}"] }}\n')
    err = refused(capsys, path, "add", "acme")
    assert err == "pdserve keys add: tenant 'acme' is not written as a [tenants.acme] table\n"
    err = refused(capsys, path, "revoke", OLD)
    assert err == "pdserve keys revoke: tenant 'acme' is not written as a [tenants.acme] table\n"


def test_an_edit_that_would_change_more_is_refused(
    capsys: Cap, path: Path, monkeypatch: MP
) -> None:
    """The check before the file is replaced: an edit must load as exactly what was meant."""
    monkeypatch.setattr(keys_cli, "add_key_hash", lambda text, t, h: text.replace("600", "60"))
    err = refused(capsys, path, "add", "acme")
    assert err == (
        f"pdserve keys add: {path}: the edit would change more than that key; edit it by hand\n"
    )
    monkeypatch.setattr(keys_cli, "add_key_hash", lambda text, t, h: text + "[tenants.acme]\n")
    err = refused(capsys, path, "add", "acme")
    assert err.startswith(f"pdserve keys add: {path}: the edit would not load (not valid TOML: ")


def test_a_file_changed_during_the_edit_is_not_overwritten(
    capsys: Cap, path: Path, monkeypatch: MP
) -> None:
    real = keys_cli.add_key_hash

    def edit_and_race(text: str, tenant: str, digest: str) -> str:
        path.write_text(TEXT + "\n# someone else's edit\n")  # another `keys add`, say
        return real(text, tenant, digest)

    monkeypatch.setattr(keys_cli, "add_key_hash", edit_and_race)
    rc, _, err = keys(capsys, "add", "acme", "--tenants", str(path))
    assert rc == 1
    assert err == (
        f"pdserve keys add: {path} changed while it was being edited: run the command again\n"
    )
    assert path.read_text() == TEXT + "\n# someone else's edit\n"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_new_keys_are_random_and_url_safe() -> None:
    made = {keys_cli.new_key() for _ in range(100)}
    assert len(made) == 100 and all(KEY.fullmatch(k) for k in made)


def test_keys_needs_an_action_and_a_file(capsys: Cap) -> None:
    for argv in (["keys"], ["keys", "add", "acme"], ["keys", "revoke", "--tenants", "f"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "required" in capsys.readouterr().err


def test_os_file_modes_of_a_0600_file_stay(capsys: Cap, path: Path) -> None:
    os.chmod(path, 0o600)
    add(capsys, path, "acme")
    assert path.stat().st_mode & 0o777 == 0o600
