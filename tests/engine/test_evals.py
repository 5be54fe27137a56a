"""Evaluation suites, metrics and the promotion gate decision."""

import json

import pytest

from trainer.bases import load_base
from trainer.evals import SuiteError, evaluate, gate_decision, parse_suite, score


def suite_text(*records):
    return "".join(json.dumps(r) + "\n" for r in records)


def test_metrics():
    suite = parse_suite("s", suite_text(
        {"prompt": "a", "expected": "42"},
        {"prompt": "b", "expected": "Paris", "metric": "contains"},
        {"prompt": "c", "expected": r"\bcat(s)?\b", "metric": "regex"},
        {"prompt": "d", "expected": 3.14, "metric": "numeric", "tolerance": 0.01},
        {"messages": [{"role": "user", "content": "e"}], "expected": "ok"}))
    exact, contains, regex, numeric, chat = suite.examples
    assert score(exact, " 42\n") and not score(exact, "42!")
    assert score(contains, "It is Paris.") and not score(contains, "paris")
    assert score(regex, "two cats") and not score(regex, "concatenate")
    assert score(numeric, "about 3.141 I think") and not score(numeric, "3.2") and not score(numeric, "pi")
    assert chat.messages == (("user", "e"),) and not chat.plain
    assert exact.messages == (("user", "a"),) and exact.plain  # a text prompt is sent as it is


@pytest.mark.parametrize("line,fragment", [
    ('{"prompt": "a"}', "expected"),
    ('{"expected": "x"}', "prompt"),
    ('{"prompt": "a", "expected": "x", "metric": "bleu"}', "metric"),
    ('{"prompt": "a", "expected": "(", "metric": "regex"}', "regular expression"),
    ('{"prompt": "a", "expected": "ten", "metric": "numeric"}', "not a number"),
    ('not json', "not JSON"),
    ('{"prompt": "", "expected": "x"}', "prompt is empty"),  # no tokens to answer: the run would crash
])
def test_suite_errors_name_the_line(line, fragment):
    with pytest.raises(SuiteError, match=fragment) as info:
        parse_suite("s", '{"prompt": "ok", "expected": "1"}\n' + line + "\n")
    assert "line 2" in str(info.value)


def test_digest_identifies_the_content():
    a = parse_suite("a", suite_text({"prompt": "x", "expected": "1"}))
    b = parse_suite("b", suite_text({"prompt": "x", "expected": "1"}))
    c = parse_suite("c", suite_text({"prompt": "x", "expected": "2"}))
    assert a.digest == b.digest != c.digest


def test_evaluate_is_repeatable_on_a_real_model(tmp_path):
    model, tokenizer = load_base("kiln-tiny", tmp_path)
    suite = parse_suite("s", suite_text({"prompt": "hello", "expected": "x", "metric": "contains"},
                                        {"prompt": "2+2?", "expected": "4", "metric": "numeric"}))
    calls = []
    first = evaluate(model, tokenizer, suite, max_new_tokens=8, progress=lambda i, n: calls.append((i, n)))
    second = evaluate(model, tokenizer, suite, max_new_tokens=8)
    assert [e["output"] for e in first.examples] == [e["output"] for e in second.examples]
    assert first.total == 2 and calls == [(1, 2), (2, 2)]
    assert first.correct == sum(e["correct"] for e in first.examples)


def test_gate_outcomes():
    passing = {"accuracy": 0.9, "total": 20, "suite_digest": "d"}
    baseline = {"accuracy": 0.8, "total": 20, "suite_digest": "d"}
    assert gate_decision(passing, baseline)[0] == "not_requested"
    assert gate_decision(None, baseline, min_accuracy=0.5)[0] == "unavailable"
    assert gate_decision(passing, baseline, min_accuracy=0.95)[0] == "gate_failed"
    assert gate_decision(passing, baseline, min_accuracy=0.5, min_improvement=0.05)[0] == "promoted"
    assert gate_decision(passing, baseline, min_improvement=0.2)[0] == "gate_failed"
    assert gate_decision(passing, None, min_improvement=0.05)[0] == "inconclusive"
    assert gate_decision(passing, {**baseline, "suite_digest": "other"}, min_improvement=0.0)[0] == "inconclusive"
    assert gate_decision({**passing, "total": 0}, baseline, min_accuracy=0.0)[0] == "inconclusive"


