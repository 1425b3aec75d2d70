"""Per-request logits processing inside the engine's batch (worker/engine/logits.py, grammar.py), on CPU with the
tiny demo model, on the native path and the fallback path: a grammar, a bias, penalties and logprobs change only
their own request's tokens."""

import json

import pytest
import torch

from worker.engine.engine import Engine
from worker.engine.grammar import GrammarError
from worker.engine.requests import GenerationRequest, SamplingParams

MB = 1 << 20
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.demo_model import build_demo_model

    path = build_demo_model(tmp_path_factory.mktemp("logits") / "tiny")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def plain(rid: str, prompt: list[int], **kw) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, **kw))


@pytest.mark.parametrize("native", [True, False])
def test_processing_touches_only_its_own_rows(tiny, native):
    model, tokenizer = tiny
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    other = tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    with Engine(model, tokenizer, device="cpu", memory_budget_bytes=64 * MB, max_batch_size=8,
                native=native) as eng:
        alone = eng.generate([plain("a", other)])[0]
        grammar = eng.grammars().compile({"type": "json_schema", "schema": SCHEMA, "strict": True})
        json_req = GenerationRequest("json", prompt, SamplingParams(max_new_tokens=60, temperature=0.8, seed=3),
                                     grammar=grammar)
        tool = eng.grammars().compile({"type": "tool_calls", "choice": "f", "parallel": False, "tools": [
            {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                         "required": ["x"]}}]})
        tool_req = GenerationRequest("tool", prompt, SamplingParams(max_new_tokens=80, temperature=0), grammar=tool)
        results = {r.request_id: r for r in eng.generate([
            plain("a", other), json_req, tool_req, plain("bias", prompt, logit_bias=[(42, 100.0)]),
            plain("lp", prompt, logprobs=2), plain("pen", prompt, frequency_penalty=2.0, presence_penalty=2.0),
            plain("base", prompt)])}
        with pytest.raises(GrammarError):
            eng.grammars().compile({"type": "json_schema", "schema": {"type": "nonsense"}, "strict": True})
    assert results["a"].output_ids == alone.output_ids  # its neighbours' processing left it alone
    value = json.loads(results["json"].text)
    assert results["json"].finish_reason == "stop" and set(value) == {"ok", "n"} and value["n"] in (1, 2, 3)
    call = results["tool"].text
    assert call.startswith('<tool_call>\n{"name": "f", "arguments": ') and call.endswith("}\n</tool_call>"), call
    assert isinstance(json.loads(call.split("\n")[1])["arguments"]["x"], bool)
    assert results["bias"].output_ids == [42] * 12
    lp = results["lp"].logprobs
    assert [t for t, _, _ in lp] == results["lp"].output_ids == results["base"].output_ids
    assert all(top[0] == (t, v) and len(top) == 2 and v <= 0 for t, v, top in lp)  # greedy: the most likely
    base, pen = results["base"].output_ids, results["pen"].output_ids
    assert max(pen.count(t) for t in pen) < max(base.count(t) for t in base)
    assert results["base"].logprobs is None


def test_auto_tool_choice_allows_text_and_only_well_formed_calls(tiny):
    # tool_choice auto: any text, but a call once begun (its trigger written) must be one of the tools, with
    # arguments that fit its schema; not parallel, nothing but the end may follow it.
    from worker.engine.grammar import Grammars

    _, tokenizer = tiny
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"], "additionalProperties": False}}]

    def accepts(text: str, parallel: bool = False, end: bool = False) -> bool:
        constraint = grammars.constraint(grammars.compile({"type": "tool_calls", "tools": tools, "choice": "auto",
                                                           "parallel": parallel}))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if end else [])
        return all(constraint.accept(t) for t in ids)

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts("The weather is fine.", end=True)
    assert accepts("Let me check. " + call, end=True)
    assert not accepts('<tool_call>\n{"name": "lookup"')  # not one of the tools
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town"')  # not its schema
    assert not accepts(call + " and more") and accepts(call + " and more", parallel=True)


