"""Chat templates from the model's own metadata, rendered in a sandbox."""

from __future__ import annotations

import jinja2
import pytest

from stride.model.files import default_model_path
from stride.tokenizer.loader import load_tokenizer
from stride.tokenizer.template import ChatTemplate, TemplateError

SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
          "<|im_end|>\n")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def template(tok):
    return ChatTemplate.for_model(tok)


def test_default_template_adds_system_and_generation_prompt(template):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert template.render(messages) == (
        SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(messages, add_generation_prompt=False) == (
        SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n")


def test_own_system_message_replaces_default(template):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    text = template.render(messages)
    assert "SmolLM" not in text
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_rendered_prompt_tokenizes_to_special_ids(tok, template):
    ids = tok.encode(template.render([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_content_parts_are_joined(template):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert "user\nHello<|im_end|>" in template.render([{"role": "user", "content": parts}])


def test_bos_eos_and_raise_exception():
    source = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
              "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{{ eos_token }}{% endfor %}")
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.render([{"role": "user", "content": "é"}]) == '<s>"é"</s>'
    with pytest.raises(TemplateError, match="first must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_loop_controls_and_trim_blocks():
    source = ("{% for m in messages %}\n{% if loop.index > 1 %}{% break %}{% endif %}\n"
              "{{ m['content'] }}\n{% endfor %}")
    assert ChatTemplate(source).render([{"content": "a"}, {"content": "b"}]) == "a\n"


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox_refuses_escapes(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_sandbox_control_plain_jinja_would_allow_mutation():
    # Negative control: outside the sandbox the mutation template above runs, so the refusal is the sandbox's.
    source = "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}"
    assert jinja2.Environment().from_string(source).render(messages=[{}]) == "2"


def test_bad_templates():
    with pytest.raises(TemplateError):
        ChatTemplate("{% for %}")
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[5]['content'] }}").render([{"role": "user", "content": "x"}])
