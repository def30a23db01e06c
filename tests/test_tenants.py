"""The tenants file (gateway/tenancy/tenants.py): every malformed file refused with its line and
reason, lookups by key, the unlimited tenant of --api-key, and reloads that keep the old
tenants."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.gateway.tenancy.tenants import (
    MAX_FILE_BYTES,
    MAX_KEYS_PER_TENANT,
    MAX_TENANTS,
    FieldError,
    Tenant,
    Tenants,
    TenantsError,
    TenantsFile,
    Tier,
    hash_key,
    load_tenants,
)

H1, H2 = hash_key("pdsk-one"), hash_key("pdsk-two")
HA = "sha256:" + "a" * 64
LIMIT = "must be an integer >= 1 (leave it out for no limit)"
NOT_HASH = (
    "is not 'sha256:' and 64 lowercase hex digits (the file holds hashes only; "
    "`pdserve keys add` writes them)"
)
WEIGHT = "weight must be a number from 0.001 to 1000"
FIELDS = "tier, requests_per_minute, tokens_per_minute, max_concurrent, max_tokens, weight, keys"

GOOD = f"""\
# two tenants
[tenants.acme]
tier = "premium"
requests_per_minute = 600
tokens_per_minute = 200000
max_concurrent = 16
max_tokens = 4096
weight = 2.5
keys = ["{H1}"]

