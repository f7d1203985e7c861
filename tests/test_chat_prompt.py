"""A chat placed after the memory: the same segment, the conversation after it."""

import pytest
from transformers import AutoTokenizer

import tiny_models
from inferscale.compose.prompt import PromptFormat
from inferscale.config import DEFAULT_CLOSING, DEFAULT_INSTRUCTION


@pytest.fixture(scope="module", params=["qwen05", "tiny-chatml", "plain"])
def tokenizer(request):
    if request.param == "qwen05":
        return AutoTokenizer.from_pretrained(request.getfixturevalue("qwen05_dir"), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_models.tiny_model_dir("qwen2", "float32"), local_files_only=True)
    if request.param == "plain":
        tok.chat_template = None
    return tok


def test_one_user_message_is_exactly_the_question(tokenizer):
    fmt = PromptFormat.from_tokenizer(tokenizer, DEFAULT_INSTRUCTION, DEFAULT_CLOSING)
    question = "What is my cat called?"
    assert fmt.chat_ids(tokenizer, [{"role": "user", "content": question}]) == fmt.query_ids(tokenizer, question)


def test_history_and_system_text_follow_the_facts(tokenizer):
    fmt = PromptFormat.from_tokenizer(tokenizer, DEFAULT_INSTRUCTION, DEFAULT_CLOSING)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, I'm Maya."},
            {"role": "assistant", "content": "Hello Maya!"}, {"role": "user", "content": "What is my cat called?"}]
    text = fmt.chat_text(tokenizer, chat)
    assert text.startswith(DEFAULT_CLOSING + "Be brief.")
    positions = [text.index(m["content"]) for m in chat]
    assert positions == sorted(positions)  # in order, after the closing text
    assert text.endswith(fmt.suffix_text)  # the assistant's turn is open


def test_unknown_roles_are_refused(tokenizer):
    fmt = PromptFormat.from_tokenizer(tokenizer, DEFAULT_INSTRUCTION, DEFAULT_CLOSING)
    with pytest.raises(ValueError, match="role"):
        fmt.chat_ids(tokenizer, [{"role": "tool", "content": "42"}])
    with pytest.raises(ValueError, match="content"):
        fmt.chat_ids(tokenizer, [{"role": "user", "content": ["image"]}])
