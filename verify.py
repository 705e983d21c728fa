r"""verify.py: what counts as a correct answer. Pure, total, fast; standard library only.

The reward is the only teacher: the verifier must be hard to fool, must never crash or hang a
step (it never eval()s model text, never raises on it, bounds every size), and must be fast:
with N = 512 rollouts it runs tens of thousands of times per step. `python verify.py` benchmarks.

    reward(completion, gold, task="math", verifier="rules") -> 1.0 | 0.0
    rewards(completions, golds, ...)  the same for a whole step, in processes where it pays
    extract_answer(text) -> str | None;  is_equiv(pred, gold) -> bool
    lenient_rewards(completions, golds, ...)  a second, lenient reading (below): the rules' verdict
    or the last number's;  last_number(text) -> str | None

Tasks. math: extract_answer, then is_equiv with the gold. verifier="both" adds the optional
math-verify package (imported only when asked) as a second opinion on the same extracted answer:
correct if either accepts (the ProRL recipe); verifier="math_verify" asks math-verify alone.
arith, the embedded toy task ("123+456="): strip whitespace; keep what follows the last '=' (if
any), stripped; it must be a plain integer (optional '-', ASCII digits, <= 32 chars) equal as an
integer to the gold. sets (data.py): the same rule, the integer one of the gold's comma-separated
right values. A malformed gold scores every completion 0, never raises: an arith gold that is not
such a plain integer, a sets gold with a value that is not one ('', 'a,b', '123,'), a gold that is
not a string. Unknown task or verifier: ValueError (caller error). The caller cuts a completion at
its stop token.

Extraction, in order; each fallback can be switched off
  0. Only text after the last "</think>" counts; an unclosed "<think>" means no answer yet.
  1. boxed: the last \boxed{...} or \fbox{...} (or "\boxed 5"), braces balanced, \{ \} skipped.
     If a box exists it decides: empty, unclosed or > MAX_ANSWER chars -> None (truncated,
     scores 0), never an earlier box. Several boxes: the last box and the boxes just before
     it that only connectives separate from it (spaces, commas, $ or \( \), "and", \quad, a
     label such as "y =": 'x = \boxed{2}, y = \boxed{3}', '\boxed{3} and \boxed{5}') are ONE
     answer, their contents joined by ', ' (a bare comma list, so a set; a repeated box counts
     once). Boxes apart ('\boxed{4}. Wait, \boxed{5}', '\boxed{3} or \boxed{5}'): the last
     decides. Boxing every candidate gains nothing: joined they are a set, never equal to a
     scalar gold, and equal to a list gold only if exactly its elements were boxed.
  2. answer_tag: the last <answer>...</answer>.  3. gsm8k: the line after the last "####".
  4. answer_is: after the last "answer is", to the end of the sentence.
  Fallbacks 2-4 read only the last TAIL characters.

Normalisation, both sides, in order (_normalize, cached)
  1. Unicode: minus and dash signs -> '-'; multiplication signs -> '*'; division and fraction
     slash -> '/'; the pi, infinity and root signs -> \pi \infty \sqrt; the degree sign dropped;
     other decimal digits (fullwidth, Arabic-Indic, ...) -> ASCII (same value: nothing to gain).
     Any other non-ASCII, superscripts included, stays and can only match itself.
  2. One pass: $ \$ \! {,} { , } \left \right \big.. \displaystyle ^\circ \circ \degree % \%
     and the math delimiters \( \) \[ \] dropped (so 1,\!000 is 1000, 14 {, }916 is 14916,
     \(5\) is 5 and 50% == 50); a comma then \! is a thousands comma, whatever spaces follow
     (32,\! 349 is 32349); \, \; \: \quad ~ become spaces; \dfrac \tfrac \cfrac -> \frac;
     \cdot \times -> *; \div -> /.
  3. \text{} \textbf{} \mathrm{} \mbox{} ... unwrapped, or dropped (with a ^2/^3 after them)
     when they hold a unit word.
  4. A trailing unit word (cm, meters, degrees, dollars, hours, square units, percent, pct,
     percentage, ...) after a number or a space; a one-letter unit (m, s, g, h, l) only after a
     space.
  5. Thousands: a whole answer like 12,345 or 1,234.5 loses its commas ('1, 234' is a list).
  6. Mixed numbers: a whole answer '2 1/2' or '2\frac{1}{2}' is 2 + 1/2.
  7. Spaces removed; an enclosing \boxed{} or {} unwrapped; \frac12 -> \frac{1}{2}, \sqrt2 ->
     \sqrt{2}; a label on the left of the only '=' dropped: letters, commands, subscripts,
     primes and ( ) , + - * between them, no digit outside a subscript ('x =', 'a_1 =',
     '(p, q) =', 'f(x) =', 'm\angle ABC ='; '2x = 6' stays); a leading 'x \in' (a letter or
     command, optional subscript) dropped when there is no '='; a trailing '.' dropped.

Equivalence, the first rule that applies decides
  1. Same string, or two plain integers equal as integers (the fast path, before normalising).
  2. Same normalised string.
  3. A gold choice letter A-J ('C', '(C)'): the answer must be exactly that one letter.
  4. Structure: 'a \cup b' a union, \{...\} or a bare comma list a set (both unordered, each
     element used once; graders differ on a bare list, we read it as a set: it answers "find
     all ..." questions, whose order is not asked for, and an ordered answer comes in
     brackets); (...) or [...] with a comma a tuple or interval: bracket types must match
     ((1,2) != [1,2] != (1,2]), elements in order. A structure never equals a scalar: a
     box listing all candidates ('1, 2, 3') does not match '2', nor does '\{2\}'.
  5. Numbers: _Expr, a small recursive-descent parser (+ - * / ^, parentheses, \frac, \sqrt{},
     \sqrt[n]{}, \pi, \infty, implicit products like 2\sqrt{3}) gives an exact Fraction for
     integers, decimals, fractions, mixed numbers, scientific notation (1.5e3, 1.5\times10^{3}),
     integer powers and roots of perfect powers, else a float once an irrational enters. Two
     Fractions compare exactly (0.333 != 1/3, 0.5 == 1/2); otherwise relative tolerance 1e-9.
  6. Otherwise the normalised strings decide (ignoring case for plain words: Yes == yes).

Lenient reading (an instrument: evaluations report it beside the rules' verdict; never a reward)
  Correct if the rules accept the completion, or if its last number equals the gold, so that
  lenient minus rules is the share with the right value in the wrong form ("The sum is 57."). The
  last number, in the completion's last TAIL characters once trailing whitespace is stripped:
  ASCII digits with an optional sign ('-' or the minus sign U+2212, a sign only where no letter,
  digit, '_' or '.' comes just before it: '5-3' reads 3, '=-3' reads -3); a comma between groups
  of three digits is a thousands comma, dropped (1,234 is 1234; '3,4' is 3 then 4); a decimal part
  '.digits' is kept and compared exactly (57.0 == 57, 57.5 != 57). Digits joined to a letter or '_'
  on either side are no number ('4th', 'x2', 'abc123'); nor are digits just after a '.' ('.5'). A
  last number over MAX_NUMBER characters is no number (scores 0; never the number before it). No
  LaTeX is read: '\boxed{57}' reads 57, '\frac{1}{2}' reads 2. Compared with the gold as the task
  compares: arith (and keys, verified as arith) equal to the gold integer; sets, one of the gold's
  values; math, is_equiv(the number, gold). A malformed gold scores 0, as in the rules.
  On arith and sets the rules' reading is a special case of the last number's (an accepted answer
  is the text after the last '=', a plain integer of <= 32 characters at the end, with '=', a
  space or nothing before it): lenient == rules or last-number right. On math it is not (a boxed
  \frac{1}{2} has last number 2): lenient is still >= rules there, by the "or".

Limits, known and accepted
  - No symbolic algebra: 2x+3 != 3+2x, \sin 30^\circ != 1/2 (verifier="both" covers these).
  - Exact values over MAX_BITS bits and float overflow/underflow are not numbers: 10^{10^{10}}
    equals only the same text. Floating-point cancellation (\sqrt{2}\sqrt{2}-2) is not 0; a
    decimal within 1e-9 of an irrational gold counts (3.14159265359 == \pi).
  - Units are dropped, never converted: 5 hours == 5 days == 5. '1,234' is one number; '5m'
    is not 5 meters; of a box nested in a box the inner one is read.
  - An answer over MAX_ANSWER characters is no answer (and a gold that long is never matched).
  - A prompt that itself opens <think>: prepend it to the completion, or an answer inside the
    unfinished think block counts.
  - Math-verify's timeouts are SIGALRM based and work only in a main thread: rewards() runs it
    in worker processes (their main threads); reward() from another thread skips it, warning.
"""
import functools
import logging
import math
import os
import re
import threading
import unicodedata
import warnings
from concurrent.futures.process import BrokenProcessPool
from fractions import Fraction