def test_a_gate_decides_only_on_enough_examples():
    few = {"accuracy": 1.0, "total": 19, "suite_digest": "d"}
    outcome, reason = gate_decision(few, None, min_accuracy=0.5)  # the default minimum: 20 examples
    assert outcome == "inconclusive" and "19 examples" in reason and "at least 20" in reason
    assert gate_decision({**few, "total": 20}, None, min_accuracy=0.5)[0] == "promoted"
    assert gate_decision(few, None, min_accuracy=0.5, min_examples=5)[0] == "promoted"
    assert gate_decision({**few, "total": 4}, None, min_accuracy=0.5, min_examples=5)[0] == "inconclusive"


CATASTROPHIC = r"^(a|a)+$"  # a failing search tries both branches at each of n a's: 2**n paths


def test_a_regex_search_that_backtracks_catastrophically_is_stopped_and_counts_as_not_matched():
    """With `re` this search of 40 a's and a '!' would run for days (2**40 paths; 24 a's take seconds) and hold the
    evaluation worker, GIL and all; the regex library stops it after REGEX_SECONDS (and a few more)."""
    (example,) = parse_suite("s", suite_text({"prompt": "p", "expected": CATASTROPHIC, "metric": "regex"})).examples
    assert score(example, "a" * 40 + "!") is None
    assert score(example, "aaaa") is True and score(example, "b") is False


def test_an_evaluation_says_which_example_s_search_was_stopped(tmp_path, monkeypatch):
    import trainer.evals as evals

    model, tokenizer = load_base("kiln-tiny", tmp_path)
    output = tokenizer.encode("a" * 40 + "!")  # kiln-tiny's tokens are bytes

    def fixed(model, prompt, sampling, tokenizer=None):
        return type("Generation", (), {"tokens": output})()

    monkeypatch.setattr(evals, "generate", fixed)
    suite = parse_suite("s", suite_text({"prompt": "p", "expected": CATASTROPHIC, "metric": "regex"},
                                        {"prompt": "q", "expected": "a!$", "metric": "regex"}))
    result = evaluate(model, tokenizer, suite, max_new_tokens=48)
    stopped, matched = result.examples
    assert stopped["correct"] is False and "was stopped" in stopped["note"]
    assert matched["correct"] is True and "note" not in matched
    assert result.correct == 1


@pytest.mark.parametrize("ours, theirs, min_improvement", [(12, 8, 0.2), (17, 16, 0.05), (3, 1, 0.1), (6, 4, 0.1)])
def test_a_gain_exactly_at_min_improvement_passes(ours, theirs, min_improvement):
    """"A gain below min_improvement is gate_failed": a gain equal to it passes. 12/20 - 8/20 is 0.2, though the
    floats 0.6 - 0.4 give 0.19999999999999996."""
    total = 20
    candidate = {"correct": ours, "total": total, "accuracy": ours / total, "suite_digest": "d"}
    baseline = {"correct": theirs, "total": total, "accuracy": theirs / total, "suite_digest": "d"}
    assert gate_decision(candidate, baseline, min_improvement=min_improvement)[0] == "promoted"
    assert gate_decision(candidate, baseline, min_improvement=min_improvement + 1e-9)[0] == "gate_failed"
    # summaries without counts (as older callers pass) decide the same
    without = ({k: v for k, v in candidate.items() if k != "correct"}, {k: v for k, v in baseline.items()
                                                                         if k != "correct"})
    assert gate_decision(*without, min_improvement=min_improvement)[0] == "promoted"


@pytest.mark.parametrize("correct, total, min_accuracy", [(12, 20, 0.6), (7, 20, 0.35), (1, 3, 0.3333333333333333)])
def test_an_accuracy_exactly_at_min_accuracy_passes(correct, total, min_accuracy):
    summary = {"correct": correct, "total": total, "accuracy": correct / total, "suite_digest": "d"}
    assert gate_decision(summary, None, min_accuracy=min_accuracy, min_examples=1)[0] == "promoted"
    below = {**summary, "correct": correct - 1, "accuracy": (correct - 1) / total}
    assert gate_decision(below, None, min_accuracy=min_accuracy, min_examples=1)[0] == "gate_failed"


@pytest.mark.parametrize("expected, tolerance, output, matches", [
    (1.0, 0.1, "1.1", True), (1.0, 0.1, "0.9", True), (0.3, 0.1, "0.4", True), (0.3, 0.1, "0.2", True),
    (1.0, 0.1, "1.1000001", False), (2, 0, "2.0", True), (2, 0, "2.0000001", False), ("1e3", 0.5, "1000.5", True)])