[tenants."batch.jobs"]
tier = "batch"
keys = [
    "{H2}",  # the nightly job
]
"""


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "tenants.toml"
    if isinstance(text, str):
        text = text.encode("utf-8")
    path.write_bytes(text)
    return path


def refused(tmp_path: Path, text: str | bytes) -> TenantsError:
    path = write(tmp_path, text)
    with pytest.raises(TenantsError) as info:
        load_tenants(path)
    assert info.value.path == str(path)
    where = f"{path}:{info.value.line}" if info.value.line is not None else str(path)
    assert str(info.value) == f"{where}: {info.value.reason}"
    return info.value


def test_a_good_file_loads_every_field(tmp_path: Path) -> None:
    tenants = load_tenants(write(tmp_path, GOOD))
    assert [t.name for t in tenants] == ["acme", "batch.jobs"]
    assert tenants["acme"] == Tenant(
        name="acme",
        tier=Tier.PREMIUM,
        requests_per_minute=600,
        tokens_per_minute=200000,
        max_concurrent=16,
        max_tokens=4096,
        weight=2.5,
        key_hashes=(H1,),
    )
    assert tenants["batch.jobs"] == Tenant(name="batch.jobs", tier=Tier.BATCH, key_hashes=(H2,))
    assert len(tenants) == 2 and tenants.key_count == 2 and "acme" in tenants


def test_absent_fields_mean_standard_no_limit_weight_one_no_key(tmp_path: Path) -> None:
    tenant = load_tenants(write(tmp_path, "[tenants.t]\n"))["t"]
    assert tenant == Tenant(name="t")
    assert (tenant.tier, tenant.weight, tenant.key_hashes) == (Tier.STANDARD, 1, ())
    assert tenant.requests_per_minute is tenant.tokens_per_minute is None
    assert tenant.max_concurrent is tenant.max_tokens is None


def test_tiers_are_ordered_premium_standard_batch() -> None:
    assert Tier.PREMIUM > Tier.STANDARD > Tier.BATCH
    assert sorted([Tier.STANDARD, Tier.PREMIUM, Tier.BATCH], reverse=True) == [
        Tier.PREMIUM,
        Tier.STANDARD,
        Tier.BATCH,
    ]
    assert max(Tier) is Tier.PREMIUM and Tier.BATCH.rank == 0


def test_lookup_by_the_key_itself_never_by_its_hash(tmp_path: Path) -> None:
    tenants = load_tenants(write(tmp_path, GOOD))
    assert tenants.lookup("pdsk-one") is tenants["acme"]
    assert tenants.lookup(b"pdsk-two") is tenants["batch.jobs"]
    assert tenants.lookup("pdsk-three") is None
    assert tenants.lookup("") is None and tenants.lookup(b"") is None
    assert tenants.lookup(H1) is None  # the file's contents are no key
    assert tenants.lookup("pdsk-one ") is None
    assert tenants.holder(H2) is tenants["batch.jobs"] and tenants.holder(HA) is None


def test_hash_key_is_sha256_in_lowercase_hex() -> None:
    assert hash_key("test") == (
        "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    )
    assert hash_key(b"test") == hash_key("test")


def test_the_unlimited_tenant_of_api_keys() -> None:
    tenants = Tenants.unlimited(["k1", "k2", "k1"])
    (tenant,) = tenants
    assert tenant == Tenant(name="default", key_hashes=(hash_key("k1"), hash_key("k2")))
    assert tenants.lookup("k1") is tenant and tenants.lookup(b"k2") is tenant
    assert tenants.lookup("k3") is None and tenants.key_count == 2
    assert tenant.requests_per_minute is tenant.tokens_per_minute is tenant.max_tokens is None


def test_a_tenant_made_in_code_is_checked_too() -> None:
    with pytest.raises(FieldError) as info:
        Tenant(name="t", max_tokens=0)
    assert str(info.value) == f"tenant 't': max_tokens {LIMIT}, got 0"
    assert (info.value.tenant, info.value.field) == ("t", "max_tokens")
    with pytest.raises(FieldError) as info:
        Tenant(name="t", tier="premium")  # type: ignore[arg-type]
    assert str(info.value) == "tenant 't': tier must be a Tier, got 'premium'"
    with pytest.raises(FieldError) as info:
        Tenants([Tenant(name="t"), Tenant(name="t")])
    assert str(info.value) == "tenant 't': defined twice"


@pytest.mark.parametrize(
    "text, line, reason",
    [
        ("[tenants.acme]\ntier = \n", 2, "not valid TOML: Invalid value (column 8)"),
        (f'[tenants.a]\nkeys = ["{HA}",\n', 3, "not valid TOML: Invalid value at the end"),
        (
            "[tenants.a]\n[tenants.a]\n",
            2,
            "not valid TOML: Cannot declare ('tenants', 'a') twice (column 11)",
        ),
    ],
)
def test_not_toml(tmp_path: Path, text: str, line: int, reason: str) -> None:
    error = refused(tmp_path, text)
    assert (error.line, error.reason) == (line, reason)


def test_not_utf8(tmp_path: Path) -> None:
    error = refused(tmp_path, b"[tenants.a]\n# caf\xe9\n")
    assert (error.line, error.reason) == (2, "not UTF-8 (at byte offset 17)")


@pytest.mark.parametrize(
    "text, line, reason",
    [
        ("", None, "no [tenants] table: write each tenant as [tenants.NAME]"),
        ("# only a comment\n", None, "no [tenants] table: write each tenant as [tenants.NAME]"),
        ("tenants = 1\n", 1, "tenants is not a table: write each tenant as [tenants.NAME]"),
        (
            '[[tenants]]\nname = "a"\n',
            1,
            "tenants is not a table: write each tenant as [tenants.NAME]",
        ),
        ("# none yet\n[tenants]\n", 2, "no tenant: add a [tenants.NAME] table"),
        (
            "# c\nfoo = 1\n[tenants.a]\n",
            2,
            "unknown top-level field 'foo': only [tenants.NAME] tables",
        ),
        (
            "[tenants.a]\n[limits]\nx = 1\n",
            2,
            "unknown top-level field 'limits': only [tenants.NAME] tables",
        ),
    ],
)
def test_the_tenants_table(tmp_path: Path, text: str, line: int | None, reason: str) -> None:
    error = refused(tmp_path, text)
    assert (error.line, error.reason) == (line, reason)


@pytest.mark.parametrize(
    "body, reason",
    [
        ("rpm = 5", f"unknown field 'rpm' (known: {FIELDS})"),
        ("Tier = 'batch'", f"unknown field 'Tier' (known: {FIELDS})"),
        ("requests_per_minute = true", f"requests_per_minute {LIMIT}, got true"),
        ("tokens_per_minute = 1.5", f"tokens_per_minute {LIMIT}, got 1.5"),
        ("max_concurrent = '16'", f"max_concurrent {LIMIT}, got '16'"),
        ("max_tokens = [4096]", f"max_tokens {LIMIT}, got [4096]"),
        ("requests_per_minute = 0", f"requests_per_minute {LIMIT}, got 0"),
        ("tokens_per_minute = 0", f"tokens_per_minute {LIMIT}, got 0"),
        ("max_concurrent = 0", f"max_concurrent {LIMIT}, got 0"),
        ("max_tokens = -1", f"max_tokens {LIMIT}, got -1"),
        ("tier = 'gold'", "tier must be one of premium, standard, batch, got 'gold'"),
        ("tier = 'Premium'", "tier must be one of premium, standard, batch, got 'Premium'"),
        ("tier = 1", "tier must be one of premium, standard, batch, got 1"),
        ("tier = ['batch']", "tier must be one of premium, standard, batch, got ['batch']"),
        ("weight = 0", f"{WEIGHT}, got 0"),
        ("weight = -1.0", f"{WEIGHT}, got -1.0"),
        ("weight = 1e4", f"{WEIGHT}, got 10000.0"),
        ("weight = 0.0001", f"{WEIGHT}, got 0.0001"),
        ("weight = nan", f"{WEIGHT}, got nan"),
        ("weight = inf", f"{WEIGHT}, got inf"),
        ("weight = true", f"{WEIGHT}, got true"),
        ("weight = '2'", f"{WEIGHT}, got '2'"),
        (f"keys = '{HA}'", "keys must be an array of strings, got a str"),
        ("keys = [1]", "keys[0] must be a string, got int"),
        (f"keys = ['{HA}', ['{HA}']]", "keys[1] must be a string, got list"),
        (f"keys = ['{HA.upper()}']", f"keys[0] {NOT_HASH}"),
        (f"keys = ['{HA}', '{HA[:-1]}']", f"keys[1] {NOT_HASH}"),
        (f"keys = ['{HA}0']", f"keys[0] {NOT_HASH}"),
        (f"keys = ['sha512:{'a' * 64}']", f"keys[0] {NOT_HASH}"),
        (f"keys = [' {HA}']", f"keys[0] {NOT_HASH}"),
        (f"keys = ['{hash_key('')}']", "keys[0] is the hash of an empty key"),
        (f"keys = ['{HA}', '{H1}', '{HA}']", "keys[2] repeats keys[0]"),
    ],
)
def test_a_bad_field_names_its_tenant_line_and_reason(
    tmp_path: Path, body: str, reason: str
) -> None:
    error = refused(tmp_path, f"# acme\n[tenants.acme]  # ours\n\n{body}  # a limit\n")
    assert (error.line, error.reason) == (4, f"tenant 'acme': {reason}")


def test_a_plaintext_key_in_the_file_is_never_shown(tmp_path: Path) -> None:
    for keys in ('["pdsk-SECRET"]', '"pdsk-SECRET"'):
        error = refused(tmp_path, f"[tenants.acme]\nkeys = {keys}\n")
        assert "SECRET" not in str(error) and error.line == 2


def test_the_same_key_in_two_tenants(tmp_path: Path) -> None:
    text = f'[tenants.a]\nkeys = ["{HA}"]\n\n[tenants.b]\ntier = "batch"\nkeys = ["{H1}", "{HA}"]\n'
    error = refused(tmp_path, text)
    assert (error.line, error.reason) == (6, "tenant 'b': keys[1] is a key of tenant 'a' too")


@pytest.mark.parametrize(
    "header, name",
    [
        ('[tenants."a b"]', "a b"),
        ('[tenants.""]', ""),
        ("[tenants.'a/b']", "a/b"),
        (f"[tenants.{'x' * 65}]", "x" * 65),
        ('[tenants."é"]', "é"),
    ],
)
def test_a_tenant_name_outside_the_alphabet(tmp_path: Path, header: str, name: str) -> None:
    error = refused(tmp_path, f"[tenants.ok]\n{header}\nmax_tokens = 5\n")
    shown = repr(name) if len(name) < 30 else "'" + "x" * 36 + "..."
    reason = f"tenant {shown}: a tenant's name is 1 to 64 of A-Z a-z 0-9 _ . -"
    assert (error.line, error.reason) == (2, reason)


def test_names_at_the_edge_of_the_alphabet_load(tmp_path: Path) -> None:
    names = ["x" * 64, "a.b", "A_9-z"]
    text = "".join(f'[tenants."{n}"]\n' for n in names)
    assert [t.name for t in load_tenants(write(tmp_path, text))] == names


@pytest.mark.parametrize(
    "text, line, reason",
    [
        ("[tenants]\nacme = 1\n", 2, "tenant 'acme': must be a table of fields, got 1"),
        ("[tenants]\nacme = { max_tokens = 0 }\n", 2, f"tenant 'acme': max_tokens {LIMIT}, got 0"),
        (
            "tenants.acme.tier = 'x'\n",
            1,
            "tenant 'acme': tier must be one of premium, standard, batch, got 'x'",
        ),
        (
            "[tenants.acme]\n[tenants.acme.limits]\nx = 1\n",
            1,
            f"tenant 'acme': unknown field 'limits' (known: {FIELDS})",
        ),
    ],
)
def test_tenants_written_otherwise(tmp_path: Path, text: str, line: int, reason: str) -> None:
    error = refused(tmp_path, text)
    assert (error.line, error.reason) == (line, reason)


def test_bounds_of_size_tenants_and_keys(tmp_path: Path) -> None:
    big = "[tenants.a]\n" + "#" * MAX_FILE_BYTES + "\n"
    assert refused(tmp_path, big).reason == "larger than 1 MiB"
    assert (tmp_path / "tenants.toml").stat().st_size > MAX_FILE_BYTES
    just = "[tenants.a]\n#"
    assert len(load_tenants(write(tmp_path, just + "#" * (MAX_FILE_BYTES - len(just))))) == 1

    many = "".join(f"[tenants.t{i}]\n" for i in range(MAX_TENANTS + 1))
    assert refused(tmp_path, many).reason == f"more than {MAX_TENANTS} tenants (4097)"
    assert len(load_tenants(write(tmp_path, many.rsplit("[", 1)[0]))) == MAX_TENANTS

    keys = [hash_key(str(i)) for i in range(MAX_KEYS_PER_TENANT + 1)]
    text = "[tenants.a]\nkeys = [\n" + "".join(f'"{k}",\n' for k in keys) + "]\n"
    error = refused(tmp_path, text)
    assert (error.line, error.reason) == (2, "tenant 'a': more than 1024 keys (1025)")
    text = text.replace(f'"{keys[-1]}",\n', "")
    assert load_tenants(write(tmp_path, text)).key_count == MAX_KEYS_PER_TENANT


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TenantsError) as info:
        load_tenants(tmp_path / "nope.toml")
    assert info.value.reason == "cannot read it: No such file or directory"
    assert info.value.line is None


def test_reload_swaps_a_good_file_and_keeps_the_old_on_a_bad_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, GOOD)
    holder = TenantsFile(path)
    admitted = holder.tenants.lookup("pdsk-one")  # what a stream in flight holds
    assert admitted is not None and admitted.max_tokens == 4096

    path.write_text(GOOD.replace("max_tokens = 4096", "max_tokens = 512"))
    assert holder.reload() is None
    assert holder.tenants["acme"].max_tokens == 512
    assert admitted.max_tokens == 4096  # the stream's own tenant is untouched
    good = holder.tenants

    path.write_text(GOOD.replace("max_tokens = 4096", "max_tokens = 0"))
    with caplog.at_level(logging.ERROR, logger="pdserve.gateway.tenancy.tenants"):
        error = holder.reload()
    assert error is not None and error.line == 7
    assert error.reason == f"tenant 'acme': max_tokens {LIMIT}, got 0"
    assert holder.tenants is good
    assert f"the previous one stays in force: {error}" in caplog.text

    path.unlink()
    error = holder.reload()
    assert error is not None and error.reason.startswith("cannot read it")
    assert holder.tenants is good and holder.tenants.lookup("pdsk-one") is good["acme"]


def test_a_bad_file_at_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TenantsError, match=r"tenants.toml:2: tenant 'a': unknown field 'x'"):
        TenantsFile(write(tmp_path, "[tenants.a]\nx = 1\n"))


def test_the_readme_example_loads(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Tenants, rate limits and usage\n", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    tenant = load_tenants(write(tmp_path, example))["acme"]
    assert (tenant.tier, tenant.max_concurrent, tenant.weight) == (Tier.STANDARD, 16, 1)
    assert len(tenant.key_hashes) == 1
