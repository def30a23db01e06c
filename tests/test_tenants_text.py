"""The edits ``pdserve keys`` makes to a tenants file's text (gateway/tenancy/tenants_text.py):
exact results for each way a keys array can be written, each of which still loads."""

from __future__ import annotations

import pytest

from pdserve.gateway.tenancy.tenants import hash_key, parse_tenants
from pdserve.gateway.tenancy.tenants_text import (
    EditError,
    add_key_hash,
    remove_key_hash,
    table_span,
)

A, B, C, N = (hash_key(k) for k in "abcn")


def fill(template: str) -> str:
    return template.format(A=A, B=B, C=C, N=N)


def keys_of(text: str, tenant: str = "a") -> tuple[str, ...]:
    return parse_tenants(text, "t.toml")[tenant].key_hashes


@pytest.mark.parametrize(
    "before, after",
    [
        ('[tenants.a]\nkeys = ["{A}"]\n', '[tenants.a]\nkeys = ["{A}", "{N}"]\n'),
        ("[tenants.a]\nkeys = ['{A}']  # one\n", "[tenants.a]\nkeys = ['{A}', \"{N}\"]  # one\n"),
        ('[tenants.a]\nkeys = ["{A}",]\n', '[tenants.a]\nkeys = ["{A}", "{N}",]\n'),
        ("[tenants.a]\nkeys = []\n", '[tenants.a]\nkeys = ["{N}"]\n'),
        ("[tenants.a]\nkeys=[ ]\n", '[tenants.a]\nkeys=["{N}"]\n'),
        ('[tenants.a]\n"keys" = []\n', '[tenants.a]\n"keys" = ["{N}"]\n'),
        (
            '[tenants.a]\nkeys = [\n  "{A}"\n]\n',
            '[tenants.a]\nkeys = [\n  "{A}",\n  "{N}",\n]\n',
        ),
        (
            '[tenants.a]\nkeys = [\n\t"{A}",  # x\n\t"{B}"  # y\n]\n',
            '[tenants.a]\nkeys = [\n\t"{A}",  # x\n\t"{B}",  # y\n\t"{N}",\n]\n',
        ),
        (
            '[tenants.a]\nkeys = [\n  "{A}",\n  "{B}"]\n',
            '[tenants.a]\nkeys = [\n  "{A}",\n  "{B}", "{N}"]\n',
        ),
        (
            "[tenants.a]\n  keys = [  # none yet\n  ]\n",
            '[tenants.a]\n  keys = [  # none yet\n      "{N}",\n  ]\n',
        ),
        ("[tenants.a]", '[tenants.a]\nkeys = ["{N}"]\n'),
        (
            "[tenants.a]  # ours\ntier = 'batch'\n",
            '[tenants.a]  # ours\nkeys = ["{N}"]\ntier = \'batch\'\n',
        ),
        (
            '[tenants.a]\r\nkeys = [\r\n  "{A}",\r\n]\r\n',
            '[tenants.a]\r\nkeys = [\r\n  "{A}",\r\n  "{N}",\r\n]\r\n',
        ),
        # another tenant's keys, and a name that starts the same, are left alone
        (
            '[tenants.ab]\nkeys = ["{B}"]\n[ tenants . a ]\n[tenants.c]\nkeys = ["{C}"]\n',
            '[tenants.ab]\nkeys = ["{B}"]\n[ tenants . a ]\nkeys = ["{N}"]\n'
            '[tenants.c]\nkeys = ["{C}"]\n',
        ),
    ],
)  # fmt: skip
def test_add(before: str, after: str) -> None:
    before, after = fill(before), fill(after)
    assert add_key_hash(before, "a", N) == after
    assert keys_of(after) == (*keys_of(before), N)


def test_add_to_a_quoted_name() -> None:
    text = fill('[tenants."b.c"]\nkeys = ["{A}"]\n')
    assert add_key_hash(text, "b.c", N) == fill('[tenants."b.c"]\nkeys = ["{A}", "{N}"]\n')


@pytest.mark.parametrize(
    "before, gone, after",
    [
        ('keys = ["{A}", "{B}", "{C}"]', A, 'keys = ["{B}", "{C}"]'),
        ('keys = ["{A}", "{B}", "{C}"]', B, 'keys = ["{A}", "{C}"]'),
        ('keys = ["{A}", "{B}", "{C}"]', C, 'keys = ["{A}", "{B}"]'),
        ('keys = ["{A}",]  # one', A, "keys = []  # one"),
        ('keys = [ "{A}" ]', A, "keys = [  ]"),
        ('keys = [\n  "{A}",  # alice\n  "{B}",  # bob\n]', A, 'keys = [\n  "{B}",  # bob\n]'),
        ('keys = [\n  "{A}",  # alice\n  "{B}"  # bob\n]', B, 'keys = [\n  "{A}",  # alice\n]'),
        ('keys = ["{A}",\n  "{B}"]', B, 'keys = ["{A}"\n]'),
        ('keys = ["{A}",\n  "{B}"]', A, 'keys = [\n  "{B}"]'),
        ('keys = ["{A}", # alice\n  "{B}"]', B, 'keys = ["{A}" # alice\n]'),
        ('keys = [\r\n  "{A}",\r\n  "{B}",\r\n]', A, 'keys = [\r\n  "{B}",\r\n]'),
    ],
)  # fmt: skip
def test_remove(before: str, gone: str, after: str) -> None:
    before = fill(f"# tenants\n[tenants.a]\n{before}\n[tenants.b]\n")
    after = fill(f"# tenants\n[tenants.a]\n{after}\n[tenants.b]\n")
    assert remove_key_hash(before, "a", gone) == after
    assert keys_of(after) == tuple(k for k in keys_of(before) if k != gone)


def test_remove_a_key_written_with_escapes() -> None:
    text = '[tenants.a]\nkeys = ["' + A.replace("sha256:", "sha256\\u003a") + '"]\n'
    assert keys_of(text) == (A,)
    assert remove_key_hash(text, "a", A) == "[tenants.a]\nkeys = []\n"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("[tenants.a]\nkeys = []\n", f"tenant 'a' has no key {A} in its keys array"),
        ("[tenants.a]\n", f"tenant 'a' has no key {A} in its keys array"),
        ("[tenants]\na = {{ keys = [] }}\n", "tenant 'a' is not written as a [tenants.a] table"),
        ('[tenants.a]\nkeys = ["""{A}"""]\n', "keys holds a multi-line string"),
    ],
)
def test_what_is_not_edited(text: str, reason: str) -> None:
    with pytest.raises(EditError) as info:
        remove_key_hash(fill(text), "a", A)
    assert str(info.value) == reason


def test_table_span_ends_at_the_next_header() -> None:
    text = "# x\n[tenants.a]\nmax_tokens = 1\n\n[tenants.b]\n"
    assert table_span(text, "a") == (4, text.index("[tenants.b]"))
    assert table_span(text, "b") == (text.index("[tenants.b]"), len(text))
    assert table_span(text, "c") is None
    assert table_span("[tenants.a.b]\n", "a") is None