# Tool calls as the families' chat templates render them (a call is the whole assistant message), on the demo
# tokenizer with the family's marker as a special token (as Llama 3's <|python_tag|> and Mistral's [TOOL_CALLS]
# are) and one more special token, which the decoded text drops.
FAMILY_TEMPLATES = {
    "llama3": "{% for m in messages %}{% if m['role'] == 'ipython' %}{{ m['content'] }}{% endif %}"
              "{% for c in m['tool_calls'] or [] %}<|python_tag|>{\"name\": \"{{ c['function']['name'] }}\", "
              "\"parameters\": {{ c['function']['arguments'] | tojson }}}{% endfor %}{% endfor %}",
    "mistral": "{% for m in messages %}{% if m['tool_calls'] %}[TOOL_CALLS][{% for c in m['tool_calls'] %}"
               "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
               "{% if not loop.last %}, {% endif %}{% endfor %}]{% endif %}{% endfor %}",
}
MARKERS = {"llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


@pytest.mark.parametrize("fmt", ["llama3", "mistral"])
def test_auto_tool_choice_in_the_llama3_and_mistral_formats(tiny, fmt):
    # Their calls are read from the output's start only (contract/tool_calls.py): what the auto grammar allows is a
    # well-formed call of a tool there, or text that no call can be read from, whatever tokens it is written with.
    import copy

    from contract.tool_calls import parse
    from worker.engine.grammar import Grammars

    tokenizer = copy.deepcopy(tiny[1])
    tokenizer.add_special_tokens({"additional_special_tokens": [MARKERS[fmt], "<|hidden|>"]})
    tokenizer.chat_template = FAMILY_TEMPLATES[fmt]
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert grammars.tool_format == fmt
    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"], "additionalProperties": False}}]

    def accepts(text: str, parallel: bool = False) -> bool:
        constraint = grammars.constraint(grammars.compile({"type": "tool_calls", "tools": tools, "choice": "auto",
                                                           "parallel": parallel}))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return all(constraint.accept(t) for t in ids)

    def read(text: str) -> list[tuple[str, dict]]:  # the calls the served output has, as the worker parses it
        decoded = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in parse(decoded, fmt, ["get_weather"])[1]]

    def rendered(*cities: str) -> str:  # an assistant message with these calls, as the template writes it
        calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}} for c in cities]
        return tokenizer.apply_chat_template([{"role": "assistant", "tool_calls": calls}], tokenize=False)

    one, two = rendered("Oslo"), rendered("Oslo", "Bergen")
    if fmt == "llama3":  # without its marker, as Llama 3.1 writes a call of a JSON tool
        one, two = one.removeprefix(MARKERS[fmt]), two.replace(MARKERS[fmt], "").replace("}{", "}; {")
    assert accepts(one) and read(one) == [("get_weather", {"city": "Oslo"})]
    assert not accepts(two) and accepts(two, parallel=True)
    assert read(two) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]
    for text in ["", "\n", "The weather is fine.", "\nBraces {x} and [y] later are text."]:
        assert accepts(text) and read(text) == [], text
    head = one[:one.index('"get_weather"')]  # the call up to its name
    started = [one.replace("get_weather", "lookup"), one.replace('"Oslo"', "5"), head + '"get_weather", "x": 1}',
               # ways into a call that skip the grammar's: whitespace first, a token the text drops, keys as JSON allows
               " " + one.replace('"Oslo"', "5"), "<|hidden|>" + one.replace('"Oslo"', "5"),
               one.replace('{"name": ', '{ "name": ').replace('"Oslo"', "5")]
    for text in started:  # a call begun that is no well-formed call of the tool
        assert not accepts(text) and not accepts(text, parallel=True), text
    # after text a call is none (the parser reads text there), and the marker that would begin one is refused
    assert read("Let me check. " + one) == []
    for text in ["Let me check. " + rendered("Oslo"), "Text, then " + MARKERS[fmt]]:
        assert not accepts(text), text
