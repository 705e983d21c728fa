"""verify.py: the equivalence table, the extraction table, the red team (right and fast), the arith
rule, rewards in bulk, the math-verify second opinion."""

import sys
import threading
import time
import types
import warnings

import pytest

import verify
from verify import extract_answer, is_equiv, reward, rewards


# ----------------------------------------------------------------------------
# is_equiv table


MATCH = [  # equivalent forms: must match
    # integers and the fast path
    ("42", "42"), ("042", "42"), ("-0", "0"), (" 42 ", "42"), ("42.0", "42"), ("42.000", "42"),
    ("+42", "42"), ("10", "1e1"), ("1,000", "1000"), ("1{,}000", "1000"), ("1,\\!000", "1000"),
    ("1\\,000", "1000"), ("1,234,567", "1234567"), ("1,234.5", "1234.5"),
    ("123456789012345678901234567890", "123456789012345678901234567890.0"),
    # fractions, decimals, mixed numbers
    ("\\frac{1}{2}", "1/2"), ("\\dfrac{1}{2}", "\\frac12"), ("\\tfrac{1}{2}", "0.5"),
    ("\\frac{2}{4}", "\\frac{1}{2}"), ("-\\frac{1}{2}", "\\frac{-1}{2}"), ("\\frac{1}{-2}", "-0.5"),
    ("\\frac{3}{2}", "1.5"), (".5", "0.5"), ("0.50", "\\frac12"), ("\\frac{10}{4}", "2.5"),
    ("5/2", "\\frac{5}{2}"), ("(1/2)", "1/2"), ("\\frac{1}{3}", "\\dfrac{2}{6}"),
    ("2\\frac{1}{2}", "\\frac52"), ("2 1/2", "2.5"), ("-2\\frac{1}{2}", "-2.5"),
    ("\\frac{0}{5}", "0"), ("0.125", "\\frac{1}{8}"),
    # scientific notation and powers
    ("1.5\\times10^{3}", "1500"), ("1.5 \\cdot 10^3", "1500"), ("1.5e3", "1500"),
    ("2.5E-2", "0.025"), ("10^{-3}", "0.001"), ("2^{10}", "1024"), ("2^{-1}", "\\frac{1}{2}"),
    ("(-2)^3", "-8"), ("-2^2", "-4"), ("3^{2}\\cdot 2", "18"), ("6 \\div 4", "1.5"),
    # radicals, pi, implicit products
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"), ("\\sqrt{3}/2", "\\frac{\\sqrt3}{2}"),
    ("2\\sqrt{3}", "\\sqrt{12}"), ("\\sqrt{18}", "3\\sqrt2"), ("\\sqrt{4}", "2"),
    ("\\sqrt{\\frac{4}{9}}", "\\frac23"), ("\\sqrt[3]{27}", "3"), ("\\sqrt[3]{-8}", "-2"),
    ("\\sqrt[4]{16}", "2"), ("2\\pi", "\\pi+\\pi"), ("\\frac{\\pi}{2}", "\\frac12\\pi"),
    ("\\frac{2\\pi}{3}", "\\frac{2}{3}\\pi"), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("\\sqrt{2}\\cdot\\sqrt{8}", "4"), ("4^{1/2}", "2"), ("8^{\\frac{1}{3}}", "2"),
    ("1+\\sqrt{2}", "\\sqrt{2}+1"), ("\\frac{1+\\sqrt{5}}{2}", "\\frac{\\sqrt5+1}{2}"),
    ("2(3+1)", "8"), ("\\left(\\frac{1}{2}\\right)^2", "\\frac14"), ("\\frac\\pi4", "0.25\\pi"),
    ("3.14159265359", "\\pi"),  # ~12 significant digits of an irrational gold count (1e-9)
    # LaTeX and text normalisation
    ("\\$5", "5"), ("\\$5.00", "5"), ("$5$", "5"), ("50\\%", "50"), ("50%", "50"),
    ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("90\u00b0", "90"), ("90 degrees", "90"),
    ("5\\text{ cm}", "5"), ("5 cm", "5"), ("5\\text{ cm}^2", "5"), ("5 square units", "5"),
    ("12 \\text{ inches}", "12"), ("3 hours", "3"), ("10 m", "10"), ("5\\mbox{ meters}", "5"),
    ("5cm", "5"), ("\\text{5}", "5"), ("\\textbf{5}", "5"), ("x = 5", "5"), ("x=5", "5"),
    ("y = -3", "-3"), ("5", "x=5"), ("a_1 = 7", "7"), ("\\theta = \\frac{\\pi}{4}", "\\frac\\pi4"),
    ("x \\in [1,2]", "[1,2]"), ("5.", "5"), ("\\boxed{5}", "5"), ("{5}", "5"), ("{{5}}", "5"),
    ("\\displaystyle\\frac{1}{2}", "0.5"), ("\\frac{1}{2}\\,", "0.5"), ("\\;7\\quad", "7"),
    ("\\text{Monday}", "Monday"), ("\\text{yes}", "Yes"), ("\\text{even}", "\\text{Even}"),
    ("\\text{no solution}", "no solution"), ("x^2+1", "x^2 + 1"), ("\\frac{x}{2}", "\\dfrac{x}{2}"),
    ("\\infty", "\\infty"),
    # unicode
    ("\u22125", "-5"), ("\u20135", "-5"), ("\uff11\uff12", "12"), ("\u0663", "3"),
    ("3\u00d74", "12"), ("\u03c0", "\\pi"), ("2\u03c0", "2\\pi"), ("\u221a4", "2"),
    ("\U0001d7d3", "5"),
    # tuples, intervals, sets, unions
    ("(1,2)", "(1, 2)"), ("(1,\\frac12)", "(1,0.5)"), ("[0,1)", "[0, 1)"),
    ("\\left(1,2\\right)", "(1,2)"), ("(-\\infty,3)", "(-\\infty, 3)"),
    ("(-\\infty,\\infty)", "(-\\infty, \\infty)"), ("[1,2)\\cup(3,4]", "(3,4]\\cup[1,2)"),
    ("\\{1,2,3\\}", "\\{3,2,1\\}"), ("3, 1, 2", "1,2,3"), ("\\{1,2\\}", "1, 2"),
    ("((1,2),(3,4))", "((1, 2), (3, 4))"), ("(1, 2, 3)", "\\left(1,2,3\\right)"),
    ("\\{-1, \\frac{1}{2}\\}", "\\{0.5, -1\\}"), ("(2, \\sqrt{2})", "(2, 2^{1/2})"),
    # multiple choice
    ("A", "A"), ("(A)", "A"), ("\\text{(A)}", "A"), ("\\textbf{(B)}", "B"), ("C", "(C)"),
    ("D.", "D"),
]


