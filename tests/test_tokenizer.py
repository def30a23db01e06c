"""engine.tokenizer against transformers on the generated checkpoints (ids, text, prompts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from pdserve.engine.tokenizer import Tokenizer
from pdserve.models.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("llama", "qwen2", "qwen3")
BOS, END_OF_TEXT, IM_START, IM_END, PAD = 2043, 2044, 2045, 2046, 2047
TEXTS = [
    "Hello world",
    "",
    " leading space and trailing space ",
    "The year 2024 had 366 days; pi ≈ 3.14159.",
    "Café crème brûlée, naïve façade — déjà vu",
    "Καλημέρα κόσμε. Привет, мир! Добрий день.",
    "今天天气很好。こんにちは、世界。안녕하세요",
    "emoji 😀👍🏳️‍🌈🇯🇵 and ✈️",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a<|pad|>b<|end_of_text|>c<|begin_of_text|>",
    "  multiple   spaces\n\n\ttabs\r\nand CRLF",
    "def f(x):\n    return {'k': x ** 2}  # comment\n",
    "don't I'll we've THEY'RE",
    "unseen: ᚠᚢᚦ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x7f",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And in Greek? Τέσσερα; 四 😀"},
    ],
    [
        {"role": "user", "content": "multi\nline\n\ncontent  "},
        {"role": "assistant", "content": ""},
    ],
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok_models")
    return {arch: make_model(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf(dirs: dict[str, Path]) -> dict[str, object]:
    auto = transformers.AutoTokenizer
    return {arch: auto.from_pretrained(str(d)) for arch, d in dirs.items()}


@pytest.fixture(scope="module")
def ours(dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {arch: Tokenizer.from_dir(d) for arch, d in dirs.items()}


def _variant(src: Path, dst: Path, **tokenizer_config: object) -> Path:
    """A model dir with tokenizer.json from ``src`` and the given tokenizer_config.json."""
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return dst


def test_module_does_not_import_torch() -> None:
    code = (
        "import sys, pdserve.engine.tokenizer;"
        " print(sorted(m for m in sys.modules if m == 'torch'))"
    )
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("arch", ARCHS)
def test_encode_matches_hf(arch: str, hf: dict, ours: dict) -> None:
    for text in TEXTS:
        assert ours[arch].encode(text) == hf[arch](text).input_ids, text
        plain = hf[arch](text, add_special_tokens=False).input_ids
        assert ours[arch].encode(text, add_special_tokens=False) == plain, text


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_and_tokens_match_hf(arch: str, hf: dict, ours: dict) -> None:
    for text in TEXTS:
        ids = ours[arch].encode(text)
        for skip in (True, False):
            assert ours[arch].decode(ids, skip) == hf[arch].decode(ids, skip_special_tokens=skip)
        assert ours[arch].convert_ids_to_tokens(ids) == hf[arch].convert_ids_to_tokens(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip(arch: str, ours: dict) -> None:
    tok = ours[arch]
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False), False) == text
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>\n")) == "user\nhi\n"


def test_special_tokens_llama(ours: dict) -> None:
    tok = ours["llama"]
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        2048,
        BOS,
        IM_END,
        PAD,
    )
    assert tok.eos_token_ids == [IM_END, END_OF_TEXT]
    assert tok.all_special_ids == {BOS, END_OF_TEXT, IM_START, IM_END, PAD}
    assert tok.add_bos_token is True
    assert tok.encode("") == [BOS]
    assert tok.token_to_id("<|im_end|>") == IM_END
    assert tok.token_to_id("<|nope|>") is None
    with pytest.raises(ValueError, match="token id 5000 is outside the vocabulary"):
        tok.convert_ids_to_tokens([1, 5000])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_special_tokens_qwen(arch: str, ours: dict) -> None:
    tok = ours[arch]
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token_id) == (None, None, IM_END)
    assert tok.eos_token_ids == [IM_END, END_OF_TEXT]
    assert tok.add_bos_token is False
    assert tok.encode("") == []


def test_qwen_normalizes_and_splits_digits(ours: dict) -> None:
    qwen, llama = ours["qwen2"], ours["llama"]
    assert qwen.encode("e\u0301t\u00e9") == qwen.encode("\u00e9t\u00e9")
    assert llama.encode("e\u0301t\u00e9") != llama.encode("\u00e9t\u00e9")
    pieces = [qwen.decode([i]) for i in qwen.encode("in 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_hf(arch: str, gen_prompt: bool, hf: dict, ours: dict) -> None:
    for messages in CONVERSATIONS:
        want = hf[arch].apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen_prompt
        )
        assert ours[arch].apply_chat_template(messages, add_generation_prompt=gen_prompt) == want
        ids = hf[arch].apply_chat_template(
            messages, add_generation_prompt=gen_prompt, return_dict=False
        )
        assert ours[arch].encode_chat(messages, add_generation_prompt=gen_prompt) == ids


def test_chat_template_exact_text(ours: dict) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert ours["llama"].apply_chat_template(messages) == (
        "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ours["qwen3"].apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    tokens = ours["llama"].convert_ids_to_tokens(ours["llama"].encode_chat(messages))
    assert tokens == [
        "<|begin_of_text|>", "<|im_start|>", "user", "Ċ", "h", "i", "<|im_end|>", "Ċ",
        "<|im_start|>", "ass", "istant", "Ċ",
    ]  # fmt: skip


TOOLS_TEMPLATE = (
    "{% if tools %}{{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}"
    "{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | tojson }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% generation %}assistant{{ suffix }}{% endgeneration %}"
    "{% endif %}"
    "{{ eos_token }}|{{ bos_token is defined }}|{{ strftime_now('%Y') | length }}"
)


def test_template_features_match_hf(dirs: dict, tmp_path: Path) -> None:
    d = _variant(
        dirs["qwen3"],
        tmp_path / "m",
        chat_template=TOOLS_TEMPLATE,
        eos_token={"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        tokenizer_class="PreTrainedTokenizerFast",
    )
    ours = Tokenizer.from_dir(d)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    tools = [{"type": "function", "function": {"name": "wetter", "description": "Grüße ☀"}}]
    messages = [{"role": "user", "content": 'He said "héllo" & <b>'}]
    want = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, suffix=":"
    )
    assert ours.apply_chat_template(messages, tools=tools, suffix=":") == want
    assert '"description": "Grüße ☀"' in want and '"He said \\"héllo\\" & <b>"' in want
    assert want.endswith("assistant:<|im_end|>|False|4")
    with pytest.raises(ValueError, match="bad role system"):
        ours.apply_chat_template([{"role": "system", "content": "x"}])


def test_named_templates_and_jinja_file(dirs: dict, tmp_path: Path) -> None:
    named = [{"name": "rag", "template": "rag"}, {"name": "default", "template": "dflt"}]
    ours = Tokenizer.from_dir(_variant(dirs["llama"], tmp_path / "a", chat_template=named))
    assert ours.chat_template == "dflt"
    first = [{"name": "rag", "template": "rag"}, {"name": "tool_use", "template": "tools"}]
    ours = Tokenizer.from_dir(_variant(dirs["llama"], tmp_path / "b", chat_template=first))
    assert ours.chat_template == "rag"
    assert ours.apply_chat_template([]) == "rag"
    assert ours.apply_chat_template([], tools=[]) == "tools"
    d = _variant(dirs["llama"], tmp_path / "c", chat_template="from config")
    (d / "chat_template.jinja").write_text("from file", encoding="utf-8")
    assert Tokenizer.from_dir(d).apply_chat_template([]) == "from file"


def test_no_chat_template(dirs: dict, tmp_path: Path) -> None:
    ours = Tokenizer.from_dir(_variant(dirs["llama"], tmp_path / "m"))
    assert ours.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        Tokenizer.from_dir(tmp_path)
    assert "tokenizer.json" in str(info.value) and str(tmp_path) in str(info.value)


def test_eos_ids_from_generation_and_model_config(dirs: dict, tmp_path: Path) -> None:
    d = _variant(dirs["llama"], tmp_path / "m", eos_token="<|end_of_text|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_START}))
    (d / "config.json").write_text(json.dumps({"bos_token_id": 7, "eos_token_id": [PAD, 9]}))
    tok = Tokenizer.from_dir(d)
    assert (tok.eos_token_id, tok.eos_token_ids) == (END_OF_TEXT, [IM_START, END_OF_TEXT, PAD, 9])
    assert tok.bos_token_id == 7  # no bos_token key in tokenizer_config: config.json decides
    (d / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(d).eos_token_ids == [IM_START, PAD, 9]


def test_added_tokens_decoder_fills_gaps_like_hf(dirs: dict, tmp_path: Path) -> None:
    added = {"2048": {"content": "<tool>", "special": True}, "2049": {"content": "word"}}
    d = _variant(dirs["llama"], tmp_path / "m", added_tokens_decoder=added)
    ours = Tokenizer.from_dir(d)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    assert ours.vocab_size == len(hf) == 2050
    assert ours.token_to_id("<tool>") == 2048 and 2048 in ours.all_special_ids
    text = "a <tool> word"
    assert ours.encode(text) == hf(text).input_ids
    assert ours.decode(ours.encode(text)) == hf.decode(hf(text).input_ids, skip_special_tokens=True)