MAX_ANSWER = 1000  # chars: a longer box or answer is not an answer (bounds all later work)
TAIL = 2048        # fallbacks 2-4 read only the end of the text
MAX_BITS = 8192    # largest exact numerator/denominator (~2466 digits); larger is not a number
MAX_ITEMS = 64     # largest tuple/set compared element-wise (the set match is quadratic)
MAX_DEPTH = 32     # deepest nesting the parser and the structure splitter accept
REL_TOL = 1e-9     # for comparisons where an irrational (float) value takes part
MV_TIMEOUT_S = 5   # math-verify's own per-call timeout (its default)
MV_DECIDED_TIMEOUT_S = 1  # its timeout where the rules read the gold as an exact number (see below)
MV_LOG_CHARS = 200  # math-verify's log lines (it logs a whole input that timed out) cut to this
MAX_NUMBER = 64   # chars: the lenient reading's longest number (the rules' integers are <= 32)
PARALLEL_MIN = 1 << 15  # rewards(): below this many math completions processes do not pay
TASKS, VERIFIERS = ("math", "arith", "sets"), ("rules", "math_verify", "both")

# ----------------------------------------------------------------------------- extraction

_SPACES, _BARE_BOX = re.compile(r" *"), re.compile(r"[^\s$]{1,%d}" % (MAX_ANSWER + 1))
_ANSWER_IS = ("answer is", "Answer is", "ANSWER IS")  # not .lower(): it can change lengths
# What may separate boxes that are one answer: spaces, commas, $ and \( \) delimiters, "and", \quad,
# and a label before the next box ("x = \boxed{2}, y = \boxed{3}"); not "or", not a sentence.
_BOX_GAP = re.compile(r"(?:[\s$,;]|\\[(),;]|\\q?quad|and|\\text\{\s*and\s*\}"
                      r"|(?<![a-zA-Z])[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?\s*=)*")
_SENTENCE = re.compile(r"[\s:]*(.*?)(?:\.\s|\n|\.?\Z)")  # "answer is: $5$." -> "$5$"