NO_MATCH = [  # near misses: must not match
    ("0.333", "\\frac{1}{3}"), ("0.3333333333", "1/3"), ("\\frac{1}{3}", "0.3333333333333333"),
    ("0.33", "0.333"), ("1/2", "2"), ("2", "\\frac{1}{2}"), ("(1,2)", "[1,2]"), ("(1,2)", "(1,2]"),
    ("(1,2)", "(2,1)"), ("(1,2)", "1,2"), ("[1,2]", "\\{1,2\\}"), ("\\{1,2\\}", "(1,2)"),
    ("(1,2,3)", "(1,2)"), ("10", "100"), ("100", "10"), ("3 or 4", "3"), ("3\\text{ or }4", "3"),
    ("3, 4", "3"), ("1,2,3,4", "3"), ("\\{3\\}", "3"), ("\\{1,2\\}", "\\{1,2,3\\}"),
    ("\\{1,1\\}", "\\{1,2\\}"), ("-5", "5"), ("5", "-5"), ("-\\frac12", "\\frac12"),
    ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt2}{2}"), ("0.866", "\\frac{\\sqrt{3}}{2}"),
    ("3.14", "\\pi"), ("\\frac{22}{7}", "\\pi"), ("\\sqrt{3}", "3"), ("2\\sqrt{3}", "2\\sqrt{2}"),
    ("\\sqrt[3]{8}", "\\sqrt{8}"), ("1.5", "1.50001"), ("1e3", "1e4"), ("2^{10}", "1000"),
    ("2^{3}", "2^{4}"), ("1.0000000001", "1"), ("1000000", "1000001"),
    ("123456789012345678901234567890", "123456789012345678901234567891"),
    ("0", "0.0001"), ("10^{10^{10}}", "10^{10^{11}}"), ("10^{10^{10}}", "1"),
    ("10^{-10^{10}}", "0"), ("\\pi^{-10^{6}}", "0"), ("2\\frac{1}{2}", "1"), ("2 1/2", "1"),
    ("50\\%", "0.5"), ("5\\%", "5.1"), ("1,000", "1"), ("1,000", "1000.5"), ("12", "1,2"),
    ("1,234", "1, 234"), ("B", "A"), ("(A)(B)", "A"), ("A, B", "A"), ("AB", "A"),
    ("\\text{(B)}", "A"), ("E", "A"), ("5", "6"), ("", "5"), ("5", ""), ("  ", "5"), ("\\$", "5"),
    ("x", "5"), ("x = 5", "6"), ("x = 5 \\text{ or } x = 6", "5"), ("5 = 5", "5"),
    ("\\infty", "-\\infty"), ("(-\\infty, 3)", "(-\\infty, 3]"),
    ("[1,2)\\cup(3,4]", "[1,2]\\cup(3,4]"), ("2.5.3", "0.75"), ("\\frac{1}{2}3", "\\frac32"),
    ("\\frac{1}{0}", "\\infty"), ("1/0", "2/0"), ("0^0", "1"), ("e", "2.718281828"),
    ("i", "-1"), ("x^2", "x^3"), ("Yes", "No"), ("\\text{Monday}", "Tuesday"),
    ("90^\\circ", "\\frac{\\pi}{2}"), ("\u0663", "4"), ("3\u00b2", "9"), ("\\sqrt{-4}", "2"),
    ("(-8)^{1/3}", "-2"), ("2\\infty", "\\infty"), ("None", "0"),
]


