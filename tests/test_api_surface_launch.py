"""The API flags from the command line: the gateway's (--model-alias, --chat-template, CORS),
``pdserve serve``'s (several --served-model-name, --api-key, --chat-template), and one real
cluster started with them all."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.chat_template import load_chat_template, tokenizer_loader
from pdserve.gateway.config import GatewayConfig, config_from_args
from pdserve.gateway.main import add_gateway_args, run_gateway
from pdserve.launch.serve import add_serve_args, worker_commands
from pdserve.launch.serve_api import gateway_api_flags
from tests.e2e_util import ServedCluster

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_load_chat_template(tmp_path: Path, tiny_dir: Path) -> None:
    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(file)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE  # no such file, and it looks like Jinja
    assert load_chat_template("{{ raise_exception('no') }}")  # fails on a chat, not a syntax
    for value, message in [
        ("missing.jinja", "cannot read the chat template file missing.jinja"),
        ("{% for m in messages %}", "the chat template is not valid Jinja: Unexpected end"),
        ("\n", "the chat template is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_chat_template(value)
    tok = tokenizer_loader(TEMPLATE)(str(tiny_dir))
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat) == "[user] Hi\n[assistant]"
    assert (
        tokenizer_loader(None)(str(tiny_dir)).apply_chat_template(chat) != "[user] Hi\n[assistant]"
    )


def gateway_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    return parser.parse_args(["--coordinator=tcp://127.0.0.1:1", *argv])


def test_gateway_api_flags(tmp_path: Path) -> None:
    config = config_from_args(
        gateway_args(
            "--model-alias=gpt-4o=tiny",
            "--model-alias=org/x=tiny",
            '--allowed-origins=["https://a.example", "https://b.example"]',
            "--allowed-methods=GET,POST",
            "--allow-credentials",
            f"--chat-template={TEMPLATE}",
        ),
        env={},
    )
    assert config.model_aliases == (("gpt-4o", "tiny"), ("org/x", "tiny"))
    assert config.allowed_origins == ("https://a.example", "https://b.example")
    assert (config.allowed_methods, config.allowed_headers) == (("GET", "POST"), ("*",))
    assert config.allow_credentials and config.chat_template == TEMPLATE
    assert config_from_args(gateway_args(), env={}).allowed_origins == ()  # CORS off by default
    with pytest.raises(SystemExit):
        gateway_args("--model-alias=tiny")
    for aliases in [(("a", "a"),), (("a", "b"), ("a", "c")), (("", "b"),)]:
        with pytest.raises(ValueError, match="a model alias must name a different model once"):
            GatewayConfig(model_aliases=aliases)
    # a broken template stops the gateway before it listens
    assert run_gateway(gateway_args("--chat-template={% if %}")) == 2


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["--model=tiny", *argv])


def test_serve_passes_the_api_flags(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-file\n", encoding="utf-8")
    args = serve_args(
        "--served-model-name", "alpha", "beta", "gamma",
        "--api-key=sk-one", f"--api-key-file={key_file}",
        f"--chat-template={TEMPLATE}", "--allowed-origins=https://a.example",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    flags = gateway_api_flags(args, run_dir)
    assert flags == [
        "--model-alias=beta=alpha",
        "--model-alias=gamma=alpha",
        f"--api-key-file={run_dir / 'api_keys'}",
        f"--chat-template={run_dir / 'chat_template.jinja'}",
        '--allowed-origins=["https://a.example"]',
        '--allowed-methods=["*"]',
        '--allowed-headers=["*"]',
    ]
    assert (run_dir / "api_keys").read_text() == "sk-one\nsk-file\n"
    assert stat.S_IMODE(os.stat(run_dir / "api_keys").st_mode) == 0o600
    assert (run_dir / "chat_template.jinja").read_text() == TEMPLATE
    assert all("sk-" not in flag for flag in flags)
    for cmd in worker_commands(args, "tcp://127.0.0.1:1", "/models/tiny"):
        assert [a for a in cmd if a.startswith("--served-model-name")] == [
            "--served-model-name=alpha"
        ]
    assert gateway_api_flags(serve_args(), tmp_path) == []
    for bad, message in [
        (["--served-model-name", "a", "a"], "a model alias must name a different model once"),
        (["--api-key=two words"], "an API key must be"),
        (["--chat-template={% for %}"], "not valid Jinja"),
        ([f"--tenants={tmp_path / 'none.toml'}"], "none.toml: cannot read it"),
        (["--rate-limit-store=redis://u:p@h:1"], "no user or password"),
        (["--rate-limit-gateways=0"], "--rate-limit-gateways must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            gateway_api_flags(serve_args(*bad), tmp_path)


def test_serve_passes_the_tenancy_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("t.toml").write_text("[tenants.acme]\ntokens_per_minute = 100\n", encoding="utf-8")
    args = serve_args(
        "--tenants=t.toml", "--usage-db=u.db", "--rate-limit-store=redis://10.0.0.9:6379/2",
        "--rate-limit-gateways=3",
    )  # fmt: skip
    assert gateway_api_flags(args, tmp_path) == [
        f"--tenants={tmp_path / 't.toml'}",
        "--rate-limit-store=redis://10.0.0.9:6379/2",
        "--rate-limit-gateways=3",
        f"--usage-db={tmp_path / 'u.db'}",
    ]
    Path("t.toml").write_text("[tenants.acme]\nmax_tokens = 0\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape("t.toml:2: tenant 'acme': max_tokens must be")):
        gateway_api_flags(args, tmp_path)


def test_serve_with_the_api_flags(tiny_dir: Path) -> None:
    """One real cluster: aliases, key, template and CORS reach the gateway through serve."""
    origin = "https://ui.example"
    c = ServedCluster(
        tiny_dir, "--num-kv-blocks=128", "--served-model-name", "alpha", "beta",
        "--api-key=sk-e2e", f"--chat-template={TEMPLATE}", f"--allowed-origins={origin}",
    )  # fmt: skip
    try:
        api = openai.OpenAI(base_url=f"{c.url}/v1", api_key="sk-e2e", max_retries=0)
        assert [m.id for m in api.models.list().data] == ["alpha", "beta"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{c.url}/v1", api_key="bad", max_retries=0).models.list()
        messages = [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ]
        out = api.chat.completions.create(model="beta", messages=messages, max_tokens=4)
        assert out.model == "alpha" and out.system_fingerprint.startswith("pdserve-")
        tok = Tokenizer.from_dir(tiny_dir)
        expected = tok.encode("[system] Be brief.\n[user] Hi\n[assistant]", False)
        assert out.usage.prompt_tokens == len(expected)
        auth = {"Authorization": "Bearer sk-e2e", "X-Request-Id": "e2e-1", "Origin": origin}
        r = httpx.post(f"{c.url}/tokenize", json={"model": "beta", "messages": messages},
                       headers=auth, timeout=30)  # fmt: skip
        assert r.json()["tokens"] == expected
        assert r.headers["x-request-id"] == "e2e-1"
        assert r.headers["access-control-allow-origin"] == origin
        assert not [cmd for cmd in _command_lines() if "gateway" in cmd and "sk-e2e" in cmd]
    finally:
        c.stop()


def _command_lines() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return out


def test_flags_are_json_lists_or_commas() -> None:
    from pdserve.gateway.config import list_arg

    assert list_arg('["a", "b"]') == ["a", "b"] == list_arg("a, b,")
    with pytest.raises(argparse.ArgumentTypeError):
        list_arg("[1, 2]")
    with pytest.raises(json.JSONDecodeError):
        list_arg("[oops")


def test_serve_forwards_switches_to_every_worker() -> None:
    """`serve --compile --enforce-eager --no-prefix-caching` reaches each worker's command
    (--compile was once accepted and dropped)."""
    args = serve_args("--compile", "--enforce-eager", "--no-prefix-caching")
    commands = worker_commands(args, "tcp://127.0.0.1:1", "/models/tiny")
    assert len(commands) == 2
    for cmd in commands:
        assert {"--compile", "--enforce-eager", "--no-prefix-caching"} <= set(cmd)
    for cmd in worker_commands(serve_args(), "tcp://127.0.0.1:1", "/models/tiny"):
        assert not {"--compile", "--enforce-eager", "--no-prefix-caching"} & set(cmd)