def extract_answer(text, *, boxed=True, answer_tag=True, gsm8k=True, answer_is=True):
    """The final answer of a completion (rules in the module docstring), or None."""
    if not isinstance(text, str):
        return None
    end = text.rfind("</think>")
    if end >= 0:
        text = text[end + len("</think>"):]
    elif "<think>" in text:
        return None  # cut off while thinking
    if boxed:
        start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
        if start >= 0:
            return _read_boxes(text, start)
    tail = text[-TAIL:]
    if answer_tag:
        close = tail.rfind("</answer>")
        opened = tail.rfind("<answer>", 0, close) if close >= 0 else -1
        if opened >= 0:
            return _clean(tail[opened + len("<answer>"):close])
    if gsm8k and (k := tail.rfind("####")) >= 0:
        return _clean(tail[k + 4:].split("\n", 1)[0])
    if answer_is and (k := max(tail.rfind(s) for s in _ANSWER_IS)) >= 0:
        return _clean(_SENTENCE.match(tail, k + len("answer is")).group(1))
    return None


def _read_boxes(text, start):
    """The last box, joined (', ') with the boxes just before it that only connectives separate."""
    answer, _ = _read_box(text, start)
    answers = [answer]
    while answer is not None and len(answers) < MAX_ITEMS:
        if "}" not in text[max(0, start - 48):start]:  # no box closes just before: the usual case
            break
        lo = max(0, start - 56 - MAX_ANSWER)  # where a box that closes within 48 chars can start
        prev = max(text.rfind("\\boxed", lo, start), text.rfind("\\fbox", lo, start))
        if prev < 0:
            break
        answer, end = _read_box(text, prev)
        if (answer is None or end > start or start - end > 48
                or not _BOX_GAP.fullmatch(text, end, start)):
            break
        if answer not in answers:  # the same box twice is one answer
            answers.append(answer)
        start = prev
    return answers[0] if len(answers) == 1 else ", ".join(reversed(answers))


def _read_box(text, start):
    """(the box's content or None, the index just past it)."""
    i = start + (6 if text.startswith("\\boxed", start) else 5)  # len("\\boxed"), len("\\fbox")
    j = _SPACES.match(text, i).end()
    if not text.startswith("{", j):
        m = _BARE_BOX.match(text, j) if j > i else None  # "\boxed 5"
        return (_clean(m.group()), m.end()) if m else (None, j)
    window = text[j + 1:j + 2 + MAX_ANSWER]  # an answer longer than this is no answer
    # Mask escapes with same-length blanks (\\ first, so \\} is a newline then a real brace);
    # the box closes at the first } with as many { before it as } (counted in C, not a loop).
    masked = window.replace("\\\\", "  ").replace("\\{", "  ").replace("\\}", "  ")
    close = masked.find("}")
    while close >= 0:
        if masked.count("{", 0, close) == masked.count("}", 0, close):
            return _clean(window[:close]), j + 2 + close
        close = masked.find("}", close + 1)
    return None, len(text)  # unbalanced within MAX_ANSWER: truncated


def _clean(s):
    s = s.strip().strip("*").strip()  # markdown bold around "the answer is **5**"
    return s if 0 < len(s) <= MAX_ANSWER else None

# ----------------------------------------------------------------------------- normalisation

_UNICODE = str.maketrans({
    **dict.fromkeys("\u2212\u2010\u2011\u2012\u2013\u2014\ufe63\uff0d", "-"),
    **dict.fromkeys("\u00d7\u22c5\u00b7", "*"), **dict.fromkeys("\u00f7\u2044", "/"),
    "\u03c0": "\\pi", "\u221e": "\\infty", "\u221a": "\\sqrt", "\u00b0": "",
    "\uff0c": ",", "\uff0e": ".", "\uff08": "(", "\uff09": ")"})
_UNITS = set("""cm mm km m meter meters metre metres centimeter centimeters kilometer kilometers
    millimeter millimeters in inch inches ft foot feet yd yard yards mile miles unit units deg
    degree degrees rad radian radians s sec second seconds min minute minutes h hr hrs hour hours
    day days week weeks month months year years dollar dollars cent cents percent g gram grams kg
    kilogram kilograms lb lbs pound pounds oz ounce ounces l liter liters litre litres ml mph
    pct percentage percentages
    """.split())
_REWRITES = {  # LaTeX that only needs a rewrite, done in one regex pass
    **dict.fromkeys(("\\left", "\\right", "\\big", "\\Big", "\\bigg", "\\Bigg", "\\bigl", "\\bigr",
                     "\\Bigl", "\\Bigr", "\\displaystyle", "\\!", "\\$", "$", "\\%", "%", "{,}",
                     "\\circ", "\\degree", "\\(", "\\)", "\\[", "\\]"), ""),
    **dict.fromkeys(("\\,", "\\;", "\\:", "\\ ", "\\quad", "\\qquad", "~"), " "),
    **dict.fromkeys(("\\dfrac", "\\tfrac", "\\cfrac"), "\\frac"),
    "\\cdot": "*", "\\times": "*", "\\div": "/"}
_COMMAND = re.compile(r",\s*\\!\s*|\{,\s*\}|\^\{?\\circ\}?|\\[a-zA-Z]+|\\[,;: !$%()\[\]]|[$%~]")
_POWER = r"(?:\^\{?[23]\}?)?"  # cm^2, cm^{3}
_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|boldsymbol"
                   rf"|mbox|operatorname)\s*\{{([^{{}}]*)\}}({_POWER})")