@pytest.mark.parametrize("pred,gold", MATCH)
def test_equivalent_forms_match(pred, gold):
    assert is_equiv(pred, gold)


@pytest.mark.parametrize("pred,gold", NO_MATCH)
def test_near_misses_do_not_match(pred, gold):
    assert not is_equiv(pred, gold)


def test_table_is_large_enough():
    assert len(MATCH) + len(NO_MATCH) >= 150


@pytest.mark.parametrize("pred,gold", MATCH[::7] + NO_MATCH[::7])
def test_is_equiv_is_symmetric(pred, gold):
    assert is_equiv(pred, gold) == is_equiv(gold, pred)


@pytest.mark.parametrize("bad", [None, 5, 5.0, b"5", ["5"]])
def test_is_equiv_non_strings_are_false(bad):
    assert not is_equiv(bad, "5") and not is_equiv("5", bad)


# ----------------------------------------------------------------------------
# extraction table


EXTRACT = [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\fbox{7}", "7"),
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\left(1, \\frac{\\sqrt{3}}{2}\\right)}", "\\left(1, \\frac{\\sqrt{3}}{2}\\right)"),
    ("so $\\boxed 5$", "5"),
    ("\\boxed{ 12 }", "12"),
    ("\\boxed{\\boxed{5}}", "5"),
    ("\\boxed{}", None),
    ("\\boxed{   }", None),
    ("\\boxed{5", None),
    ("\\boxed{5} and later \\boxed{6", None),  # the last box is cut off: truncated, scores 0
    ("\\boxedx", None),
    ("no answer here", None),
    ("", None),
    ("<think>\\boxed{3}</think> so \\boxed{4}", "4"),
    ("<think>\\boxed{3}</think> the end", None),
    ("<think>still thinking \\boxed{3}", None),
    ("reasoning \\boxed{2} </think> \\boxed{5}", "5"),
    ("<answer>12</answer>", "12"),
    ("<answer> 12 </answer> more", "12"),
    ("<answer>12", None),
    ("\\boxed{1} <answer>2</answer>", "1"),  # a box wins over every fallback
    ("blah\n#### 1,234", "1,234"),
    ("blah\n#### 72\nmore text", "72"),
    ("So the answer is 17.", "17"),
    ("The final answer is $\\frac{3}{4}$.", "$\\frac{3}{4}$"),
    ("The answer is **9**", "9"),
    ("The answer is 3.5.", "3.5"),
    ("the answer is: 2. Then I checked it.", "2"),
    ("Answer is 1. No wait, the answer is 2", "2"),
]