def test_numeric_tolerance_is_inclusive(expected, tolerance, output, matches):
    """"The first number within tolerance": 1.1 lies within 0.1 of 1.0, though the floats 1.1 - 1.0 give
    0.10000000000000009."""
    (example,) = parse_suite("s", suite_text({"prompt": "p", "expected": expected, "metric": "numeric",
                                              "tolerance": tolerance})).examples
    assert score(example, f"it is {output}.") is matches


def test_an_example_whose_prompt_fills_the_context_is_not_answered_and_says_so(tmp_path):
    """No room to generate: the example is wrong whatever it expects (an empty expected answer included), and its
    record says why, instead of scoring an output the model never gave."""
    model, tokenizer = load_base("kiln-tiny", tmp_path)
    long_prompt = "a" * model.config.maximum_context  # kiln-tiny's tokens are bytes
    suite = parse_suite("s", suite_text({"prompt": long_prompt, "expected": ""},
                                        {"prompt": long_prompt, "expected": "", "metric": "contains"},
                                        {"prompt": "a", "expected": ".*", "metric": "regex"}))
    result = evaluate(model, tokenizer, suite, max_new_tokens=2)
    first, second, answered = result.examples
    assert first["correct"] is False and second["correct"] is False and answered["correct"] is True
    assert "context" in first["note"] and "note" not in answered
    assert result.correct == 1


def test_a_chat_example_ends_at_the_end_of_turn_as_chat_completions_do(tmp_path, monkeypatch):
    """A base whose end of text is not its chat template's end-of-turn marker (older Llama 3 and Phi-3 GGUFs):
    /v1/chat/completions stops at the marker, so an evaluation of a chat example must too, or the text the model
    writes after its turn is scored as part of its answer. A plain prompt ends at the end of text, as
    /v1/completions does."""
    import trainer.evals as evals
    from trainer.generation import Generation
    from trainer.tokenizer import Tokenizer

    model, tiny = load_base("kiln-tiny", tmp_path)
    files = tiny.files()
    config = {**json.loads(files["tokenizer_config.json"]), "eos_token": "<|endoftext|>"}
    tokenizer = Tokenizer(files["tokenizer.json"], config)
    end_of_turn = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.eos_token_id != end_of_turn
    said = tokenizer.encode("4") + [end_of_turn] + tokenizer.encode("\nuser: and 3+3?") + [tokenizer.eos_token_id]

    def honouring_stops(model, prompt, sampling, tokenizer=None):
        tokens = []
        for token in said[:sampling.max_new_tokens]:
            tokens.append(token)
            if token in sampling.stop_token_ids:
                break
        return Generation(tokens=tokens, logprobs=[0.0] * len(tokens), finish_reason="stop")

    monkeypatch.setattr(evals, "generate", honouring_stops)
    suite = parse_suite("s", suite_text({"messages": [{"role": "user", "content": "2+2?"}], "expected": "4"},
                                        {"prompt": "2+2?", "expected": "4\nuser: and 3+3?"}))
    chat, plain = evaluate(model, tokenizer, suite, max_new_tokens=64).examples
    assert chat["output"] == "4" and chat["correct"]
    assert plain["output"] == "4\nuser: and 3+3?" and plain["correct"]


def test_an_example_the_bases_chat_template_cannot_render_fails_the_run_naming_it(tmp_path):
    """A messages example over a base with no chat template (or one whose template refuses the messages: roles out
    of turn) cannot be asked: the evaluation fails invalid_suite naming the example and why, not internal_error with
    jinja2's or the tokenizer's bare exception."""
    from trainer.tokenizer import Tokenizer

    model, tiny = load_base("kiln-tiny", tmp_path)
    files = tiny.files()
    config = {k: v for k, v in json.loads(files["tokenizer_config.json"]).items() if k != "chat_template"}
    plain = Tokenizer(files["tokenizer.json"], config)
    assert plain.chat_template is None
    suite = parse_suite("s", suite_text({"prompt": "2+2?", "expected": "4"},
                                        {"messages": [{"role": "user", "content": "2+2?"}], "expected": "4"}))
    with pytest.raises(SuiteError) as refused:
        evaluate(model, plain, suite, max_new_tokens=2)
    assert refused.value.code == "invalid_suite"
    assert str(refused.value).startswith("example 2: the base has no chat template"), str(refused.value)
    strict = Tokenizer(files["tokenizer.json"], {**config, "chat_template": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant turns') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")})
    suite = parse_suite("s", suite_text({"messages": [{"role": "user", "content": "a"},
                                                      {"role": "assistant", "content": "b"}], "expected": "4"}))
    with pytest.raises(SuiteError, match="example 1: the base's chat template refused its messages: .*no assistant"):
        evaluate(model, strict, suite, max_new_tokens=2)