_UNIT_TAIL = re.compile(rf"(?<=[0-9}}\s])((?:(?:square|sq|cubic)\.?\s+)?[a-zA-Z]+){_POWER}\.?$")
_THOUSANDS = re.compile(r"-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")
_MIXED = re.compile(r"(-?)([0-9]+)\s+([0-9]+)/([0-9]+)")
_MIXED_TEX = re.compile(r"(-?)([0-9]+)\\frac\{([0-9]+)\}\{([0-9]+)\}")
_BARE_ARG = re.compile(r"\\(frac|sqrt)([0-9])")     # \frac12 -> \frac{1}2, \sqrt2 -> \sqrt{2}
_BARE_ARG2 = re.compile(r"(\\frac\{[^{}]*\})([0-9])")  # \frac{1}2 -> \frac{1}{2}
_LHS = re.compile(r"(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?[a-zA-Z0-9]+\}?)?\\in(?![a-zA-Z])")  # x \in
# A label: letters, commands, subscripts, primes, and ( ) , + - * between them; no digit but in a
# subscript.
_LABEL = re.compile(r"(?:[a-zA-Z(]|\\[a-zA-Z]+)"
                    r"(?:[a-zA-Z(),+\-*']|\\[a-zA-Z]+|_\{?[a-zA-Z0-9]+\}?)*=")


def _to_ascii(s):
    s = s.translate(_UNICODE)
    return "".join(str(unicodedata.decimal(c)) if c.isdecimal() and not c.isascii() else c
                   for c in s)


def _rewrite(m):
    t = m.group()
    if t[0] in "^{,":  # ^\circ, ^{\circ}, {,}, { , } -> ""; a thousands separator ',\! ' -> ','
        return "," if t[0] == "," else ""
    return _REWRITES.get(t, t)


def _is_unit(words):
    words = words.lower().split()
    if len(words) == 2 and words[0].rstrip(".") in ("square", "sq", "cubic"):
        words = words[1:]
    return len(words) == 1 and words[0] in _UNITS


def _unwrap(m):  # \text{ cm}^2 -> dropped; \text{Monday} -> Monday
    return " " if _is_unit(m.group(1)) else m.group(1) + m.group(2)


def _strip_unit(s):
    """5 cm -> 5, 5cm -> 5, 10 m -> 10, but 5m stays: a one-letter unit needs a space."""
    m = _UNIT_TAIL.search(s, max(0, len(s) - 48))  # only the end: bounded regex work
    if m and _is_unit(m.group(1)) and (len(m.group(1)) > 1 or s[m.start() - 1] == " "):
        return s[:m.start()].strip()
    return s


@functools.lru_cache(maxsize=1 << 14)
def _normalize(s):
    """One canonical spelling of an answer (rules 1-7 of the module docstring). Each step runs
    only when a cheap substring test says it can apply: this is the hot path for new answers."""
    if not s.isascii():
        s = _to_ascii(s)
    s = " ".join(_COMMAND.sub(_rewrite, s).split())  # from here on, only single spaces
    if "\\" in s and "{" in s:
        for _ in range(3):  # nested \text{\textbf{...}}
            s, n = _TEXT.subn(_unwrap, s)
            if not n:
                break
    s = _strip_unit(s.strip())
    if "," in s and _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if "/" in s and (m := _MIXED.fullmatch(s)):
        s = f"{m[1]}({m[2]}+{m[3]}/{m[4]})"
    s = s.replace(" ", "")
    if s.startswith("\\boxed{") and s.endswith("}") and _encloses(s[6:]):
        s = s[7:-1]
    for _ in range(3):  # {{5}} -> 5; bounded, as _encloses is linear
        if s[:1] == "{" and s[-1:] == "}" and _encloses(s):
            s = s[1:-1]
    if "\\frac" in s or "\\sqrt" in s:
        if m := _MIXED_TEX.fullmatch(s):
            s = f"{m[1]}({m[2]}+{m[3]}/{m[4]})"
        s = _BARE_ARG2.sub(r"\1{\2}", _BARE_ARG.sub(r"\\\1{\2}", s))
    if s.count("=") == 1 and (m := _LABEL.match(s)) and re.search("[a-zA-Z]", m.group()):
        s = s[m.end():] or s  # 'x =' alone stays
    elif "\\in" in s and "=" not in s and (m := _LHS.match(s)):
        s = s[m.end():] or s
    return s[:-1] if s.endswith(".") else s


def _encloses(s):
    """Whether s[0] is an opening bracket closed exactly by s[-1]."""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth <= 0:
                return depth == 0 and i == len(s) - 1
    return False


def _split_top(s):
    """Split on the commas outside any bracket."""
    if "," not in s:
        return [s]
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]

# ----------------------------------------------------------------------------- values

class _Reject(Exception):
    """Not a number we can evaluate safely: the caller falls back to string comparison."""


_TOKEN = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?"
                    r"|\\[a-zA-Z]+|[-+*/^()\[\]{}]")
_FACTOR_START = ("(", "\\frac", "\\sqrt", "\\pi")  # what may follow a factor in 2\sqrt{3}