@pytest.mark.parametrize("text,expected", EXTRACT)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_fallbacks_switch_off():
    assert extract_answer("<answer>3</answer>", answer_tag=False) is None
    assert extract_answer("#### 5", gsm8k=False) is None
    assert extract_answer("the answer is 5", answer_is=False) is None
    assert extract_answer("\\boxed{5}", boxed=False) is None
    assert extract_answer("\\boxed{5} and the answer is 6", boxed=False) == "6"
    assert extract_answer("\\boxed{5}", boxed=True, answer_tag=False, gsm8k=False,
                          answer_is=False) == "5"


def test_extract_bounds_answer_length():
    assert extract_answer("\\boxed{" + "1" * (verify.MAX_ANSWER + 1) + "}") is None
    assert extract_answer("\\boxed{" + "1" * verify.MAX_ANSWER + "}") == "1" * verify.MAX_ANSWER
    assert extract_answer(None) is None and extract_answer(42) is None


# ----------------------------------------------------------------------------
# red team


def timed(fn, *args, repeats=3):
    """fn(*args) and its best time over a few repeats, caches cleared each time (cold calls)."""
    best = float("inf")
    for _ in range(repeats):
        verify._normalize.cache_clear()
        verify._value.cache_clear()
        t = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t)
    return out, best


