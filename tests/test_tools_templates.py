"""Chat templates with tools (make-model's families, SmolLM2's converted one): rendered by
``engine.tokenizer`` exactly as transformers renders them, and, without tools, exactly as the
plain templates they replace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.openai_models import ChatCompletionRequest
from pdserve.gateway.tools.request import template_features
from pdserve.models.gguf_convert import convert_gguf, tool_chat_template
from pdserve.models.make_model import make_model

FAMILIES = ("chatml", "hermes", "llama3")
# HuggingFaceTB/SmolLM2-*-Instruct's template, as its GGUF carries it
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter ☀ in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "now"}}]
PLAIN = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "Τέσσερα; 四 😀"},
    ],
    [{"role": "user", "content": "multi\nline  "}, {"role": "assistant", "content": ""}],
]


def conversation(system: bool) -> list[dict]:
    """An OpenAI chat with two parallel calls and their results, as the gateway hands it over."""
    call = {"name": "get_weather", "arguments": '{"city": "Köln"}'}
    body = {
        "model": "m",
        "messages": [
            *([{"role": "system", "content": "Be brief."}] if system else []),
            {"role": "user", "content": "Weather in Köln and the time?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "type": "function", "function": call},
                    {"id": "b", "type": "function", "function": {"name": "now", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "18 C"},
            {"role": "tool", "tool_call_id": "b", "content": "12:00"},
        ],
    }
    return ChatCompletionRequest.model_validate(body).template_messages()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool_templates")
    out = {t: make_model(root / t, template=t) for t in FAMILIES}
    out["qwen-hermes"] = make_model(root / "qwen-hermes", arch="qwen2")  # no bos in the template
    for name, template in (("smollm2", SMOLLM2), ("smollm2-tools", tool_chat_template(SMOLLM2))):
        d = root / name
        shutil.copytree(out["qwen-hermes"], d)
        config = json.loads((d / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        out[name] = d
    return out


def both(d: Path, messages: list[dict], tools: list[dict] | None) -> tuple[str, str]:
    ours = Tokenizer.from_dir(d).apply_chat_template(messages, tools=tools)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    theirs = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return ours, theirs


@pytest.mark.parametrize("name", ["hermes", "llama3", "qwen-hermes", "smollm2-tools"])
def test_tools_render_as_transformers_renders_them(name: str, dirs: dict[str, Path]) -> None:
    for system in (True, False):
        ours, theirs = both(dirs[name], conversation(system), TOOLS)
        assert ours == theirs
        assert "Wetter ☀ in a city" in ours and "18 C" in ours and "12:00" in ours
        assert '"city": "Köln"' in ours  # the arguments string went in as an object
        assert ("Be brief." in ours) == system


def test_hermes_prompt_text(dirs: dict[str, Path]) -> None:
    text = Tokenizer.from_dir(dirs["hermes"]).apply_chat_template(conversation(False), tools=TOOLS)
    tools_json = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
    assert text.startswith("<|begin_of_text|><|im_start|>system\n# Tools\n\n")
    assert f"<tools>\n{tools_json}\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Köln and the time?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_prompt_text(dirs: dict[str, Path]) -> None:
    text = Tokenizer.from_dir(dirs["llama3"]).apply_chat_template(conversation(True), tools=TOOLS)
    assert text.startswith(
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "Given the following functions, please respond with a JSON for a function call"
    )
    assert json.dumps(WEATHER, indent=4, ensure_ascii=False) + "\n\n" in text
    assert text.endswith(
        "\n\nWeather in Köln and the time?<|im_end|>\n<|im_start|>assistant\n"
        '{"name": "get_weather", "parameters": {"city": "Köln"}}; '
        '{"name": "now", "parameters": {}}<|im_end|>\n'
        "<|im_start|>ipython\n18 C<|im_end|>\n<|im_start|>ipython\n12:00<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="no"):  # tools need a user turn to go in
        Tokenizer.from_dir(dirs["llama3"]).apply_chat_template([], tools=TOOLS)


@pytest.mark.parametrize(
    ("name", "plain"), [("hermes", "chatml"), ("llama3", "chatml"), ("smollm2-tools", "smollm2")]
)
def test_without_tools_the_prompt_is_unchanged(
    name: str, plain: str, dirs: dict[str, Path]
) -> None:
    for messages in PLAIN:
        for tools in (None, []):
            ours, theirs = both(dirs[name], messages, tools)
            assert ours == theirs == both(dirs[plain], messages, None)[1]


def test_template_families() -> None:
    assert template_features(tool_chat_template(SMOLLM2)).parser == "hermes"
    assert tool_chat_template("{{ messages }}") == "{{ messages }}"  # other templates: as given
    assert tool_chat_template(SMOLLM2.replace("SmolLM", "Smol'LM")) == SMOLLM2.replace(
        "SmolLM", "Smol'LM"
    )  # a quote would end the string the system prompt goes in: left alone


def test_gguf_conversion_ships_the_tool_template(dirs: dict[str, Path], tmp_path: Path) -> None:
    from tests.test_gguf import write_gguf

    src = tmp_path / "src"
    shutil.copytree(dirs["chatml"], src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SMOLLM2}))
    convert_gguf(write_gguf(src, tmp_path / "m.gguf", None), tmp_path / "out")
    written = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert written["chat_template"] == tool_chat_template(SMOLLM2) != SMOLLM2