class _Expr:
    r"""Recursive descent over the numeric subset of LaTeX, binding loosest first:
        expr  := term (('+' | '-') term)*
        term  := unary (('*' | '/') unary | power)*        implicit product: 2\sqrt{3}, 3\pi
        unary := ('+' | '-') unary | power
        power := atom ('^' unary)?                          right-associative: 2^3^2 = 2^9
        atom  := NUM | (expr) | {expr} | \frac arg arg | \sqrt([expr])? arg | \pi | \infty
        arg   := {expr} | atom
    Values stay exact Fractions until an irrational makes them floats. An implicit product
    never starts with a number ('2.5.3' and '\sqrt{2}3' are rejected, not 2.5 * .3)."""

    def __init__(self, s):
        self.toks = _TOKEN.findall(s)
        if sum(map(len, self.toks)) != len(s):
            raise _Reject  # a character outside the grammar
        self.toks.append("")  # end sentinel: self.toks[self.i] is always the next token
        self.i, self.depth = 0, 0

    def value(self):
        v = self.expr()
        if self.toks[self.i]:
            raise _Reject  # trailing tokens
        return v

    def take(self, want=None):
        t = self.toks[self.i]
        if not t or (want and t != want):
            raise _Reject
        self.i += 1
        return t

    def expr(self):
        v = self.term()
        while (t := self.toks[self.i]) in ("+", "-"):
            self.i += 1
            v = _arith(t, v, self.term())
        return v

    def term(self):
        v = self.unary()
        while True:
            if (t := self.toks[self.i]) in ("*", "/"):
                self.i += 1
                v = _arith(t, v, self.unary())
            elif t in _FACTOR_START:
                v = _arith("*", v, self.power())
            else:
                return v

    def unary(self):
        self.depth += 1  # every nesting passes through here: bound it, no RecursionError
        if self.depth > MAX_DEPTH:
            raise _Reject
        if (t := self.toks[self.i]) in ("+", "-"):
            self.i += 1
            v = self.unary()
            v = -v if t == "-" else v
        else:
            v = self.power()
        self.depth -= 1
        return v

    def power(self):
        base = self.atom()
        if self.toks[self.i] == "^":
            self.i += 1
            return _power(base, self.unary())
        return base

    def atom(self):
        t = self.take()
        if t.isdigit():  # ASCII only: the lexer admits no other digits
            return Fraction(int(t))  # much faster than parsing the string
        if t[0] in "0123456789.":
            return _bounded(Fraction(t))
        if t in ("(", "{"):
            v = self.expr()
            self.take(")" if t == "(" else "}")
            return v
        if t == "\\frac":
            return _arith("/", self.arg(), self.arg())
        if t == "\\sqrt":
            n = Fraction(2)
            if self.toks[self.i] == "[":
                self.i += 1
                n = self.expr()
                self.take("]")
            return _root(self.arg(), n)
        if t == "\\pi":
            return math.pi
        if t == "\\infty":
            return math.inf
        raise _Reject

    def arg(self):
        if self.toks[self.i] == "{":
            self.i += 1
            v = self.expr()
            self.take("}")
            return v
        return self.atom()


def _bounded(r, nonzero=False):
    """r itself, unless it is too big to be exact or a float overflowed or underflowed."""
    if isinstance(r, Fraction):
        if r.numerator.bit_length() > MAX_BITS or r.denominator.bit_length() > MAX_BITS:
            raise _Reject
    elif not math.isfinite(r) or (nonzero and r == 0):
        raise _Reject
    return r


def _finite(*xs):
    if any(isinstance(x, float) and math.isinf(x) for x in xs):
        raise _Reject  # \infty appears alone or negated, never in arithmetic


def _arith(op, a, b):
    _finite(a, b)
    if op == "+":
        return _bounded(a + b)
    if op == "-":
        return _bounded(a - b)
    if op == "*":
        return _bounded(a * b, nonzero=a != 0 and b != 0)
    if b == 0:
        raise _Reject
    return _bounded(a / b, nonzero=a != 0)


def _power(a, b):
    _finite(a, b)
    if isinstance(a, Fraction) and isinstance(b, Fraction) and b.denominator == 1:
        e = b.numerator
        if a == 0 and e <= 0:
            raise _Reject
        if a in (0, 1):
            return a
        if a == -1:
            return Fraction(-1 if e % 2 else 1)
        if max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(e) > MAX_BITS:
            raise _Reject  # checked before computing: 10^{10^{10}} costs nothing
        return a ** e
    x, y = float(a), float(b)
    if (x < 0 and not y.is_integer()) or (x == 0 and y <= 0):
        raise _Reject
    return _bounded(math.pow(x, y), nonzero=x != 0)


def _root(x, n):
    if not (isinstance(n, Fraction) and n.denominator == 1 and 2 <= n <= 64):
        raise _Reject
    _finite(x)
    n = int(n)
    if x < 0:
        if n % 2 == 0:
            raise _Reject
        return -_root(-x, Fraction(n))
    if isinstance(x, Fraction):
        p, q = _iroot(x.numerator, n), _iroot(x.denominator, n)
        if p is not None and q is not None:
            return Fraction(p, q)  # \sqrt{4/9} = 2/3 stays exact
    return _bounded(float(x) ** (1.0 / n))


def _iroot(m, n):
    """The integer r with r**n == m, or None."""
    if n == 2:
        r = math.isqrt(m)
        return r if r * r == m else None
    g = round(m ** (1.0 / n))
    return next((r for r in (g - 1, g, g + 1) if r >= 0 and r ** n == m), None)


_INT = re.compile(r"-?[0-9]+")
_DEC = re.compile(r"-?(?:[0-9]+\.[0-9]*|\.[0-9]+)")


def _number(s):
    """Fraction | float | None."""
    if _INT.fullmatch(s):
        return Fraction(int(s))  # at most MAX_ANSWER digits: within MAX_BITS
    if _DEC.fullmatch(s):
        return Fraction(s)
    try:
        return _Expr(s).value()
    except (_Reject, ArithmeticError, ValueError):
        return None


