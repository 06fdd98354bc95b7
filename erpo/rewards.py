"""Rule-based rewards: score a completion against a gold answer.

The prompt template asks the model to put its final answer in ``\\boxed{...}``, so
every reward here reads only the last complete ``\\boxed{}`` of the completion; a
completion without one scores 0. A reward is a function ``(completion, answer) ->
float`` in [0, 1]; the registry ``REWARDS`` maps the config name to it.

- ``exact_match``: string equality after light normalisation (whitespace, integers
  with leading zeros, surrounding ``$``). Fast, no dependencies.
- ``math_verify``: HF math-verify parses both sides into SymPy and checks
  equivalence (``\\frac{1}{2}`` == ``0.5``, ``2x+1`` == ``1+2x``). SymPy can take
  forever on adversarial input (``2^{10^{10^{10}}}``), so each call has a wall-clock
  deadline of ``MATH_VERIFY_TIMEOUT_S``: a SIGALRM timer in the main thread, a
  killable worker process in any other thread (signals only work in the main
  thread). A call that runs out of time scores 0. (Windows has neither SIGALRM nor
  select on pipes: there the check runs without a deadline.)

DAPO's overlong reward shaping (``overlong_penalty``) is added to the reward of a
response by its length alone: 0 up to ``max_new_tokens - buffer`` tokens, then a
penalty growing linearly to ``-penalty`` at ``max_new_tokens``.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

__all__ = [
    "CORRECT_THRESHOLD",
    "MATH_VERIFY_TIMEOUT_S",
    "REWARDS",
    "exact_match_reward",
    "extract_answer",
    "extract_boxed",
    "get_reward_fn",
    "math_verify_reward",
    "overlong_penalty",
]

# A response counts as correct (reward/accuracy, evaluation) when its reward reaches this;
# the built-in rewards are 0/1.
CORRECT_THRESHOLD = 0.5
# Wall-clock budget of one math_verify_reward call (parse both sides + verify).
MATH_VERIFY_TIMEOUT_S = 5.0
# Longer boxed answers are not math answers; refusing them keeps SymPy out of trouble.
MAX_ANSWER_CHARS = 512

_BOX_OPEN = re.compile(r"\\boxed\s*\{")
_INTEGER = re.compile(r"[+-]?\d+")
_WHITESPACE = re.compile(r"\s+")


def _closing_brace(text: str, start: int) -> int:
    """Index of the ``}`` closing the group whose content starts at ``text[start]``, or -1.

    Escaped braces (``\\{``, ``\\}``) do not count.
    """
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, whatever it is
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last complete ``\\boxed{...}`` in ``text`` (outer braces removed,
    nested braces kept), or None when there is none.

    Boxes are read left to right at top level, so a box inside a box is part of the
    outer content; a box that never closes (a truncated generation) is skipped.
    """
    last = None
    pos = 0
    while True:
        match = _BOX_OPEN.search(text, pos)
        if match is None:
            return last
        close = _closing_brace(text, match.end())
        if close < 0:
            pos = match.end()  # unclosed: look for complete boxes after its opening
        else:
            last = text[match.end():close]
            pos = close + 1


def extract_answer(text: str) -> Optional[str]:
    """The completion's final answer: its last ``\\boxed{}`` content, else None.

    The prompt template asks for the answer in ``\\boxed{}``; nothing else (a trailing
    number, "The answer is ...") counts, so the reward teaches the format too.
    """
    return extract_boxed(text)


def _normalise(answer: str) -> str:
    """Whitespace-free answer string; integers in canonical form ("07" -> "7", "+3" -> "3")."""
    s = answer.strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s.strip("$")
    s = _WHITESPACE.sub("", s)
    if _INTEGER.fullmatch(s):
        s = str(int(s))
    return s


def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's boxed answer equals ``answer`` after normalisation, else 0.0.

    Normalisation drops all whitespace and surrounding ``$``, and writes integers
    canonically ("07" == "7", "-0" == "0"); nothing else is equated.
    """
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    return 1.0 if _normalise(predicted) == _normalise(answer) else 0.0


# ----------------------------------------------------------------------------- math-verify


class _Deadline(BaseException):
    """Raised by the SIGALRM handler. A BaseException, so math-verify's and SymPy's
    ``except Exception`` clauses do not swallow it."""


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns that its own timeout is off; ours replaces it, so drop that line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())


def _gold_text(answer: str) -> str:
    """The gold answer as LaTeX math for math-verify's parser."""
    boxed = extract_boxed(answer)
    s = (boxed if boxed is not None else answer).strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s.strip("$")
    return s


