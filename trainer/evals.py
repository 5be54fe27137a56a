"""Evaluation suites, scoring, and the promotion gate decision.

A suite is held-out JSONL: one example per line with a `prompt` (text) or `messages`
(chat), an `expected` answer and optionally its own `metric`. Metrics: `exact` (after
trimming), `contains`, `regex` (the expected value is a pattern searched in the output: Python `re`
syntax, searched by the `regex` library, which can stop a search: one that runs past REGEX_SECONDS, a
pattern that backtracks catastrophically on this output, counts as not matched and says so)
and `numeric` (the first number in the output within `tolerance` of the expected one).
Generation is greedy, so an evaluation is repeatable.
"""

import hashlib
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from decimal import Decimal, DecimalException
from fractions import Fraction

import regex

from trainer.generation import SamplingConfig, generate, stop_token_ids
from trainer.jsonio import data_loads, jsonl_lines

METRICS = ("exact", "contains", "regex", "numeric")
logger = logging.getLogger("kiln.evals")
REGEX_SECONDS = 1.0  # a suite's pattern on one output; a greedy output is at most max_new_tokens long
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
MINIMUM_EXAMPLES = 20  # a gate decided on fewer examples is inconclusive (the server's KILN_GATE_MIN_EXAMPLES)


class SuiteError(ValueError):
    """A malformed suite, or one the base cannot be asked (its chat template); the message names the line or the
    example."""

    code = "invalid_suite"


@dataclass(frozen=True)
class EvalExample:
    messages: tuple  # ((role, content), ...); a plain prompt is (("user", text),)
    expected: str
    metric: str
    tolerance: float
    plain: bool = False  # a text prompt: sent as it is (as /v1/completions and plain SFT records), no chat template


@dataclass(frozen=True)
class Suite:
    name: str
    examples: tuple
    digest: str  # sha256 of the canonical examples