@functools.lru_cache(maxsize=1 << 14)
def _value(s):
    return _parse_value(s, 0)


def _parse_value(s, depth):
    """A normalised answer as ('num', x) | ('seq', brackets, items) | ('set' | 'union', items)
    | ('str', s), the comparable form of rule 4-6 of is_equiv."""
    if depth > MAX_DEPTH or not s:
        return ("str", s)
    items = None
    if "\\cup" in s:
        kind, items = "union", s.split("\\cup")
    elif s.startswith("\\{") and s.endswith("\\}") and _encloses(s[1:]):
        kind, items = "set", _split_top(s[2:-2])
    elif s[0] in "([" and s[-1] in ")]" and _encloses(s) and len(parts := _split_top(s[1:-1])) > 1:
        kind, items = "seq", parts
    elif len(parts := _split_top(s)) > 1:
        kind, items = "set", parts
    if items is not None:
        if len(items) > MAX_ITEMS:
            return ("str", s)
        values = tuple(_parse_value(x, depth + 1) for x in items)
        return ("seq", s[0] + s[-1], values) if kind == "seq" else (kind, values)
    x = _number(s)
    return ("str", s) if x is None else ("num", x)


def _close(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b  # exact: 0.333 is not 1/3
    try:
        x, y = float(a), float(b)
    except OverflowError:
        return False
    if math.isinf(x) or math.isinf(y):
        return x == y
    return math.isclose(x, y, rel_tol=REL_TOL)


def _same(a, b):
    if a[0] != b[0]:
        return False  # a structure never equals a scalar, a tuple never a set
    if a[0] == "num":
        return _close(a[1], b[1])
    if a[0] == "str":
        return a[1] == b[1] or (len(a[1]) > 1 and a[1].isalpha() and a[1].lower() == b[1].lower())
    if a[0] == "seq":
        return a[1] == b[1] and len(a[2]) == len(b[2]) and all(map(_same, a[2], b[2]))
    rest = list(b[1])  # set or union: unordered, each element matched once
    if len(a[1]) != len(rest):
        return False
    for x in a[1]:
        j = next((j for j, y in enumerate(rest) if _same(x, y)), None)
        if j is None:
            return False
        del rest[j]
    return True

# ----------------------------------------------------------------------------- equivalence

_CHOICE = re.compile(r"\(?([A-J])\)?")


def is_equiv(pred, gold):
    """Whether the answer pred means the gold answer (rules in the module docstring)."""
    try:
        return _equiv(pred, gold)
    except Exception:  # a bug here must cost one reward, never a training step
        return False


def _equiv(pred, gold):
    if not (isinstance(pred, str) and isinstance(gold, str)):
        return False
    p, g = pred.strip(), gold.strip()
    if not p or not g or len(p) > MAX_ANSWER:
        return False
    if p == g:
        return True
    if len(g) > MAX_ANSWER:
        return False
    if _INT.fullmatch(p) and _INT.fullmatch(g):
        return int(p) == int(g)  # the fast path: most answers are integers
    pn, gn = _normalize(p), _normalize(g)
    if not pn or not gn:
        return False
    if pn == gn:
        return True
    if c := _CHOICE.fullmatch(gn):
        return (m := _CHOICE.fullmatch(pn)) is not None and m[1] == c[1]
    return _same(_value(pn), _value(gn))

# ----------------------------------------------------------------------------- rewards

_PLAIN_INT = re.compile(r"-?[0-9]{1,32}")


def _gold_set(gold):
    """The sets task's right values: its gold "v1,v2,..." as a frozenset of ints. A malformed gold
    (not a string, or a value that is not a plain integer once stripped: '', 'a,b', '123,') is the
    empty set, which no completion is in: the verifier is total, a bad gold costs its rewards."""
    return _parse_gold_set(gold) if isinstance(gold, str) else frozenset()


@functools.lru_cache(maxsize=4096)
def _parse_gold_set(gold):
    values = [v.strip() for v in gold.split(",")]
    if not all(_PLAIN_INT.fullmatch(v) for v in values):
        return frozenset()
    return frozenset(int(v) for v in values)


def _gold_int(gold):
    """The arith task's right value, or None for a malformed gold (as _gold_set's): matches none."""
    s = gold.strip() if isinstance(gold, str) else ""
    return int(s) if _PLAIN_INT.fullmatch(s) else None


def reward(completion, gold, task="math", verifier="rules"):
    """1.0 if the completion's answer is right, else 0.0. Raises only on caller error."""
    _check(task, verifier)
    return _score(completion, gold, task, verifier)


def _score(completion, gold, task, verifier):
    if not isinstance(completion, str):
        return 0.0
    if task in ("arith", "sets"):  # sets: the gold is the comma-separated right values
        s = completion.strip()
        s = s[s.rfind("=") + 1:].strip()
        if len(s) > 32 or _PLAIN_INT.fullmatch(s) is None:
            return 0.0
        return float(int(s) in _gold_set(gold) if task == "sets" else int(s) == _gold_int(gold))
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    if (verifier != "math_verify" and is_equiv(answer, gold)) or \
            (verifier != "rules" and _math_verify_accepts(answer, gold)):
        return 1.0
    return 0.0


def rewards(completions, golds, task="math", verifier="rules", workers=None):
    """[reward(c, g, task, verifier) for c, g in zip(completions, golds)], in worker processes
    when it pays. workers=None decides: one process per CPU but one (left to the trainer), up
    to 8, for math-verify (always: also the only way its timeouts work off the main thread) and
    for >= PARALLEL_MIN math completions; otherwise here. workers=1 forces here."""
    _check(task, verifier)
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
    n = len(completions)
    if workers is None:
        mv = verifier != "rules" and task == "math"
        big = n >= 16 if mv else (task == "math" and n >= PARALLEL_MIN)
        workers = min(_cpus() - 1, 8) if big else 1
        if mv and threading.current_thread() is not threading.main_thread():
            workers = max(workers, 2)
    if workers <= 1 or n < 2:
        return [_score(c, g, task, verifier) for c, g in zip(completions, golds)]
    size = -(-n // (4 * workers))  # 4 chunks per worker: balances uneven chunks
    jobs = [(completions[i:i + size], golds[i:i + size], task, verifier) for i in range(0, n, size)]
    try:
        return [r for part in _pool(workers).map(_score_chunk, jobs) for r in part]
    except BrokenProcessPool:  # a worker died (OOM, killed): score here rather than fail a step
        _pool.cache_clear()
        return [_score(c, g, task, verifier) for c, g in zip(completions, golds)]


def _score_chunk(job):
    completions, golds, task, verifier = job
    return [_score(c, g, task, verifier) for c, g in zip(completions, golds)]


def _cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def _pool(workers):
    """A persistent pool, started on first use and reused every step. forkserver, not fork: the
    trainer has threads (torch, CUDA) that fork would copy mid-flight. Workers import the
    caller's __main__ module once, so keep its work under `if __name__ == "__main__":`."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return ProcessPoolExecutor(workers, mp_context=ctx)


def _check(task, verifier):
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {TASKS}")
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}: expected one of {VERIFIERS}")
    if verifier != "rules":
        _load_math_verify()  # fail at once, not after the first disagreement


@functools.lru_cache(maxsize=None)
def _load_math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("verifier 'math_verify' or 'both' needs the optional math-verify "
                          "package: pip install math-verify") from e
    for name in [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] == "math_verify"]:
        logging.getLogger(name).addFilter(_shorten_log)  # its loggers: a whole input never printed
    return math_verify


def _shorten_log(record):
    """A math-verify log record cut to MV_LOG_CHARS, its traceback to one line: it logs the whole
    input that timed out or failed to parse (a 1 MB answer would be printed whole)."""
    msg = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
        msg += f" ({type(record.exc_info[1]).__name__})"
    if len(msg) > MV_LOG_CHARS:
        msg = msg[:MV_LOG_CHARS] + f"... ({len(msg)} characters)"
    record.msg, record.args, record.exc_info, record.exc_text = msg, (), None, None
    return True


def choose_verifier(task, asked="auto"):
    """The verifier a run uses: the arith task has a rule of its own (rules, whatever was
    asked); on math, auto is the paper's (rules or Math-Verify: both) when math-verify is
    installed, else rules. Asking for math_verify or both without the package raises ImportError
    saying what to install."""
    if task in ("arith", "sets"):
        return "rules"
    try:
        _load_math_verify()
        installed = True
    except ImportError:
        if asked not in ("auto", "rules"):
            raise ImportError("needs the math-verify package (pip install math-verify)") from None
        installed = False
    return ("both" if installed else "rules") if asked == "auto" else asked


def _math_verify_accepts(answer, gold):
    """The second opinion, on the answer we extracted (so the think and last-box rules hold)."""
    if threading.current_thread() is not threading.main_thread():
        warnings.warn("math-verify's timeouts need a main thread: second opinion skipped here "
                      "(rewards() runs it in worker processes)", RuntimeWarning, stacklevel=3)
        return False
    if len(answer) > MAX_ANSWER:  # no answer (the rules' bound), whoever judges it
        return False
    mv = _load_math_verify()
    try:
        parsed_gold, timeout = _math_verify_gold(mv, gold)
        parsed = mv.parse("\\boxed{" + answer + "}", parsing_timeout=timeout)
        return bool(mv.verify(parsed_gold, parsed, timeout_seconds=timeout))
    except Exception:  # its timeouts and parse errors alike: no second yes
        return False


@functools.lru_cache(maxsize=1 << 12)
def _math_verify_gold(mv, gold):
    """A gold as math-verify (the module mv) parses it, once per gold, not once per rollout, and the
    timeout of the calls that compare with it: MV_DECIDED_TIMEOUT_S where the rules read it as a
    number (they have already judged every answer that is one; math-verify is a second opinion on
    symbolic forms, and an answer like 1000000! would otherwise cost its whole 5 s), else
    MV_TIMEOUT_S."""
    g = gold.strip()
    try:
        numeric = 0 < len(g) <= MAX_ANSWER and bool(_INT.fullmatch(g) or _value(_normalize(g))[0]
                                                     == "num")
    except Exception:  # (the rules never raise on a gold; if they did, the longer timeout)
        numeric = False
    parsed = mv.parse("\\boxed{" + gold + "}", parsing_timeout=MV_TIMEOUT_S)
    return parsed, MV_DECIDED_TIMEOUT_S if numeric else MV_TIMEOUT_S

# ----------------------------------------------------------------------------- lenient reading

# A number (rules in the module docstring): sign, digits or thousands groups, a decimal part; not
# joined to a word. The lookbehind also sees the text before the window, so a cut number is none.
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-\u2212]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"
                     r"(?:\.[0-9]+)?(?![A-Za-z0-9_])")


def last_number(text):
    """The completion's last number as plain text ('-1234', '57.5': the sign '-', no commas), or
    None: none, or the last one longer than MAX_NUMBER characters."""
    if not isinstance(text, str):
        return None
    s = text.rstrip()
    last = None
    for last in _NUMBER.finditer(s, max(0, len(s) - TAIL)):
        pass
    if last is None or len(last.group()) > MAX_NUMBER:
        return None
    return last.group().replace(",", "").replace("\u2212", "-")


def _number_right(completion, gold, task):
    """Whether the completion's last number is the gold answer (compared as the task compares)."""
    try:
        number = last_number(completion)
        if number is None:
            return False
        if task == "math":
            return is_equiv(number, gold)
        value = Fraction(number)
        if task == "sets":
            return value in _gold_set(gold)
        gold_int = _gold_int(gold)
        return gold_int is not None and value == gold_int
    except Exception:  # a bug here must cost one lenient verdict, never an evaluation
        return False


def lenient_rewards(completions, golds, task="math", verifier="rules", workers=None, rules=None):
    """1.0 where the rules accept a completion (rewards(), or the verdicts `rules` the caller has
    already computed for these completions) or its last number is the gold, else 0.0."""
    _check(task, verifier)
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
    if rules is None:
        rules = rewards(completions, golds, task, verifier, workers)
    elif len(rules) != len(golds):
        raise ValueError(f"{len(rules)} verdicts but {len(golds)} golds")
    return [1.0 if r else float(_number_right(c, g, task))
            for r, c, g in zip(rules, completions, golds)]

# ----------------------------------------------------------------------------- benchmark

def _synthetic(kind, rng, n_golds=128, n_rollouts=512):
    """n_golds x n_rollouts completions (a BroRL step: B = 128, N = 512): a few hundred chars of
    reasoning, then a boxed answer. Half are right, in one of a few equivalent spellings (so a
    prompt's right answers repeat, as in training); the wrong ones are all different."""
    words = "so we get then let note that hence thus the sum of is equal to which gives".split()
    texts = [" ".join(rng.choice(words) if rng.random() < 0.8 else f"${rng.randint(2, 99)}x$"
                      for _ in range(rng.randint(60, 140))) for _ in range(1000)]
    completions, golds, labels = [], [], []
    for _ in range(n_golds):
        a, b, c = rng.randint(1, 999), rng.randint(2, 99), rng.randint(2, 97)
        p, q = Fraction(a, b).numerator, Fraction(a, b).denominator
        gold, right, wrong = {  # (gold, [equivalent spellings], a wrong answer for k = 1, 2, ...)
            "integer": (str(37 * a), [str(37 * a)], lambda k: str(37 * a + k)),
            "fraction": (f"\\frac{{{p}}}{{{q}}}", [f"{p}/{q}", f"\\dfrac{{{p}}}{{{q}}}"],
                         lambda k: f"{p * k + 1}/{q * k}"),
            "latex": (f"\\frac{{{a}\\sqrt{{{c}}}}}{{{b}}}", [f"\\dfrac{{{a}}}{{{b}}}\\sqrt{{{c}}}",
                      f"{a}\\sqrt{{{c}}}/{b}"], lambda k: f"\\frac{{{a}\\sqrt{{{c + k}}}}}{{{b}}}"),
            "tuple": (f"({a}, \\frac{{1}}{{{b}}})", [f"\\left({a},\\frac1{{{b}}}\\right)"],
                      lambda k: f"({a + k}, \\frac{{1}}{{{b}}})"),
            "arith": (str(a + 100 * b), [f"{a}+{100 * b}={a + 100 * b}"],
                      lambda k: str(a + 100 * b + k)),
        }[kind]
        for _ in range(n_rollouts):
            ok = rng.random() < 0.5
            answer = rng.choice(right) if ok else wrong(rng.randint(1, 10 ** 6))
            text = f"{rng.choice(texts)}. So $\\boxed{{{answer}}}$."
            completions.append(answer if kind == "arith" else text)
            golds.append(gold)
            labels.append(float(ok))
    return completions, golds, labels


def _benchmark():
    import random
    import time
    rng = random.Random(0)
    t = time.perf_counter()
    rewards(["\\boxed{1}"] * 64, ["1"] * 64, workers=2)  # start the pool once, as training does
    print(f"verify.py: completions/s over 128 golds x 512 rollouts = 65,536 completions per kind"
          f"\n{_cpus()} CPUs, load average {os.getloadavg()[0]:.1f}; worker pool start "
          f"{time.perf_counter() - t:.2f} s (once per run)")
    print(f"{'answer kind':12} {'chars':>6} {'1 process':>10} {'rewards()':>10} {'2 workers':>10}")
    for kind in ("integer", "fraction", "latex", "tuple", "arith"):
        completions, golds, labels = _synthetic(kind, rng)
        speeds = []
        for workers in (1, None, 2):
            _normalize.cache_clear()  # cold caches: only this step's own repeats hit
            _value.cache_clear()
            t = time.perf_counter()
            task = "arith" if kind == "arith" else "math"
            got = rewards(completions, golds, task, workers=workers)
            speeds.append(f"{len(got) / (time.perf_counter() - t):10,.0f}")
            assert got == labels, f"{kind}: {sum(g != e for g, e in zip(got, labels))} wrong"
        print(f"{kind:12} {sum(map(len, completions)) / len(completions):6.0f} {' '.join(speeds)}")


if __name__ == "__main__":
    _benchmark()