MB = 1 << 20
PROMPT = "What is 2+3? Let's think step by step and output the final answer within \\boxed{}."
RED_TEAM = [  # (completion, gold, expected reward)
    ("\\boxed{3} \\boxed{4}", "3", 0.0),  # adjacent boxes are one answer, the list 3, 4
    ("\\boxed{3} \\boxed{4}", "4", 0.0),
    ("\\boxed{3}. No, \\boxed{4}", "4", 1.0),  # boxes apart: only the last counts
    (" ".join(f"\\boxed{{{i}}}" for i in range(100)), "42", 0.0),  # every candidate boxed
    ("\\boxed{" + ", ".join(map(str, range(100))) + "}", "42", 0.0),  # a boxed list of all
    ("\\boxed{" + ", ".join(map(str, range(10000))) + "}", "42", 0.0),  # ... longer than a box
    ("\\boxed{1, 2, 3, 4, 5}", "3", 0.0),
    ("\\boxed{\\{1,2,3\\}}", "2", 0.0),
    ("\\boxed{1 \\text{ or } 2 \\text{ or } 3}", "2", 0.0),
    ("\\boxed{x = 1 \\text{ or } x = 2}", "2", 0.0),
    ("\\boxed{(A)(B)(C)(D)}", "A", 0.0),
    ("\\boxed{ABCD}", "A", 0.0),
    (PROMPT, "5", 0.0),  # the question echoed back: its empty box is the last one
    ("\\boxed{5}. " + PROMPT, "5", 0.0),
    ("\\boxed{}", "5", 0.0),  # empty box
    ("\\boxed{5", "5", 0.0),  # unbalanced
    ("\\boxed{{{{5}", "5", 0.0),
    ("\\boxed{5}}}}", "5", 1.0),  # stray closers after the box are harmless
    ("}}}}\\boxed{5}", "5", 1.0),
    ("\\boxed{" + "{" * 10000 + "5" + "}" * 10000 + "}", "5", 0.0),  # deeper than a box
    ("\\boxed{" + "{" * 300 + "5" + "}" * 300 + "}", "5", 0.0),
    ("\\boxed{" + "(" * 400 + "5" + ")" * 400 + "}", "5", 0.0),
    ("\\boxed{" + "\\sqrt{" * 150 + "1" + "}" * 150 + "}", "1", 0.0),
    ("\\boxed{" + "-" * 900 + "5}", "5", 0.0),
    ("\\boxed{" + "+".join(["1"] * 400) + "}", "400", 1.0),  # long but honest arithmetic
    ("x" * MB + "\\boxed{5}", "5", 1.0),  # 1 MB strings
    ("\\boxed{5}" + "x" * MB, "5", 1.0),
    ("\\boxed{" * (MB // 7), "5", 0.0),
    ("{" * MB, "5", 0.0),
    ("\\boxed{" + "1" * MB + "}", "5", 0.0),
    ("<think>" + "\\boxed{5}" * (MB // 9), "5", 0.0),
    ("</think>" * (MB // 8) + "\\boxed{5}", "5", 1.0),
    ("the answer is " * (MB // 14), "5", 0.0),
    ("#### " * (MB // 5), "5", 0.0),
    ("<answer>" * (MB // 8) + "5</answer>", "5", 1.0),
    ("\\boxed{" + "\\text{" * 150000 + "}", "5", 0.0),
    ("\\boxed{" + "1," * 499 + "1}", "1", 0.0),
    ("\\boxed{" + " " * 990 + "5 cm}", "5", 1.0),
    ("\\boxed{10^{10^{10}}}", "1", 0.0),  # huge powers: bounded, never computed
    ("\\boxed{10^{10^{10}}}", "10^{10^{10}}", 1.0),
    ("\\boxed{2^{2^{2^{2^{2}}}}}", "0", 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", "9", 0.0),
    ("\\boxed{10^{999999999}}", "1", 0.0),
    ("\\boxed{(10^{100})^{100}}", "1", 0.0),
    ("\\boxed{1^{10^{10^{10}}}}", "2", 0.0),
    ("\\boxed{1.0000001^{10^{12}}}", "1", 0.0),
    ("\\boxed{\\pi^{10^{6}}}", "1", 0.0),
    ("\\boxed{\\pi^{-10^{6}}}", "0", 0.0),
    ("\\boxed{1e999}", "1", 0.0),
    ("\\boxed{1e999}", "1e999", 1.0),
    ("\\boxed{2^{0.5^{-1000}}}", "2", 0.0),
    ("\\boxed{\\sqrt[64]{10^{2000}}}", "1", 0.0),
    ("\\boxed{" + "9" * 999 + "}", "9" * 999, 1.0),
    ("\\boxed{" + "9" * 999 + "}", "9" * 998, 0.0),
    ("\\boxed{\u22125}", "-5", 1.0),  # unicode: minus signs and digits are normalised
    ("\\boxed{\uff15}", "5", 1.0),
    ("\\boxed{\u0665}", "5", 1.0),
    ("\\boxed{\u22125}", "5", 0.0),
    ("\\boxed{5}", "\u22125", 0.0),
    ("\\boxed{\u00b2}", "2", 0.0),  # a superscript is not a digit
    ("\\boxed{\u2167}", "8", 0.0),  # nor a Roman numeral
    ("\\boxed{__import__('os').system('echo pwned')}", "0", 0.0),  # never eval'd
    ("\\boxed{1/0}", "\\infty", 0.0),
    ("\\boxed{0^0}", "1", 0.0),
    (None, "5", 0.0),
    (b"\\boxed{5}", "5", 0.0),
]


@pytest.mark.parametrize("i", range(len(RED_TEAM)))
def test_red_team_reward_is_right_and_fast(i):
    completion, gold, expected = RED_TEAM[i]
    got, seconds = timed(reward, completion, gold)
    assert got == expected
    assert seconds < 0.050, f"{seconds * 1e3:.1f} ms"


ADVERSARIAL_ANSWERS = [
    "{" * 999, "}" * 999, "\\frac{" * 150, "\\sqrt" * 200, "\\sqrt[" * 150, "(" * 999,
    "1," * 499, "\\{" * 499, "x=" * 499, "^" * 999, "2^" * 499 + "2",
    "10^{" * 200 + "10" + "}" * 200,
    " " * 999, "\\text{" * 150 + "cm" + "}" * 150, "1" * 1000, "1." * 499, "\\cup" * 250,
    "\\left(" * 166, "9" * 10 ** 6, "\\boxed{" * 140, "\\frac12" * 140, "-" * 999 + "1",
    "[" * 500 + "]" * 499, "\\pi" * 333, "\u2212" * 999, "\uff15" * 999, "1e999" * 200,
    "\\{" + ",".join("\\{" + ",".join(str((k + j) % 14) for j in range(14)) + "\\}"
                      for k in range(14)) + "\\}",  # sets of sets: the quadratic match
]


@pytest.mark.parametrize("i", range(len(ADVERSARIAL_ANSWERS)))
def test_red_team_is_equiv_is_total_and_fast(i):
    answer = ADVERSARIAL_ANSWERS[i]
    for pred, gold in ((answer, "5"), ("5", answer), (answer, answer[:-1] or "5")):
        got, seconds = timed(is_equiv, pred, gold)
        assert got in (True, False)
        assert seconds < 0.050, f"{seconds * 1e3:.1f} ms"


# ----------------------------------------------------------------------------
# the arith task


ARITH = [  # (completion, gold, expected)
    ("579", "579", 1.0), (" 579 \n", "579", 1.0), ("123+456=579", "579", 1.0),
    ("=579", "579", 1.0), ("123+456= 579", "579", 1.0), ("0579", "579", 1.0),
    ("-5", "-5", 1.0), ("-0", "0", 1.0), ("580=579", "579", 1.0), ("9" * 32, "9" * 32, 1.0),
    ("-" + "9" * 31, "-" + "9" * 31, 1.0),
    ("1" * 33, "1" * 33, 0.0), ("-" + "9" * 32, "-" + "9" * 32, 0.0), ("57 9", "579", 0.0),
    ("579.0", "579", 0.0), ("+579", "579", 0.0), ("5,79", "579", 0.0), ("578", "579", 0.0),
    ("", "579", 0.0), ("=", "579", 0.0), ("579=", "579", 0.0), ("579=580", "579", 0.0),
    ("abc", "579", 0.0), ("579abc", "579", 0.0), ("0x243", "579", 0.0), ("5e2", "500", 0.0),
    ("1_000", "1000", 0.0), ("\uff11\uff12", "12", 0.0), ("\u0663", "3", 0.0),
    ("\u22125", "-5", 0.0), ("\\boxed{579}", "579", 0.0), ("5" * MB, "5", 0.0),
    ("=" * MB, "5", 0.0), (None, "5", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", ARITH)
def test_arith_rule(completion, gold, expected):
    got, seconds = timed(reward, completion, gold, "arith")
    assert got == expected and seconds < 0.050


# ----------------------------------------------------------------------------
# bulk and API


BULK = ([(c, g) for c, g, _ in RED_TEAM if c is None or len(c) < 100_000]
        + [(f"so \\boxed{{{p}}}", g) for p, g in MATCH + NO_MATCH])


@pytest.mark.parametrize("workers", [None, 1, 2])
def test_rewards_equals_reward_elementwise(workers):
    completions, golds = zip(*BULK)
    expected = [reward(c, g) for c, g in BULK]
    assert rewards(list(completions), list(golds), workers=workers) == expected
    assert sum(expected) > 50  # the table really mixes right and wrong


def test_rewards_arith_and_empty():
    table = [(c, g, e) for c, g, e in ARITH if c is None or len(c) < 99]
    completions, golds, expected = zip(*table)
    assert rewards(list(completions), list(golds), task="arith") == list(expected)
    assert rewards([], []) == []
    with pytest.raises(ValueError):
        rewards(["1"], [])


@pytest.mark.parametrize("gold", ["", "a,b", "123,", ",", "5,,6", " , 5", "1_000", "0x7b", "+5",
                                  "9" * 5000, None, 123, ["5"]])
def test_a_malformed_gold_scores_zero_and_never_raises(gold):
    """The verifier is total: a sets or arith gold that is not a (comma-separated list of) plain
    integer(s) scores every completion 0, the right one included, through reward and rewards."""
    completions = ["5", "123", "6", "-5", "", "1000", None]
    for task in ("sets", "arith"):
        assert rewards(completions, [gold] * len(completions), task=task) == [0.0] * 7
        assert reward("123", gold, task) == 0.0
    # A well-formed gold's values, spaced or not, still score (the rule is no wider than before).
    assert rewards(["3", "5", "4", "-7"], ["3,5,-7"] * 4, task="sets") == [1.0, 1.0, 0.0, 1.0]
    assert rewards(["3", "5"], [" 3 , 5 "] * 2, task="sets") == [1.0, 1.0]
    assert reward("42", " 42\n", "arith") == 1.0


def test_unknown_task_or_verifier_is_a_caller_error():
    with pytest.raises(ValueError, match="chess"):
        reward("\\boxed{1}", "1", task="chess")
    with pytest.raises(ValueError, match="chess"):
        rewards(["\\boxed{1}"], ["1"], task="chess")
    with pytest.raises(ValueError, match="oracle"):
        reward("\\boxed{1}", "1", verifier="oracle")


@pytest.fixture
def fake_math_verify(monkeypatch):
    """A stand-in for the optional math-verify package: it says yes to answers spelled 'half'."""
    calls = []
    fake = types.ModuleType("math_verify")
    fake.parse = lambda text, parsing_timeout=None: (calls.append(parsing_timeout), text)[1]
    fake.verify = lambda gold, pred, timeout_seconds=None: "half" in pred and "1/2" in gold
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    verify._load_math_verify.cache_clear()
    yield calls
    verify._load_math_verify.cache_clear()


def test_both_verifier_accepts_if_either_does(fake_math_verify):
    assert reward("\\boxed{half}", "1/2", verifier="rules") == 0.0
    assert reward("\\boxed{half}", "1/2", verifier="both") == 1.0
    assert reward("\\boxed{0.5}", "1/2", verifier="both") == 1.0
    assert reward("<think>\\boxed{half}", "1/2", verifier="both") == 0.0  # same extraction
    # the gold parsed once (its default timeout); a gold the rules read as a number bounds the rest
    assert fake_math_verify == [verify.MV_TIMEOUT_S, verify.MV_DECIDED_TIMEOUT_S]
    assert rewards(["\\boxed{half}"] * 3, ["1/2"] * 3, verifier="both", workers=1) == [1.0] * 3


def test_both_verifier_off_the_main_thread_skips_with_a_warning(fake_math_verify):
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = threading.Thread(target=lambda: out.append(reward("\\boxed{half}", "1/2",
                                                              verifier="both")))
        t.start()
        t.join()
    assert out == [0.0] and any("main thread" in str(w.message) for w in caught)


def test_both_verifier_without_the_package_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    verify._load_math_verify.cache_clear()
    with pytest.raises(ImportError, match="math-verify"):
        reward("\\boxed{1}", "1", verifier="both")
    verify._load_math_verify.cache_clear()


def test_rewards_survives_a_dead_worker_pool(monkeypatch):
    class Broken:
        def map(self, *args):
            raise verify.BrokenProcessPool("a worker died")
    monkeypatch.setattr(verify, "_pool", lambda workers: Broken())
    monkeypatch.setattr(verify._pool, "cache_clear", lambda: None, raising=False)
    assert rewards(["\\boxed{2}", "\\boxed{3}"], ["2", "2"], workers=2) == [1.0, 0.0]


# ----------------------------------------------------------------------------
# the lenient reading: the rules' verdict or the last number's


LAST_NUMBER = [  # (completion, its last number as last_number reads it)
    ("The sum is 57.", "57"), ("57", "57"), ("  57 \n\n", "57"), ("57!", "57"), ("(57)", "57"),
    ("no number here", None), ("", None), (None, None), (57, None), (b"57", None),
    ("12 + 45 = 57, so 57 or maybe 58", "58"), ("1 2 3", "3"),
    ("x = -3", "-3"), ("=-3", "-3"), ("5-3", "3"), ("a-3", "3"), ("\u22127", "-7"), ("--7", "-7"),
    ("1,234", "1234"), ("-1,234,567.", "-1234567"), ("3,4", "4"), ("1234,567", "567"),
    ("57.0", "57.0"), ("57.5.", "57.5"), (".5", None), ("1.", "1"),
    ("57th", None), ("x2", None), ("abc123", None), ("e=mc2", None), ("H2O is 18", "18"),
    ("a_1 = 4", "4"), ("4_", None), ("\\boxed{57}", "57"), ("$\\boxed{-57}$.", "-57"),
    ("\\frac{1}{2}", "2"), ("x^2", "2"), ("\uff15\uff17", None), ("\u0663", None),
    ("9" * 64, "9" * 64), ("9" * 65, None), ("1 " + "9" * 65, None), ("5 " + "9" * MB, None),
    ("7 " + "x" * MB, None), ("7" + " " * MB, "7"), ("-" * MB, None),
    ("7 " + "," * MB, None), ("7 " + "," * 2000, "7"),  # only the last TAIL characters are read
]


@pytest.mark.parametrize("text,expected", LAST_NUMBER)
def test_last_number(text, expected):
    assert verify.last_number(text) == expected


LENIENT = [  # (completion, gold, task, rules' verdict, lenient verdict)
    ("57", "57", "arith", 1.0, 1.0), ("The sum is 57.", "57", "arith", 0.0, 1.0),
    ("12+45=57", "57", "arith", 1.0, 1.0), ("57 is not it, 58", "57", "arith", 0.0, 0.0),
    ("57.0", "57", "arith", 0.0, 1.0), ("57.5", "57", "arith", 0.0, 0.0),
    ("=-3", "-3", "arith", 1.0, 1.0), ("\u22123", "-3", "arith", 0.0, 1.0),
    ("1,234", "1234", "arith", 0.0, 1.0), ("57th", "57", "arith", 0.0, 0.0),
    ("\\boxed{57}", "57", "arith", 0.0, 1.0), ("57", "5x", "arith", 0.0, 0.0),
    ("57", None, "arith", 0.0, 0.0), ("the value is 123", "100, 123", "sets", 0.0, 1.0),
    ("123", "100,123", "sets", 1.0, 1.0), ("124", "100,123", "sets", 0.0, 0.0),
    ("100, 123", "100,123", "sets", 0.0, 1.0), ("123", "a,b", "sets", 0.0, 0.0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", "math", 1.0, 1.0),  # the rules' yes stands
    ("so it is 0.5", "\\frac{1}{2}", "math", 0.0, 1.0),
    ("so it is 2", "\\frac{1}{2}", "math", 0.0, 0.0),
    ("\\boxed{4}, then 5", "4", "math", 1.0, 1.0), ("\\boxed{4}, then 5", "5", "math", 0.0, 1.0),
    ("so 1,000", "1000", "math", 0.0, 1.0), ("so 7", None, "math", 0.0, 0.0),
]


@pytest.mark.parametrize("completion,gold,task,rules,lenient", LENIENT)
def test_lenient_reading(completion, gold, task, rules, lenient):
    assert reward(completion, gold, task) == rules
    assert verify.lenient_rewards([completion], [gold], task) == [lenient]


def test_lenient_is_at_least_the_rules_and_never_raises():
    """On every table of this file, the ugly ones included: the lenient verdict is never below the
    rules', and reusing the rules' verdicts (rules=) changes nothing."""
    for task, table in (("math", [(c, g) for c, g, _ in RED_TEAM] + BULK),
                        ("arith", [(c, g) for c, g, _ in ARITH]),
                        ("sets", [(c, "579,12") for c, _, _ in ARITH])):
        completions, golds = map(list, zip(*table))
        rules = rewards(completions, golds, task, workers=1)
        lenient = verify.lenient_rewards(completions, golds, task, workers=1)
        assert all(x >= r for x, r in zip(lenient, rules)) and set(lenient) <= {0.0, 1.0}
        assert verify.lenient_rewards(completions, golds, task, rules=rules) == lenient
        assert sum(lenient) > sum(rules) or task == "math"  # the tables hold right sums misspelt
    with pytest.raises(ValueError):
        verify.lenient_rewards(["1"], ["1", "2"], "arith")
    with pytest.raises(ValueError):
        verify.lenient_rewards(["1"], ["1"], "arith", rules=[])


def test_on_integer_tasks_the_rules_are_a_special_case_of_the_last_number():
    """arith (and keys) and sets: every completion the rules accept has the gold as its last
    number, so lenient == rules or last-number right, the difference being form alone."""
    table = [(c, g) for c, g, _ in ARITH] + [(f"{a}+{b}={a + b}", str(a + b)) for a in (-7, 0, 98)
                                             for b in (5, 120)] + [(" \n=-0042 \n", "-42")]
    for c, g in table:
        if reward(c, g, "arith"):
            assert int(verify.last_number(c)) == int(g), c
    assert sum(reward(c, g, "arith") for c, g in table) >= 8