def parse_suite(name: str, text: str, default_metric="exact", default_tolerance=1e-6) -> Suite:
    if default_metric not in METRICS:
        raise SuiteError(f"metric must be one of {METRICS}, got {default_metric!r}")
    examples = []
    for number, line in jsonl_lines(text):
        try:
            record = data_loads(line)
        except json.JSONDecodeError as error:
            raise SuiteError(f"line {number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict) or "expected" not in record:
            raise SuiteError(f"line {number}: needs an object with prompt or messages and expected")
        plain = False
        if isinstance(record.get("messages"), list):
            messages = record["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       and isinstance(m.get("content"), str) for m in messages) or not messages:
                raise SuiteError(f"line {number}: messages must be {{role, content}} objects")
            messages = tuple((m["role"], m["content"]) for m in messages)
        elif isinstance(record.get("prompt"), str):
            if not record["prompt"]:
                raise SuiteError(f"line {number}: the prompt is empty; a model needs at least one token to answer")
            messages, plain = (("user", record["prompt"]),), True
        else:
            raise SuiteError(f"line {number}: needs prompt (text) or messages")
        metric = record.get("metric", default_metric)
        if metric not in METRICS:
            raise SuiteError(f"line {number}: metric must be one of {METRICS}, got {metric!r}")
        expected = record["expected"]
        if metric == "numeric":
            if isinstance(expected, bool) or not isinstance(expected, (int, float, str)):
                raise SuiteError(f"line {number}: numeric expected must be a number")
            try:
                float(expected)
            except ValueError:
                raise SuiteError(f"line {number}: numeric expected {expected!r} is not a number") from None
        elif not isinstance(expected, str):
            raise SuiteError(f"line {number}: expected must be a string")
        if metric == "regex":
            try:
                re.compile(expected)  # the syntax people write: Python's
                regex.compile(expected)  # and what searches it
            except (re.error, regex.error) as error:
                raise SuiteError(f"line {number}: bad regular expression: {error}") from None
        tolerance = record.get("tolerance", default_tolerance)
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0 \
                or not math.isfinite(tolerance):
            raise SuiteError(f"line {number}: tolerance must be a finite number >= 0")
        examples.append(EvalExample(messages, str(expected), metric, float(tolerance), plain))
    if not examples:
        raise SuiteError("the suite has no examples")
    canonical = json.dumps([asdict(e) for e in examples], sort_keys=True).encode()
    return Suite(name=name, examples=tuple(examples), digest=hashlib.sha256(canonical).hexdigest())


def score(example: EvalExample, output: str) -> bool | None:
    """Whether OUTPUT answers EXAMPLE by its metric; None for a regex search stopped after REGEX_SECONDS."""
    text = output.strip()
    if example.metric == "exact":
        return text == example.expected.strip()
    if example.metric == "contains":
        return example.expected in output
    if example.metric == "regex":
        try:
            return regex.search(example.expected, output, timeout=REGEX_SECONDS) is not None
        except TimeoutError:
            return None
    match = NUMBER.search(output)
    if match is None:
        return False
    try:  # in decimal, as written: 1.1 lies within 0.1 of 1.0 (the floats' difference is 0.10000000000000009)
        value, expected = Decimal(match.group()), Decimal(example.expected)
        if expected.is_finite():
            return abs(value - expected) <= Decimal(repr(example.tolerance))
    except DecimalException:
        pass
    return abs(float(match.group()) - float(example.expected)) <= example.tolerance


@dataclass
class EvalResult:
    suite: str
    suite_digest: str
    correct: int
    total: int
    examples: list = field(default_factory=list)  # {"index", "output", "expected", "metric", "correct"}

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def summary(self) -> dict:
        return {"suite": self.suite, "suite_digest": self.suite_digest, "correct": self.correct,
                "total": self.total, "accuracy": self.accuracy}


def _chat_prompt(tokenizer, example: EvalExample, index: int) -> str:
    """The example's messages in the base's chat template, with the assistant's turn opened; SuiteError naming the
    example where the base has no template or its template refuses them (raise_exception: roles out of turn)."""
    if tokenizer.chat_template is None:
        raise SuiteError(f"example {index + 1}: the base has no chat template to render its messages with; ask it "
                         "with prompt text instead")
    messages = [{"role": role, "content": content} for role, content in example.messages]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001 (jinja2's TemplateError from raise_exception, or the template's fault)
        raise SuiteError(f"example {index + 1}: the base's chat template refused its messages: {error}") from None


def evaluate(model, tokenizer, suite: Suite, max_new_tokens=64, progress=None) -> EvalResult:
    """Greedy completions of every example, scored by its metric."""
    result = EvalResult(suite=suite.name, suite_digest=suite.digest, correct=0, total=len(suite.examples))
    for index, example in enumerate(suite.examples):
        stop = stop_token_ids(tokenizer, chat=not example.plain)  # where /v1/completions or chat completions stop
        if example.plain:
            prompt = tokenizer.encode(example.messages[0][1], add_special_tokens=True)
        else:
            prompt = tokenizer.encode(_chat_prompt(tokenizer, example, index))
        budget = min(max_new_tokens, model.config.maximum_context - len(prompt))
        if budget < 1:  # no room to answer: wrong whatever it expects, and the record says why
            output, correct = "", False
        else:
            generation = generate(model, prompt, SamplingConfig(max_new_tokens=budget, temperature=0,
                                                                stop_token_ids=stop), tokenizer=tokenizer)
            output = tokenizer.decode([t for t in generation.tokens if t not in stop],
                                      skip_special_tokens=True)
            correct = score(example, output)
        record = {"index": index, "output": output, "expected": example.expected, "metric": example.metric,
                  "correct": bool(correct)}
        if budget < 1:
            record["note"] = (f"the prompt has {len(prompt)} tokens, which leaves no room to answer in the "
                              f"model's context of {model.config.maximum_context}: counted as not answered")
        elif correct is None:
            record["note"] = (f"the pattern's search of this output ran past {REGEX_SECONDS:g} s (catastrophic "
                              "backtracking) and was stopped: counted as not matched")
        if "note" in record:
            logger.warning("suite %s, example %d: %s", suite.name, index, record["note"])
        result.correct += int(record["correct"])
        result.examples.append(record)
        if progress:
            progress(index + 1, len(suite.examples))
    return result


GATE_OUTCOMES = ("promoted", "gate_failed", "inconclusive", "unavailable", "not_requested")


def _exact_accuracy(summary: dict) -> Fraction:
    """A summary's accuracy as the fraction correct/total it is (the float 0.6 - 0.4 is 0.19999999999999996)."""
    correct, total = summary.get("correct"), summary.get("total")
    if isinstance(correct, int) and isinstance(total, int) and total > 0:
        return Fraction(correct, total)
    return Fraction(summary["accuracy"]).limit_denominator(10**6)  # a count's float: its fraction again


def _exact_threshold(value) -> Fraction:
    """A threshold as the decimal it was written as (0.2, not the float nearest to it)."""
    return Fraction(repr(float(value)))


def gate_decision(candidate: dict | None, baseline: dict | None, min_accuracy=None,
                  min_improvement=None, min_examples: int = MINIMUM_EXAMPLES) -> tuple:
    """(outcome, reason) of a post-eval promotion gate from evaluation summaries.

    `candidate` None means the evaluation could not run (unavailable). Too few
    examples, or a baseline that was needed but is missing, is inconclusive. The
    thresholds are inclusive and compared exactly: an accuracy of 12/20 meets
    min_accuracy 0.6, and 12/20 against 8/20 meets min_improvement 0.2.
    """
    if min_accuracy is None and min_improvement is None:
        return "not_requested", "no gate was requested"
    if candidate is None:
        return "unavailable", "the evaluation could not run"
    if candidate["total"] < min_examples:
        return "inconclusive", (f"the suite has {candidate['total']} examples and a gate needs at least {min_examples} "
                                "to decide (gate.min_examples, or the server's KILN_GATE_MIN_EXAMPLES)")
    if min_accuracy is not None and _exact_accuracy(candidate) < _exact_threshold(min_accuracy):
        return "gate_failed", (f"accuracy {candidate['accuracy']:.4f} is below the minimum "
                               f"{min_accuracy:.4f}")
    if min_improvement is not None:
        if baseline is None:
            return "inconclusive", "no baseline evaluation to measure the improvement against"
        if baseline["suite_digest"] != candidate["suite_digest"]:
            return "inconclusive", "the candidate and the baseline were evaluated on different suites"
        gain = candidate["accuracy"] - baseline["accuracy"]
        if _exact_accuracy(candidate) - _exact_accuracy(baseline) < _exact_threshold(min_improvement):
            return "gate_failed", (f"improvement {gain:+.4f} over the baseline is below "
                                   f"the minimum {min_improvement:+.4f}")
    return "promoted", "the gate passed"