def _verify_inline(predicted: str, gold: str) -> bool:
    """math-verify's parse + verify with its signal-based timeouts off (no deadline)."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    if not gold_parsed:
        return False
    pred_parsed = parse(f"${predicted}$", parsing_timeout=None)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _verify_with_alarm(predicted: str, gold: str, seconds: float) -> bool:
    """_verify_inline under a SIGALRM deadline (main thread only); restores any timer
    the caller had running (e.g. pytest-timeout)."""

    def on_alarm(signum, frame):
        raise _Deadline()

    import math_verify  # noqa: F401  (the first import, ~0.3 s, is not part of the deadline)

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return _verify_inline(predicted, gold)
    except _Deadline:
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            remaining = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, old_interval)


_WORKER_START_TIMEOUT_S = 120.0


class _WorkerStartError(RuntimeError):
    """The worker process could not start: an environment problem, reported rather than
    silently scoring every completion 0."""


def _read_line(proc: subprocess.Popen, deadline: float) -> Optional[bytes]:
    """One reply line from the worker (without the newline), or None past ``deadline``
    (time.monotonic()) or when the worker has exited."""
    reply = b""
    while not reply.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            return None
        chunk = proc.stdout.read(64)
        if not chunk:
            return None
        reply += chunk
    return reply.strip()


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()


class _Worker:
    """A child Python process that runs _verify_inline for threads other than the main
    one (signals only reach the main thread). It is killed, and restarted on the next
    call, when a check runs past its deadline. Calls are serialised by a lock, so one
    call's timeout never kills another call's work. A plain subprocess rather than
    multiprocessing, so the caller's __main__ is never re-imported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dir holding erpo/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-c", "from erpo.rewards import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
        )
        # Start-up (Python + SymPy imports) is not part of any call's deadline.
        if _read_line(proc, time.monotonic() + _WORKER_START_TIMEOUT_S) != b"ready":
            _kill(proc)
            raise _WorkerStartError(
                f"the math-verify worker process ({sys.executable} -c 'from erpo.rewards import _serve') "
                "did not start; its error is on stderr")
        return proc

    def verify(self, predicted: str, gold: str, seconds: float) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write(json.dumps([predicted, gold]).encode() + b"\n")
                reply = _read_line(proc, time.monotonic() + seconds)
            except OSError:
                reply = None
            if reply is None:  # too slow, or the child died
                self._close()
                return False
            return reply == b"1"

    def _close(self) -> None:
        if self._proc is not None:
            _kill(self._proc)
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._close()


def _serve() -> None:
    """The worker's loop: one JSON [predicted, gold] per stdin line -> "1" or "0" per line."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the replies
    import math_verify  # noqa: F401  (pay the import before saying ready)

    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        predicted, gold = json.loads(line)
        try:
            ok = _verify_inline(predicted, gold)
        except Exception:
            ok = False
        out.write(b"1\n" if ok else b"0\n")
        out.flush()


_WORKER = _Worker()
atexit.register(_WORKER.close)


def _deadline_kind() -> str:
    """How this thread can bound a call: "alarm" (main thread, POSIX), "worker" (other
    threads, POSIX), "none" (no SIGALRM and no select on pipes: Windows)."""
    if not hasattr(signal, "setitimer"):
        return "none"
    return "alarm" if threading.current_thread() is threading.main_thread() else "worker"


def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 if math-verify finds the completion's boxed answer equivalent to ``answer``.

    ``answer`` is the gold answer as LaTeX or plain math ("\\frac{1}{2}", "0.5",
    "2x+1"; a ``\\boxed{}`` or ``$...$`` around it is removed). Returns 0.0 when the
    completion has no boxed answer, either side fails to parse, or the check runs past
    ``MATH_VERIFY_TIMEOUT_S`` seconds; it never raises on bad input. Safe from any
    thread: the main thread uses a SIGALRM timer (which replaces, then restores, any
    ITIMER_REAL the caller set), other threads a killable worker process; the only
    exception it raises is a RuntimeError when that process cannot start at all.
    """
    predicted = extract_answer(completion)
    if predicted is None or not predicted.strip():
        return 0.0
    if _normalise(predicted) == _normalise(answer):
        return 1.0  # no need to involve SymPy
    gold = _gold_text(answer)
    if not gold or len(predicted) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return 0.0
    try:
        kind = _deadline_kind()
        if kind == "alarm":
            ok = _verify_with_alarm(predicted, gold, MATH_VERIFY_TIMEOUT_S)
        elif kind == "worker":
            ok = _WORKER.verify(predicted, gold, MATH_VERIFY_TIMEOUT_S)
        else:
            ok = _verify_inline(predicted, gold)
    except _WorkerStartError:
        raise
    except (Exception, _Deadline):  # math-verify should not raise; bad input must never crash training
        return 0.0
    return 1.0 if ok else 0.0


# ----------------------------------------------------------------------------- registry

REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match_reward,
    "math_verify": math_verify_reward,
}


def get_reward_fn(name: str) -> Callable[[str, str], float]:
    """The reward function registered as ``name`` (a key of ``REWARDS``)."""
    try:
        return REWARDS[name]
    except KeyError:
        known = ", ".join(sorted(REWARDS))
        raise ValueError(f"reward: unknown reward {name!r}; known rewards: {known}") from None


def check_overlong(buffer: int, penalty: float, max_new_tokens: int) -> None:
    """ValueError naming the key unless 0 <= buffer <= max_new_tokens (integers) and
    penalty is a finite number >= 0; a max_new_tokens <= 0 (0: auto, not yet resolved)
    bounds nothing."""
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0:
        raise ValueError(f"overlong_buffer={buffer!r} must be an integer >= 0 (0 = no overlong shaping)")
    if max_new_tokens > 0 and buffer > max_new_tokens:
        raise ValueError(f"overlong_buffer={buffer} exceeds max_new_tokens={max_new_tokens}: the penalty starts "
                         f"max_new_tokens - overlong_buffer tokens in; lower overlong_buffer or raise max_new_tokens")
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0.0 <= penalty < float("inf"):
        raise ValueError(f"overlong_penalty={penalty!r} must be a finite number >= 0")


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's DAPO reward
    manager), added to the reward of a response of `length` tokens (its EOS included):

        0                                              length <= max_new_tokens - buffer
        -penalty * (length - (max_new_tokens - buffer)) / buffer     beyond, down to -penalty

    (a response is at most max_new_tokens long). buffer 0: always 0."""
    check_overlong(buffer, penalty, max_new_tokens)
    if buffer == 0:
        return 0.0
    exceed = length - (max_new_tokens - buffer)
    return min(-exceed / buffer * penalty, 0.0)
